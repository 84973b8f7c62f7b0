"""Co-simulation: the fake cluster (fakepg) run under virtual time.

:func:`simulate` is :func:`fakepg.spawn` plus a virtual clock per rank. The rules:

* **Compute.** A per-rank ``TorchDispatchMode`` (pushed on the rank's thread before the user's
  function runs) sees every aten op the rank executes, forward and backward, and advances the
  rank's clock by ``compute.op_time(func, args, kwargs, out) / speed(rank) × noise``. The
  noise of an op is a function of the jitter seed, the rank, the op itself (its function and
  its cost) and how many such ops the rank ran before — not of its position among the rank's
  other ops, which torch may permute from run to run (with find_unused_parameters, DDP's
  Reducer zeroes unused parameters' grads in the order of a hash map keyed by pointers); and
  the clock sums op costs exactly (in integer ticks), so such permutations change no time.
* **Collectives.** A member's issue time is its clock at the call. The collective starts at
  ``max(issue times of all members, end of the group's previous collective)`` (a communicator
  runs its collectives in order; point-to-point transfers are ordered per (group, src, dst))
  — decided by the simpy engine (:mod:`simddp.engine`): each communicator and each
  point-to-point channel is a :class:`~simddp.engine.Channel` (a simpy environment of its own
  with a capacity-1 resource) on which the collective runs as a process — and lasts
  ``network.collective_time(op, bytes, group size) × noise`` (send/recv: the "send" cost of
  the sent bytes). These times land in the trace records (``issue``, ``start``, ``end``).
* **Waits.** ``Work.wait()``, ``Future.wait()`` and synchronous calls move the waiting rank's
  clock to ``max(clock, end)``. fakepg settling a collective inside backward (before the C++
  Reducer waits where Python cannot see) is *not* a wait in virtual time.
* **Stream semantics.** Collectives whose caller waits where Python cannot see it (fakepg's
  ``hidden_wait``: the DDP Reducer's buckets in backward, Join's shadow of them) are timed
  like a stream: at the end of each backward pass (an autograd-engine callback queued at the
  pass's first op, so it runs before the Reducer's finalize callback) the rank waits for every
  such collective — the Reducer's internal wait on its bucket futures; and an op that reads or
  writes a tensor such a collective is still writing, outside backward, moves the clock to
  that collective's end. Inside backward such an op can only be a comm hook's future callback
  (fakepg completed the bucket's future before the hook attached it, so it runs inline): it
  runs on the rank's side stream, after the collective, as NCCL runs it.
* **Future callbacks** (``fut.then(cb)`` on a collective's future) run on that side stream:
  from ``max(collective end, end of the rank's previous callback)``; their ops do not advance
  the rank's main clock, and a wait on the work (or on a future chained from it) ends when
  its callbacks end.
* **Races.** Reading or writing a tensor that an asynchronous collective issued from Python
  (outside backward) is still writing — not yet issued by every member, or ending later than
  the rank's clock — with no ``wait()`` on that work first raises :class:`CollectiveRaceError`
  on that rank. View and metadata ops are not accesses. Decided from program order and
  virtual time only.
* **Timeouts.** A wait (explicit, end of backward, or stream) on a collective that ends more
  than the timeout after this rank issued it raises :class:`CollectiveTimeoutError` on the
  waiting rank at virtual time ``issue + timeout`` (NCCL's watchdog wording).
* **Phases and iterations.** Ops are attributed to "backward" when autograd's engine runs
  them (``torch._C._current_graph_task_id() != -1``), to "optimizer" inside
  ``Optimizer.step`` (global step pre/post hooks, installed only while simulating), else to
  "forward"; consecutive ops of one phase form one span. An iteration ends when an
  (outermost) optimizer step ends, or where the rank calls :func:`mark_iteration`.

Everything is a function of the program, the seed and the :class:`Timing`: reruns give
identical traces and timelines. Not modelled: contention between groups that share links
(each communicator is its own channel, see :mod:`simddp.engine`; replay models it),
host/device asynchrony beyond the side stream of callbacks, and the cost of record_function
bookkeeping ops (free).
"""

from __future__ import annotations

import array
import math
import threading
import time as _time
import types
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.optim.optimizer as _optim
from torch.utils._python_dispatch import TorchDispatchMode

import fakepg
from fakepg.errors import RankFailedError
from fakepg.hooks import WorldHooks
from fakepg.sites import user_site

