"""Memory events of a plain forward and backward: what is live beyond what autograd saves.

:class:`LiveBytes` is a ``TorchDispatchMode`` that records every storage an op creates (its
bytes) and when it dies (a ``weakref.finalize`` on the storage), in order. Run over one
forward, loss and backward of a model outside virtual time (on the meta device for a
real-size capture), it gives the step's *temporaries*: bytes live at some moment that are
neither saved for backward, nor parameters, nor their gradients — at the loss of a
large-vocabulary model, the logits' fp32 copies and their gradient (torch's
``MemTracker`` calls them *Temp*). The planners allocate them on top of the saved
activations where the step's transient peaks (the start of backward).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch

from ..compat import TorchDispatchMode, tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Records ``("alloc", key, nbytes)`` for each new storage an op outputs and ``("free",
    key)`` when it dies; storages of ``exclude`` (parameters) are never counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self._serial = 0
        self._live: dict[int, int] = {}  # storage address -> serial of its live allocation
        self._excluded = {t.untyped_storage()._cdata for t in exclude}

    def _freed(self, cdata: int, serial: int) -> None:
        if self._live.get(cdata) == serial:
            del self._live[cdata]
        self.events.append(("free", serial))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage
                continue
            key = st._cdata
            if key in self._excluded or key in self._live:
                continue
            self._serial += 1
            self._live[key] = self._serial
            self.events.append(("alloc", self._serial, st.nbytes(), key))
            weakref.finalize(st, self._freed, key, self._serial)
        return out

    def peak_beyond(self, keep: set[int]) -> int:
        """The most bytes live at once among storages not in ``keep`` (addresses of storages
        still alive, accounted elsewhere: saved activations, gradients)."""
        kept = {self._live[c] for c in keep if c in self._live}
        live = peak = 0
        sizes: dict[int, int] = {}
        for ev in self.events:
            if ev[0] == "alloc":
                if ev[1] in kept:
                    continue
                sizes[ev[1]] = ev[2]
                live += ev[2]
                peak = max(peak, live)
            else:
                live -= sizes.pop(ev[1], 0)
        return peak
