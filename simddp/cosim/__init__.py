"""Co-simulation: the fake cluster run under virtual time, and the capture replay starts from.

* :mod:`~simddp.cosim.clock` (a rank's virtual clock), :mod:`~simddp.cosim.dispatch` (the
  per-op path), :mod:`~simddp.cosim.checks` (races, timeouts), :mod:`~simddp.cosim.simulate`
  (:func:`simulate`);
* the coarse path for repeated work: :mod:`~simddp.cosim.tape` (backward passes),
  :mod:`~simddp.cosim.modules` (module calls), :mod:`~simddp.cosim.optim_steps` (optimizer steps);
* :mod:`~simddp.cosim.capture`: one iteration recorded for replay (:mod:`simddp.program`);
  :mod:`~simddp.cosim.capture_fsdp` (FSDP2, HSDP, with TP) and
  :mod:`~simddp.cosim.capture_pp` (pipeline parallelism, with FSDP2 and TP inside stages),
  :mod:`~simddp.cosim.context_parallel` (context parallelism: torch's ring attention, with
  FSDP2 and TP; :mod:`~simddp.cosim.ring_attention` runs torch's ring on CPU/meta ranks).
"""

from .capture import capture
from .simulate import Observer, mark_iteration, now, simulate

__all__ = ["simulate", "Observer", "now", "mark_iteration", "capture"]

import os as _os

from fakepg.sites import skip_package as _skip_package

# fakepg's user_site() skips simddp's frames (the package root: drivers and engines alike);
# registered here, where simddp first runs programs on fakepg, so `import simddp` stays light
_skip_package(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