from .compute import ConstantCompute, RooflineCompute, _moves_no_data
from .engine import Channel
from .errors import CollectiveRaceError, CollectiveTimeoutError
from .timeline import CommSpan, Span, Timeline
from .timing import Timing

__all__ = ["simulate", "SimResult", "now", "mark_iteration"]

_gtid = torch._C._current_graph_task_id
_Tensor = torch.Tensor
_EMPTY: Any = types.MappingProxyType({})
_NOISE_BLOCK = 4096  # network noise: drawn in blocks, one factor per collective in order
_OP_NOISE_BITS = 16  # per-op noise: a table of 2**16 factors per rank (see _RankClock)
_OP_NOISE_MASK = (1 << _OP_NOISE_BITS) - 1
assert _OP_NOISE_MASK == 0xFFFF  # written out as a literal in _ClockMode.__torch_dispatch__
# Ops advance a rank's clock in integer ticks of 2**-80 s, summed exactly since the clock was
# last set (by a wait, a callback): a float sum would depend on the order of the ops (float
# addition is not associative: 1-ulp differences), and torch itself runs some ops in a
# run-dependent order. Costs are truncated to whole ticks (exact for costs >= 2**-28 s).
_PER_S = 2.0 ** 80
_TICK = 2.0 ** -80
_floor = math.floor  # (cheaper than int() for a float)

FWD, BWD, OPT, CB, WAIT = 0, 1, 2, 3, 4
_MEMO, _CALL, _FREE = "memo", "call", "free"  # how an op's cost is found (see classify)
_MEMO_LIMIT = 100_000
# Profiler bookkeeping ops (record_function enter/exit): not work, and not part of any phase.
_FREE_PACKETS = {getattr(torch.ops.profiler, n) for n in
                 ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
                 if hasattr(torch.ops.profiler, n)}
KIND_NAMES = ("forward", "backward", "optimizer", "callback", "wait")

_tls = threading.local()  # .clock: the calling rank thread's _RankClock while simulating
_no_access: dict[Any, bool] = {}  # func -> True when it never reads/writes tensor data


def _lognormal(rng: np.random.Generator, jitter: float, n: int) -> np.ndarray:
    """``n`` mean-1 log-normal factors with relative standard deviation ``jitter``."""
    s2 = float(np.log1p(jitter * jitter))
    return rng.lognormal(-s2 / 2.0, np.sqrt(s2), n)


def _lognormal_block(rng: np.random.Generator, jitter: float, scale: float) -> list[float]:
    """A block of network noise: mean-1 log-normal factors times ``scale``."""
    return (_lognormal(rng, jitter, _NOISE_BLOCK) * scale).tolist()


def _stream_name(func: Any, seconds: float) -> bytes:
    """The name of an op's noise stream, the same in every process (never an id or a hash):
    its function and its cost (equal costs read alike: 0.0 and -0.0, 1 and 1.0)."""
    name = str(func) if isinstance(func, torch._ops.OpOverload) else \
        f"{type(func).__module__}.{type(func).__qualname__}:{getattr(func, '__name__', '')}"
    return f"{name}|{float(seconds) + 0.0!r}".encode()


class _Flight:
    """One rank's part of one collective, as virtual time sees it."""

    __slots__ = ("call", "rank", "issue", "start", "end", "cb_end", "python_async",
                 "in_backward", "stream", "ptrs", "retired")

    def __init__(self, call: Any, issue: float) -> None:
        self.call = call
        self.rank: int = call.rank
        self.issue = issue
        self.start: float | None = None
        self.end: float | None = None
        self.cb_end: float | None = None
        self.in_backward: bool = bool(call.in_backward)
        # fakepg marks calls whose caller waits from C++ (the Reducer in backward, Join's
        # shadow of it): those follow stream semantics; the rest were issued from Python.
        hidden = call.hidden_wait
        self.stream = bool(hidden) or self.in_backward
        self.python_async: bool = bool(call.record.async_op) and not self.stream
        self.ptrs: list[int] = []
        self.retired = False

    def eff_end(self) -> float | None:
        """When the work is done, future callbacks included (None before it is matched)."""
        if self.end is None:
            return None
        return self.end if self.cb_end is None or self.cb_end < self.end else self.cb_end

    def describe(self) -> str:
        rec = self.call.record
        return f"{rec.op} #{rec.seq} on group '{rec.group}' (ranks {list(rec.group_ranks)})"


