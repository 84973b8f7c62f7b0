"""The two ways simddp keeps time, both on the simpy core (:mod:`~simddp.engines.core`).

* co-simulation of a live fake cluster: :mod:`~simddp.engines.clock` (a rank's virtual
  clock), :mod:`~simddp.engines.dispatch` (the per-op path), :mod:`~simddp.engines.checks`
  (races, timeouts), :mod:`~simddp.engines.simulate` (:func:`simulate`);
* trace-driven replay: :mod:`~simddp.engines.capture` (at real size on the meta device:
  :mod:`~simddp.engines.meta`), :mod:`~simddp.engines.plan`,
  :mod:`~simddp.engines.run` (:func:`replay`), :mod:`~simddp.engines.sweep`.
"""

from .capture import capture
from .core import Channel, CollectiveProcess, Fabric, at
from .plan import CapturedIteration
from .replaying import replay
from .simulate import Observer, mark_iteration, now, simulate
from .sweep import sweep

__all__ = ["simulate", "Observer", "now", "mark_iteration", "capture", "replay", "sweep",
           "CapturedIteration", "Fabric", "Channel", "CollectiveProcess", "at"]
