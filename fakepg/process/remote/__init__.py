"""The rank's side of ``isolation="process"``: what runs in each rank's own OS process.

The rank process holds no part of the world. Its default group and every group it makes are
:class:`RemoteProcessGroup`\\ s, registered under the same backend name ``"fakepg"``; each
collective, p2p call, barrier, store operation and ``time.sleep`` is a request over the
rank's pipe to its proxy thread in the parent (:mod:`fakepg.process.rank_proxy`), which performs it
on the parent's fake world (:mod:`fakepg.process.process_mode`) -- so matching, validation,
rank-order results, hang verdicts and traces are exactly thread mode's. Works and futures
here mirror the proxy's: a work knows it is done when a reply says so (every reply carries
the rank's newly completed works, so ``then`` callbacks run at the same points as in thread
mode).

- :mod:`.rank`: this process's rank and its channel to the proxy;
- :mod:`.group`: :class:`RemoteProcessGroup`, whose collectives are requests;
- :mod:`.work`: :class:`RemoteWork` / :class:`RemoteFuture`, mirrors of the proxy's works;
- :mod:`.store`: :class:`RemoteStore`, handles on the world's stores;
- :mod:`.entry_points`: torch.distributed's entry points in a rank process, :func:`install`
  and :func:`run`.
"""

from .entry_points import install, run
from .group import RemoteProcessGroup
from .rank import child_rank, seed
from .store import RemoteStore
from .work import RemoteFuture, RemoteWork

__all__ = ["RemoteProcessGroup", "RemoteWork", "RemoteFuture", "RemoteStore", "child_rank",
           "install", "run", "seed"]