class _RankClock:
    """A rank's virtual clock and everything the per-op path needs, in one object."""

    def __init__(self, sim: "_Simulator", rank: int, jitter_seed: int) -> None:
        t = sim.timing
        self.sim = sim
        self.rank = rank
        # The clock (a property) is base + ticks·_TICK: ops add their integer ticks to ticks
        # (see _PER_S), and setting the clock (a wait, a callback) sets base and zeroes ticks.
        self.base = 0.0
        self.ticks = 0
        self.op_time = t.compute.op_time
        # func -> the entry (see entry) of its constant cost, or _MEMO, _CALL or _FREE
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
        self.call_entries: dict[tuple, Any] = {}  # (func, seconds) -> entry (_CALL ops)
        if self.jitter > 0:
            rng = np.random.default_rng(np.random.SeedSequence(jitter_seed, spawn_key=(0, rank)))
            table = _lognormal(rng, self.jitter, 1 << _OP_NOISE_BITS) * self.scale
            self.noise = array.array("d")
            self.noise.frombytes(table.astype(np.float64).tobytes())
        self.override: int | None = None  # OPT inside optimizer.step, CB inside callbacks
        self.phase: int | None = None
        self.span_start = 0.0
        self.spans: list[tuple[int, float, float, str | None]] = []
        self.gtid = -1
        self.watched: dict[int, list[_Flight]] = {}
        self.flights: list[_Flight] = []  # not yet retired
        self.history: list[_Flight] = []  # all, in issue order
        self.opt_depth = 0
        self.boundaries: list[float] = []
        self.cb_clock = 0.0  # end of the side stream (future callbacks, see side_op)
        self._side_spans: list[tuple[float, float]] = []
        self.cb_saved: list[tuple[float, int | None]] = []
        self.mode: _ClockMode | None = None
        self.finished_at: float | None = None

    @property
    def clock(self) -> float:
        return self.base + self.ticks * _TICK

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
        e = self.memo[key] = self.entry(func, self.cost(func, args, _EMPTY, out))
        return e

    def const_entry(self, func: Any, cost: Any) -> Any:
        """What ``costs`` holds for ``func``: its class (_MEMO, _CALL, _FREE), or the entry
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
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
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
    def wait_for(self, f: _Flight, label: str) -> None:
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
            raise self.sim.timeout_error(self, f, limit)
        if end > self.clock:
            self.close_span()
            self._append(WAIT, self.clock, end, label)
            self.clock = end
        self.retire(f)

    def retire(self, f: _Flight) -> None:
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
        pending = [f for f in self.flights if f.stream and f.end is not None]
        pending.sort(key=lambda f: f.eff_end())
        for f in pending:
            self.wait_for(f, "wait: collectives of backward")

    # -- accesses to tensors that collectives write -------------------------------------
    def access(self, func: Any, args: tuple, kwargs: Any) -> list[_Flight] | None:
        """Check an op's tensors against in-flight collectives: raise on a race, wait on
        stream semantics; returns the flights after which the op runs on the side stream."""
        skip = _no_access.get(func)
        if skip is None:
            skip = _no_access[func] = _moves_no_data(func)
        if skip:
            return None
        hits: list[tuple[_Tensor, _Flight]] = []
        watched = self.watched
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, _Tensor):
                p = _ptr(a)
                if p in watched:
                    hits.extend((a, f) for f in watched[p])
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, _Tensor):
                        p = _ptr(x)
                        if p in watched:
                            hits.extend((x, f) for f in watched[p])
        side: list[_Flight] | None = None
        for tensor, f in hits:
            if f.retired:
                continue
            end = f.eff_end()
            if end is not None and end <= self.clock:
                if self.override != CB:
                    self.retire(f)
                continue
            if f.python_async:
                raise self.sim.race_error(self, f, func, args, kwargs, tensor)
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

    def side_op(self, flights: list[_Flight], dt: float) -> None:
        """Charge an op to the side stream, after the collectives it depends on."""
        start = max(self.cb_clock, *[f.eff_end() for f in flights])
        end = self.cb_clock = start + dt
        self._side_spans.append((start, end))
        for f in flights:
            f.cb_end = end if f.cb_end is None or end > f.cb_end else f.cb_end


def _ptr(t: _Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without storage (meta, some subclasses)
        return 0


class _ClockMode(TorchDispatchMode):
    """Charges every aten op to its rank's virtual clock. Kept lean: it runs for every op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # no torch._disable_dynamo wrapper per call (~3 µs)
        return False

    def __init__(self, r: _RankClock) -> None:
        super().__init__()
        self.r = r

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        r = self.r
        side = r.access(func, args, kwargs or _EMPTY) if r.watched else None
        if kwargs:
            out = func._op(*args, **kwargs)
        else:
            kwargs = _EMPTY
            out = func._op(*args)
        cost = r.costs.get(func)
        if cost is None:
            cost = r.costs[func] = r.const_entry(func, r.sim.classify(func))
        if cost.__class__ is not str:  # a constant's entry
            q = cost
        elif cost is _MEMO and not kwargs:
            try:
                key = (func, out.shape, out.dtype,
                       *[(a.shape, a.dtype) if isinstance(a, _Tensor) else a for a in args])
                q = r.memo[key]
            except KeyError:
                q = r.memo_entry(key, func, args, out)
            except (TypeError, AttributeError):  # unhashable args, non-tensor out: never again
                r.costs[func] = _CALL
                q = r.call_entry(func, r.cost(func, args, kwargs, out))
        elif cost is _FREE:
            return out
        else:
            q = r.cost(func, args, kwargs, out)
            if r.noise is None:
                try:
                    q = _floor(q * r.per_s)
                except (TypeError, ValueError, OverflowError):
                    raise r.bad_cost(func, q) from None
            else:
                try:
                    q = r.call_entries[(func, q)]
                except (KeyError, TypeError):
                    q = r.call_entry(func, q)
        noise = r.noise
        if noise is not None:  # q is (ticks, stream, stride): take the stream's next factor
            q, st, k = q
            i = st[0]
            st[0] = (i + k) & 0xFFFF  # _OP_NOISE_MASK
            q = _floor(q * noise[i])
        if side is not None:
            r.side_op(side, q * _TICK)
            return out
        ph = r.override
        if ph is None:
            g = _gtid()
            if g == -1:
                ph = FWD
            else:
                ph = BWD
                if g != r.gtid:
                    r.new_graph_task(g)
        if ph != r.phase:
            r.switch(ph)
        r.ticks += q  # the clock advances (exactly: see _PER_S)
        return out


