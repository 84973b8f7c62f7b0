"""A rank's virtual clock in co-simulation: per-op costs and noise, spans, waits, the
collectives in flight and the stream semantics of tensors they write.

See :mod:`simddp.cosim.simulate` for the rules; :mod:`simddp.cosim.dispatch` charges
ops to these clocks, :mod:`simddp.cosim.checks` words the races and timeouts found here.
"""

from __future__ import annotations

import array
import math
import types
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..models import noise
from ..compat import OpOverload, current_graph_task_id, queue_callback
from ..models.kernels import moves_no_data
from . import checks, tape
from .bound import bind, current
from .checks import ptr
from .flight import Flight

if TYPE_CHECKING:
    from .dispatch import ClockMode
    from .simulate import Simulator

__all__ = ["RankClock", "Flight", "current", "ptr"]

_gtid = current_graph_task_id
_Tensor = torch.Tensor
EMPTY: Any = types.MappingProxyType({})
_OP_NOISE_BITS = 16  # per-op noise: a table of 2**16 factors per rank (see RankClock)
_OP_NOISE_MASK = (1 << _OP_NOISE_BITS) - 1
assert _OP_NOISE_MASK == 0xFFFF  # written out as a literal in ClockMode.__torch_dispatch__
# Ops advance a rank's clock in integer ticks of 2**-80 s, summed exactly since the clock was
# last set (by a wait, a callback): a float sum would depend on the order of the ops (float
# addition is not associative: 1-ulp differences), and torch itself runs some ops in a
# run-dependent order. Costs are truncated to whole ticks (exact for costs >= 2**-28 s).
_PER_S = 2.0 ** 80
TICK = 2.0 ** -80
_floor = math.floor  # (cheaper than int() for a float)

FWD, BWD, OPT, CB, WAIT = 0, 1, 2, 3, 4
MEMO, CALL, FREE = "memo", "call", "free"  # how an op's cost is found (see classify)
_MEMO_LIMIT = 100_000
# Profiler bookkeeping ops (record_function enter/exit): not work, and not part of any phase.
FREE_PACKETS = {getattr(torch.ops.profiler, n) for n in
                 ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
                 if hasattr(torch.ops.profiler, n)}
KIND_NAMES = ("forward", "backward", "optimizer", "callback", "wait")


_no_access: dict[Any, bool] = {}  # func -> True when it never reads/writes tensor data


def _stream_name(func: Any, seconds: float) -> bytes:
    """The name of an op's noise stream, the same in every process (never an id or a hash):
    its function and its cost (equal costs read alike: 0.0 and -0.0, 1 and 1.0)."""
    name = str(func) if isinstance(func, OpOverload) else \
        f"{type(func).__module__}.{type(func).__qualname__}:{getattr(func, '__name__', '')}"
    return f"{name}|{float(seconds) + 0.0!r}".encode()