# ---------------------------------------------------------------------------------------
# The world hooks
# ---------------------------------------------------------------------------------------

_OPTYPE = {"all_reduce": "ALLREDUCE", "all_reduce_coalesced": "ALLREDUCE_COALESCED",
           "broadcast": "BROADCAST", "reduce": "REDUCE", "all_gather": "ALLGATHER",
           "all_gather_into_tensor": "_ALLGATHER_BASE",
           "all_gather_into_tensor_coalesced": "ALLGATHER_COALESCED", "gather": "GATHER",
           "scatter": "SCATTER", "reduce_scatter": "REDUCE_SCATTER",
           "reduce_scatter_tensor": "_REDUCE_SCATTER_BASE",
           "reduce_scatter_tensor_coalesced": "REDUCE_SCATTER_TENSOR_COALESCED",
           "all_to_all": "ALLTOALL", "all_to_all_single": "ALLTOALL_BASE", "barrier": "BARRIER",
           "monitored_barrier": "BARRIER", "send": "SEND", "recv": "RECV"}


def _numel(xs: Any) -> int:
    n = 0
    for x in xs:
        if isinstance(x, (list, tuple)):
            n += _numel(x)
        elif isinstance(x, _Tensor):
            n += x.numel()
    return n


class _Simulator(WorldHooks):
    def __init__(self, timing: Timing, nprocs: int, seed: int) -> None:
        self.timing = timing
        self.nprocs = nprocs
        jseed = seed if timing.seed is None else timing.seed
        self.ranks = [_RankClock(self, r, jseed) for r in range(nprocs)]
        self.network = timing.network
        # One engine Channel per communicator and per point-to-point (group, src, dst):
        # see simddp.engine for why co-simulation uses a simpy environment per channel.
        self.channels: dict[Any, Channel] = {}
        self.net_noise: list[float] | None = None
        self.net_i = 0
        if timing.jitter > 0:
            self.net_rng = np.random.default_rng(np.random.SeedSequence(jseed, spawn_key=(1, 0)))
            self.net_noise = _lognormal_block(self.net_rng, timing.jitter, 1.0)
        self.fixed_timeout = timing.timeout_seconds

    def classify(self, func: Any) -> Any:
        """How the per-op path finds ``func``'s cost without calling the model when it can:
        a constant (ConstantCompute; data-free ops under the roofline), a memo keyed by the
        shapes and dtypes of the output and tensor arguments and the other arguments (the
        roofline's cost is a function of those alone; ops with list arguments or kwargs fall
        back), or a call of ``op_time`` (other models, which may depend on anything)."""
        if getattr(func, "_overloadpacket", None) in _FREE_PACKETS:
            return _FREE
        c = self.timing.compute
        if type(c) is ConstantCompute:
            return float(c.seconds_per_op)
        if type(c) is RooflineCompute:
            if _moves_no_data(func):
                return float(c.op_time(func, (), {}, None))
            return _MEMO  # a function of argument shapes, dtypes and scalars
        return _CALL

    # -- rank lifetime ------------------------------------------------------------------
    def rank_started(self, rank: int) -> None:
        r = self.ranks[rank]
        _tls.clock = r
        r.mode = _ClockMode(r)
        r.mode.__enter__()

    def rank_finished(self, rank: int) -> None:
        r = self.ranks[rank]
        r.close_span()
        r.finished_at = r.clock
        try:
            if r.mode is not None:
                r.mode.__exit__(None, None, None)
        finally:
            r.mode = None
            _tls.clock = None

    def describe_rank(self, rank: int) -> str:
        return f"virtual clock {self.ranks[rank].clock:.6f} s"

    # -- collectives --------------------------------------------------------------------
    def collective_issued(self, call: Any) -> None:
        r = self.ranks[call.rank]
        f = _Flight(call, r.clock)
        call.record.issue = r.clock
        call.ext = f
        r.prune()
        ptrs = set()
        for t in call.written():
            p = _ptr(t)
            if p:
                ptrs.add(p)
        f.ptrs = sorted(ptrs)
        for p in f.ptrs:
            r.watched.setdefault(p, []).append(f)
        r.flights.append(f)
        r.history.append(f)

    def collective_matched(self, coll: Any) -> None:
        members = coll.members()
        flights = [c.ext for c in members]
        if coll.p2p:
            send, recv = coll.calls
            key: Any = (id(coll.group), send.rank, recv.rank)
            op, nbytes, n = "send", send.record.bytes, 2
        else:
            key = id(coll.group)
            op, n = coll.op, coll.group.size
            nbytes = max(c.record.bytes for c in members)
        try:
            dur = self.network.collective_time(op, nbytes, n)
        except ValueError:  # an op the model does not know: cost it as an all_reduce
            dur = self.network.collective_time("all_reduce", nbytes, n)
        noise = self.net_noise
        if noise is not None:
            dur *= noise[self.net_i]
            self.net_i += 1
            if self.net_i == _NOISE_BLOCK:
                self.net_noise = _lognormal_block(self.net_rng, self.timing.jitter, 1.0)
                self.net_i = 0
        channel = self.channels.get(key)
        if channel is None:
            channel = self.channels[key] = Channel()
        # The collective is a simpy process on its communicator's channel: it starts at
        # max(latest issue, the channel's previous end) and holds it for dur.
        start, end = channel.submit([f.issue for f in flights], dur)
        for c, f in zip(members, flights):
            f.start, f.end = start, end
            c.record.start, c.record.end = start, end

    def completion_started(self, call: Any) -> None:
        f: _Flight | None = call.ext
        r = self.ranks[call.rank]
        r.close_span()
        r.cb_saved.append((r.clock, r.override))
        start = r.clock
        if f is not None and f.end is not None:
            start = f.end
        if r.cb_clock > start:
            start = r.cb_clock
        r.clock = start
        r.override = CB

    def completion_finished(self, call: Any) -> None:
        f: _Flight | None = call.ext
        r = self.ranks[call.rank]
        r.close_span()
        if r.clock > r.cb_clock:
            r.cb_clock = r.clock
        if f is not None and f.end is not None and r.clock > f.end \
                and (f.cb_end is None or r.clock > f.cb_end):
            f.cb_end = r.clock
        r.clock, r.override = r.cb_saved.pop()

    def wait_finished(self, rank: int, coll: Any) -> None:
        for c in coll.calls:
            if c is not None and c.rank == rank:
                f = c.ext
                if f is not None:
                    rec = c.record
                    self.ranks[rank].wait_for(f, f"wait: {rec.op} #{rec.seq}")
                return

    # -- timeouts and races -----------------------------------------------------------------
    def timeout_for(self, f: _Flight) -> float | None:
        if self.fixed_timeout is not None:
            return self.fixed_timeout
        coll = f.call.collective
        return None if coll is None else coll.group.timeout

    def timeout_error(self, r: _RankClock, f: _Flight, limit: float) -> CollectiveTimeoutError:
        call, rec = f.call, f.call.record
        ms = int(round(limit * 1000))
        numel_in = _numel(call.inputs)
        numel_out = _numel(call.outputs) or numel_in
        coll = call.collective
        last = ""
        if coll is not None:
            members = [c for c in coll.members() if c.ext is not None]
            if members:
                late = max(members, key=lambda c: c.ext.issue)
                last = (f"; it could start only at t={f.start:.6f} s, when its last member, "
                        f"rank {late.rank}, issued it at {late.site}")
        end = f.eff_end()
        msg = (f"[Rank {r.rank}] Watchdog caught collective operation timeout: "
               f"WorkFakePG(SeqNum={rec.seq + 1}, OpType={_OPTYPE.get(rec.op, rec.op.upper())}, "
               f"NumelIn={numel_in}, NumelOut={numel_out}, Timeout(ms)={ms}) ran for {ms} "
               f"milliseconds before timing out.\n"
               f"simddp (virtual time): {f.describe()} was issued by rank {r.rank} at "
               f"t={f.issue:.6f} s at {call.site} and would end at t={end:.6f} s, "
               f"{end - f.issue:.3f} s later, past the timeout of {limit:g} s{last}.")
        return CollectiveTimeoutError(msg, rank=r.rank, op=rec.op, group=rec.group, seq=rec.seq,
                                      timeout=limit, time=f.issue + limit)

    def race_error(self, r: _RankClock, f: _Flight, func: Any, args: tuple, kwargs: Any,
                   tensor: _Tensor) -> CollectiveRaceError:
        call, rec = f.call, f.call.record
        where = user_site()
        verb = "writes" if _writes(func, args, kwargs, tensor) else "reads"
        coll = call.collective
        if f.end is None:
            missing = coll.missing_ranks() if coll is not None and not coll.p2p else []
            state = (f"not every member has issued it yet (missing: ranks {missing})" if missing
                     else "it has not been matched yet")
        else:
            state = f"it runs until t={f.eff_end():.6f} s"
        name = getattr(getattr(func, "_schema", None), "name", str(func))
        msg = (f"rank {r.rank}: {name} at {where} {verb} a tensor that {f.describe()} is still "
               f"writing, with no wait() on that work first.\n"
               f"  the collective was issued with async_op=True at {call.site} (t={f.issue:.6f} s); "
               f"{state}, and the rank's clock is t={r.clock:.6f} s.\n"
               f"  Call work.wait() (or work.get_future().wait()) before touching its tensors.")
        return CollectiveRaceError(msg, rank=r.rank, op=rec.op, group=rec.group, seq=rec.seq,
                                   issued_at=call.site, accessed_at=where, time=r.clock)

    # -- results ----------------------------------------------------------------------------
    def timeline(self) -> Timeline:
        spans: list[Span] = []
        comms: list[CommSpan] = []
        for r in self.ranks:
            for kind, s, e, label in r.spans:
                spans.append(Span(r.rank, KIND_NAMES[kind], s, e, label or KIND_NAMES[kind]))
            for s, e in r._side_spans:
                spans.append(Span(r.rank, "callback", s, e, "callback (side stream)"))
            for f in r.history:
                rec = f.call.record
                comms.append(CommSpan(
                    rank=r.rank, op=rec.op, group=rec.group, group_ranks=tuple(rec.group_ranks),
                    seq=rec.seq, bytes=rec.bytes, issue=f.issue, start=f.start, end=f.end,
                    site=rec.site, in_backward=f.in_backward, p2p=rec.p2p, peer=rec.peer))
        return Timeline(self.nprocs, spans, comms,
                        [list(r.boundaries) for r in self.ranks],
                        [r.finished_at if r.finished_at is not None else r.clock
                         for r in self.ranks])


def _writes(func: Any, args: tuple, kwargs: Any, tensor: _Tensor) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    p = _ptr(tensor)
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(arg.name)
        vs = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(x, _Tensor) and _ptr(x) == p for x in vs):
            return True
    return False


# ---------------------------------------------------------------------------------------
# Optimizer hooks (global while simulating) and what a rank may ask
# ---------------------------------------------------------------------------------------

def _opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    r: _RankClock | None = getattr(_tls, "clock", None)
    if r is None:
        return
    if r.opt_depth == 0 and r.override != CB:
        r.close_span()
        r.override = OPT
    r.opt_depth += 1


def _opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    r: _RankClock | None = getattr(_tls, "clock", None)
    if r is None or r.opt_depth == 0:
        return
    r.opt_depth -= 1
    if r.opt_depth == 0 and r.override == OPT:
        r.close_span()
        r.override = None
        r.boundaries.append(r.clock)


def _current() -> _RankClock:
    r = getattr(_tls, "clock", None)
    if r is None:
        raise RuntimeError("simddp.now()/mark_iteration() work only inside a rank of "
                           "simddp.simulate(...)")
    return r


def now() -> float:
    """The calling rank's virtual clock, in seconds (only inside :func:`simulate`)."""
    return _current().clock


def mark_iteration() -> None:
    """End an iteration of the calling rank here (for loops without an optimizer step)."""
    r = _current()
    r.close_span()
    r.boundaries.append(r.clock)