class RankClock:
    """A rank's virtual clock and everything the per-op path needs, in one object."""

    def __init__(self, sim: "Simulator", rank: int, jitter_seed: int) -> None:
        t = sim.timing
        self.sim = sim
        self.rank = rank
        # The clock (a property) is base + ticks·TICK: ops add their integer ticks to ticks
        # (see _PER_S), and setting the clock (a wait, a callback) sets base and zeroes ticks.
        self.base = 0.0
        self.ticks = 0
        self.op_time = t.compute.op_time
        # func -> the entry (see entry) of its constant cost, or MEMO, CALL or FREE
        self.costs: dict[Any, Any] = {}
        # (func, out shape and dtype, arg shapes/dtypes/values) -> entry (see entry)
        self.memo: dict[tuple, Any] = {}
        self.scale = 1.0 / t.speed(rank)
        self.per_s = self.scale * _PER_S  # ticks per second of cost, 1/speed included
        self.jitter = float(t.jitter)
        # Per-op noise (jitter > 0): a table of mean-1 log-normal factors (times 1/speed)
        # drawn once from (seed, rank), and a noise stream [next index, stride] per (function,
        # cost): the k-th such op on this rank takes the factor at (start + k·stride) mod the
        # table size, start and stride (odd: 2**16 distinct factors before one repeats)
        # derived from crc32 of the stream's name. So an op's factor depends on what it is
        # and how many like it came before, not on where torch scheduled it among different
        # ops; and ops that share a stream cost the same, so which of them takes which factor
        # changes no sum.
        self.noise: array.array | None = None
        self.streams: dict[bytes, list[int]] = {}  # stream name -> [next index, stride]
        self.call_entries: dict[tuple, Any] = {}  # (func, seconds) -> entry (CALL ops)
        self.jitter_seed = jitter_seed
        if self.jitter > 0:
            self.noise = self._noise_table(self.scale)
        # slow_rank faults (simddp.faults): the current slowdown, constant while the clock is
        # in [fault_lo, fault_hi); FaultClockMode re-reads it when the clock leaves it. Each
        # slowdown keeps its own caches (ticks and noise include 1/speed), so crossing back
        # and forth costs nothing after the first time.
        self.rank_faults = [f for f in getattr(t, "faults", ())
                            if getattr(f, "rank", None) == rank]
        self.slowdown = 1.0
        self.fault_lo, self.fault_hi = (0.0, 0.0) if self.rank_faults else (-math.inf, math.inf)
        self._by_slowdown: dict[float, tuple] = {}
        self.override: int | None = None  # OPT inside optimizer.step, CB inside callbacks
        self.phase: int | None = None
        self.span_start = 0.0
        self.spans: list[tuple[int, float, float, str | None]] = []
        self.gtid = -1
        self.watched: dict[int, list[Flight]] = {}
        self.flights: list[Flight] = []  # not yet retired
        self.history: list[Flight] = []  # all, in issue order
        self.opt_depth = 0
        self.boundaries: list[float] = []
        self.cb_clock = 0.0  # end of the side stream (future callbacks, see side_op)
        self._side_spans: list[tuple[float, float]] = []
        self.cb_saved: list[tuple[float, int | None, float]] = []  # clock, override, cb start
        self.mode: ClockMode | None = None
        self.finished_at: float | None = None
        # The coarse path (simddp.cosim.tape): tapes by backward key (None: never coarse);
        # while a backward is recorded, rec and its op list rec_ops (ClockMode appends);
        # while one is replayed, play.
        self.coarse = bool(getattr(sim, "coarse", False)) and tape.pure(t.compute)
        self.tapes: dict[tuple, Any] = {}
        self.rec: Any = None
        self.rec_ops: list | None = None
        self.play: Any = None
        self.subgraphs: dict = {}  # module calls' subgraphs for the next backward's key
        self.fwd_context: list = []  # DDP forwards (and their sync flags) since it
        self.popped: Any = None  # ClockMode, while an optimizer step is replayed (steps)
        self.step_rec: Any = None  # (key, previous tape) while one is recorded

    def _noise_table(self, scale: float) -> array.array:
        rng = noise.generator(self.jitter_seed, 0, self.rank)
        table = noise.lognormal(rng, self.jitter, 1 << _OP_NOISE_BITS) * scale
        out = array.array("d")
        out.frombytes(table.astype(np.float64).tobytes())
        return out

    def apply_faults(self) -> None:
        """Take the slowdown of the rank's faults at the current clock (ops from here on)."""
        from ..faults import rank_slowdown
        factor, self.fault_lo, self.fault_hi = rank_slowdown(self.rank_faults, self.rank,
                                                             self.clock)
        if factor == self.slowdown:
            return
        self._by_slowdown[self.slowdown] = (self.costs, self.memo, self.call_entries,
                                            self.noise, self.per_s, self.scale)
        cached = self._by_slowdown.get(factor)
        if cached is None:
            scale = factor / self.sim.timing.speed(self.rank)
            cached = ({}, {}, {}, self._noise_table(scale) if self.jitter > 0 else None,
                      scale * _PER_S, scale)
        self.costs, self.memo, self.call_entries, self.noise, self.per_s, self.scale = cached
        self.slowdown = factor

    @property
    def clock(self) -> float:
        return self.base + self.ticks * TICK

    @clock.setter
    def clock(self, t: float) -> None:
        self.base = t
        self.ticks = 0

    # -- the per-op path helpers ----------------------------------------------------
    def cost(self, func: Any, args: tuple, kwargs: Any, out: Any) -> float:
        return self.op_time(func, args, kwargs, out)

    def bad_cost(self, func: Any, seconds: Any) -> ValueError:
        return ValueError(f"simddp: the compute model gave {func} a cost of {seconds!r} s "
                          f"(it must be a finite number of seconds)")

    def entry(self, func: Any, seconds: Any) -> Any:
        """How the per-op path charges an op of ``seconds``: without jitter its ticks (an
        int, 1/speed included); with jitter (its ticks as a float, before 1/speed and the
        noise, its noise stream, the stream's stride)."""
        try:
            if self.noise is None:
                return _floor(seconds * self.per_s)
            q = float(seconds * _PER_S)
        except (TypeError, ValueError, OverflowError):
            raise self.bad_cost(func, seconds) from None
        if not math.isfinite(q):
            raise self.bad_cost(func, seconds)
        st = self.stream(func, seconds)
        return (q, st, st[1])

    def stream(self, func: Any, seconds: Any) -> list[int]:
        """The noise stream of the ops of ``func`` that cost ``seconds`` (see __init__)."""
        name = _stream_name(func, seconds)
        st = self.streams.get(name)
        if st is None:
            h = (zlib.crc32(name) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
            st = self.streams[name] = [h >> (64 - _OP_NOISE_BITS),
                                       ((h >> 16) & _OP_NOISE_MASK) | 1]
        return st

    def memo_entry(self, key: tuple, func: Any, args: tuple, out: Any) -> Any:
        if len(self.memo) > _MEMO_LIMIT:
            self.memo.clear()  # the noise streams stay (keyed by function and cost)
        e = self.memo[key] = self.entry(func, self.cost(func, args, EMPTY, out))
        return e

    def const_entry(self, func: Any, cost: Any) -> Any:
        """What ``costs`` holds for ``func``: its class (MEMO, CALL, FREE), or the entry
        of its constant cost."""
        return self.entry(func, cost) if cost.__class__ is float else cost

    def call_entry(self, func: Any, seconds: Any) -> Any:
        """The entry of an op whose cost the memo does not hold (computed each time); with
        jitter, cached by (func, seconds) in ``call_entries``."""
        e = self.entry(func, seconds)  # raises unless seconds is a finite number
        if self.noise is not None:
            if len(self.call_entries) > _MEMO_LIMIT:
                self.call_entries.clear()  # the noise streams stay
            try:
                self.call_entries[(func, seconds)] = e
            except TypeError:  # an unhashable number (a 0-d array): not cached
                pass
        return e

    def switch(self, phase: int) -> None:
        self.close_span()
        self.phase = phase
        self.span_start = self.clock

    def new_graph_task(self, g: int) -> None:
        self.gtid = g
        try:
            queue_callback(self.end_of_backward)
        except RuntimeError:  # pragma: no cover - not inside the engine after all
            pass

    def close_span(self) -> None:
        ph = self.phase
        if ph is not None:
            if self.clock > self.span_start:
                self._append(ph, self.span_start, self.clock, None)
            self.phase = None

    def _append(self, kind: int, start: float, end: float, label: str | None) -> None:
        spans = self.spans
        if spans:
            k, s, e, lab = spans[-1]
            if k == kind and lab == label and e == start:
                spans[-1] = (k, s, end, lab)
                return
        spans.append((kind, start, end, label))

    # -- waits -----------------------------------------------------------------------
    def wait_for(self, f: Flight, label: str) -> None:
        """Move the clock to the end of ``f`` (raising if that is past the timeout)."""
        end = f.eff_end()
        if end is None:
            return
        limit = self.sim.timeout_for(f)
        if limit is not None and end > f.issue + limit:
            fire = f.issue + limit
            if fire > self.clock:
                self.close_span()
                self._append(WAIT, self.clock, fire, label)
                self.clock = fire
            raise checks.timeout_error(self, f, limit)
        if end > self.clock:
            self.close_span()
            self._append(WAIT, self.clock, end, label)
            self.clock = end
        self.retire(f)

    def retire(self, f: Flight) -> None:
        if f.retired:
            return
        f.retired = True
        for p in f.ptrs:
            lst = self.watched.get(p)
            if lst is not None:
                try:
                    lst.remove(f)
                except ValueError:
                    pass
                if not lst:
                    del self.watched[p]
        try:
            self.flights.remove(f)
        except ValueError:  # pragma: no cover
            pass

    def prune(self) -> None:
        if self.override == CB:
            return
        clock = self.clock
        for f in [f for f in self.flights if f.end is not None]:
            e = f.eff_end()
            if e is not None and e <= clock:
                self.retire(f)

    def end_of_backward(self) -> None:
        """Queued into each backward pass: the Reducer's hidden wait on its bucket futures."""
        tape.event(self, ("eob",))
        start = self.clock
        pending = [f for f in self.flights if f.stream and f.end is not None]
        pending.sort(key=lambda f: f.eff_end())
        for f in pending:
            self.wait_for(f, "wait: collectives of backward")
        observer = self.sim.observer
        if observer is not None:
            observer.backward_waited(self.rank, start, self.clock)

    # -- accesses to tensors that collectives write -------------------------------------
    def access(self, func: Any, args: tuple, kwargs: Any) -> list[Flight] | None:
        """Check an op's tensors against in-flight collectives: raise on a race, wait on
        stream semantics; returns the flights after which the op runs on the side stream."""
        skip = _no_access.get(func)
        if skip is None:
            skip = _no_access[func] = moves_no_data(func)
        if skip:
            return None
        hits: list[tuple[_Tensor, Flight]] = []
        watched = self.watched
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, _Tensor):
                p = ptr(a)
                if p in watched:
                    hits.extend((a, f) for f in watched[p])
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, _Tensor):
                        p = ptr(x)
                        if p in watched:
                            hits.extend((x, f) for f in watched[p])
        if hits and self.rec is not None:
            tape.interrupt(self, "an access to a tensor a collective writes")
        side: list[Flight] | None = None
        for tensor, f in hits:
            if f.retired:
                continue
            end = f.eff_end()
            if end is not None and end <= self.clock:
                if self.override != CB:
                    self.retire(f)
                continue
            if f.python_async:
                raise checks.race_error(self, f, func, args, kwargs, tensor)
            if end is None:
                continue
            if f.in_backward and self.override != CB and _gtid() != -1:
                # Inside backward, what touches a bucket the Reducer is reducing is a comm
                # hook's future callback, run inline because fakepg completed the future
                # first; NCCL runs it on a side stream after the collective. So does this
                # op (see side_op). The Reducer itself waits at the end of backward.
                side = [f] if side is None else side + [f]
            else:
                self.wait_for(f, f"wait (stream): {f.call.record.op} #{f.call.record.seq}")
        return side

    def side_op(self, flights: list[Flight], dt: float) -> None:
        """Charge an op to the side stream, after the collectives it depends on."""
        start = max(self.cb_clock, *[f.eff_end() for f in flights])
        end = self.cb_clock = start + dt
        self._side_spans.append((start, end))
        for f in flights:
            f.cb_end = end if f.cb_end is None or end > f.cb_end else f.cb_end