# ---------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------

@dataclass
class SimResult:
    """What a simulated world leaves behind.

    returns: each rank's return value, in rank order. trace: fakepg's per-rank collective
    records, with ``issue``, ``start`` and ``end`` in virtual seconds. timeline: the
    :class:`Timeline` (spans, iterations, exports). wall_time: real seconds the run took.
    """

    returns: list[Any]
    trace: list[list[fakepg.CollectiveRecord]]
    timeline: Timeline
    nprocs: int
    seed: int
    timing: Timing
    wall_time: float = 0.0
    spawn_result: Any = field(default=None, repr=False)

    def summary(self) -> str:
        return self.timeline.summary()

    def to_json(self, path: Any = None) -> str:
        """The collective trace (with virtual times) as fakepg's JSON."""
        return fakepg.to_json(self.trace, path)


def simulate(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, *,
             timing: Timing, seed: int = 0, hang_timeout: float = 1.0) -> SimResult:
    """Run ``fn(rank, *args)`` on ``nprocs`` fake ranks (like :func:`fakepg.spawn`) with
    virtual time; see the module docstring for the rules.

    Raises what ``fakepg.spawn`` raises, except that a :class:`CollectiveRaceError` or
    :class:`CollectiveTimeoutError` that ends a rank is re-raised as itself (it carries
    ``.rank``) rather than wrapped in ``fakepg.RankFailedError``.
    """
    if not isinstance(timing, Timing):
        raise TypeError(f"simulate(timing=...) needs a simddp.Timing, got {type(timing).__name__}; "
                        f"e.g. Timing(network=Network.preset('100gbe'), "
                        f"compute=Compute.roofline('a100'))")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"simddp.simulate: nprocs must be an integer >= 1, got {nprocs!r}")
    unknown = sorted(r for r in timing.rank_speed if r >= nprocs)
    if unknown:
        raise ValueError(f"Timing.rank_speed names ranks {unknown}, but the world has ranks "
                         f"0..{nprocs - 1} (nprocs={nprocs})")
    sim = _Simulator(timing, nprocs, seed)
    opt = _optim
    handles = [opt.register_optimizer_step_pre_hook(_opt_pre),
               opt.register_optimizer_step_post_hook(_opt_post)]
    t0 = _time.perf_counter()
    try:
        res = fakepg.spawn(fn, args, nprocs, seed=seed, hooks=sim, hang_timeout=hang_timeout)
    except RankFailedError as e:
        cause = e.__cause__
        if isinstance(cause, (CollectiveRaceError, CollectiveTimeoutError)):
            raise cause from None
        raise
    finally:
        for h in handles:
            h.remove()
    return SimResult(res.returns, res.trace, sim.timeline(), nprocs, seed, timing,
                     _time.perf_counter() - t0, res)
