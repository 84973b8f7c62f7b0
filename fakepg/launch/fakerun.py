"""``fakerun``: torchrun for one process, with the fake cluster underneath.

Usage::

    fakerun --nproc-per-node 4 train.py --epochs 2
    fakerun --standalone --nproc_per_node=4 -m mypkg.train
    fakerun --nproc-per-node 8 --local-ranks-filter 0 --seed 3 train.py
    fakerun --nproc-per-node 2 --log-dir logs --tee 3 train.py

``fakerun`` takes torchrun's own command line (its parser is
``torch.distributed.run.get_args_parser()``, so every torchrun flag, and the ``PET_*``
variables that set them, are accepted) plus ``--seed N``, the fake cluster's seed for each
rank's initial RNG state. The script runs unmodified, as ``__main__``, once per rank, each
rank on its own thread of this one process (``--isolation process``: each rank in its own OS
process forked from this one, on the same fake world):

- each rank sees the environment torchrun's agent gives a worker: ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
  ``ROLE_NAME``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (``--master-addr``,
  ``--master-port``; default 127.0.0.1:29500), ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``,
  default ``none`` so that runs repeat exactly), ``TORCHELASTIC_RESTART_COUNT``,
  ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_USE_AGENT_STORE`` (``False``: no agent
  store exists), ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``OMP_NUM_THREADS`` (1 with several
  ranks unless set) and, with a log directory, ``TORCHELASTIC_ERROR_FILE``;
- each rank owns its ``sys.argv``: ``[script, *args]`` (torchrun's ``${local_rank}`` replaced
  by the rank's), and ``sys.path[0]`` is the script's directory, as under ``python script.py``;
  with ``-m`` the module's file and the current directory, as under ``python -m``;
- nothing is initialised when the script starts: its own ``dist.init_process_group`` (any
  backend, any init method) sets the fake world up, with the timeout it passes;
- every line a rank writes to stdout/stderr is prefixed ``[rank<N>]:`` (or by the template in
  ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``, with ``${rank}``, ``${local_rank}``,
  ``${role_name}``); ``--local-ranks-filter 0,1`` shows only those ranks; ``--redirects``/
  ``--tee`` write ``<log-dir>/<run-id>_*/attempt_0/<rank>/std{out,err}.log`` as torchrun does.

``dist.init_process_group("nccl"/"gloo"/...)`` joins the fake world, which answers as gloo
(torchrun's workers on a CPU) until the program asks for another backend. Exit status, as
torchrun's: 0 when every rank finished (also after errors the ranks caught themselves); 1 with
the root cause on stderr (a rank's own exception, else the hang or mismatch report); 2 for a
command line that cannot run here (``--nnodes`` above 1, ``--node-rank`` other than 0,
``--max-restarts`` above 0, ``--rdzv-endpoint`` on another host, ``--no-python``, a bad
``--nproc-per-node``). Other flags about processes, rendezvous and signals (``--standalone``,
``--rdzv-backend``, ``--start-method``, ``--monitor-interval``, ``--numa-binding``, ...) are
accepted and have nothing to act on; ``fakerun --help`` lists each group.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from string import Template
from typing import Sequence

from ..errors import (CollectiveHangError, CollectiveMismatchError, FakePGError, RankExited,
                      RankFailedError, RankOsExit, SpawnTimeoutError, WorldAbortedError)
from .rank_output import rank_output
from .spawn import spawn

__all__ = ["main"]


# What a rank raises because of the world, not of its own doing: the closing report says it once.
_CONSEQUENCES = (CollectiveHangError, CollectiveMismatchError, WorldAbortedError, SpawnTimeoutError)


class _UsageError(Exception):
    """A command line fakerun cannot run; printed as one line, exit status 2."""


# torchrun's flags by what fakerun does with them (by argparse dest). Every one is parsed by
# torchrun's own parser, so spellings, PET_* variables and defaults stay torchrun's.
_ACTED_ON = {
    "nproc_per_node": "the world size",
    "module": "run the target as python -m does",
    "run_path": "the script runs in this interpreter (always so here)",
    "master_addr": "MASTER_ADDR of every rank", "master_port": "MASTER_PORT of every rank",
    "rdzv_id": "TORCHELASTIC_RUN_ID of every rank (default none, so runs repeat exactly)",
    "role": "ROLE_NAME", "virtual_local_rank": "LOCAL_RANK 0 for every rank",
    "log_dir": "where --redirects/--tee write", "redirects": "per-rank log files",
    "tee": "per-rank log files and the console", "local_ranks_filter": "ranks whose output shows",
}
_SINGLE_VALUED = {  # accepted only with the one value that means something in one process
    "nnodes": "only 1 (or 1:1): the fake cluster is one node; --nproc-per-node sets the world "
              "size",
    "node_rank": "only 0",
    "max_restarts": "only 0: a failed run is not restarted (a deterministic world would fail the "
                    "same way again)",
    "rdzv_endpoint": "only a host of this machine (another host means several nodes)",
    "no_python": "refused: fakerun runs Python scripts and modules in this interpreter",
}
_FAKERUN_DESCRIPTION = """\
torchrun for one process: every rank of the job is a thread of this process
(or, with --isolation process, a process forked from it) on a deterministic
fake cluster (fakepg). The script runs unmodified, once per rank, as __main__,
and starts as a torchrun worker does: its environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*), its own sys.argv, and nothing
initialised until it calls init_process_group (any backend; its timeout holds).

Exit status: 0 when every rank finished, also after errors the ranks handled
themselves; 1 with the root cause (a rank's exception, or the hang or mismatch
report) on stderr; 2 for a command line that cannot run here."""
_FAKERUN_EPILOG = "example: fakerun --nproc-per-node 4 --seed 3 train.py --epochs 2"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One spelling per flag (torchrun's dashed one; the underscored one is accepted too), so
    that the help fits 80 columns."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        short = [o for o in action.option_strings if not o.startswith("--")]
        long = [o for o in action.option_strings if o.startswith("--") and "_" not in o]
        text = ", ".join(short[:1] + long[:1]) or action.option_strings[0]
        if action.nargs != 0:
            text += " " + self._format_args(action, self._get_default_metavar_for_optional(action))
        return text


def _parser() -> argparse.ArgumentParser:
    """fakerun's flags first, then torchrun's own (its parser's actions), grouped by what
    fakerun does with each."""
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    actions = {a.dest: a for a in torchrun._actions if a.dest != "help"}
    p = argparse.ArgumentParser(
        prog="fakerun", formatter_class=_HelpFormatter,
        usage="fakerun [options] training_script [script args ...]",
        description=_FAKERUN_DESCRIPTION, epilog=_FAKERUN_EPILOG)
    own = p.add_argument_group("fakerun's own options")
    own.add_argument("--isolation", choices=("thread", "process"), default="thread",
                     help="thread: every rank a thread of this process (fastest); process: "
                          "every rank its own OS process forked from this one (module globals, "
                          "pid, cwd, signal handlers per rank), on the same deterministic world")
    own.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="wall-clock limit for the whole world; at expiry every rank's state "
                          "and Python stack is reported and fakerun exits 1")
    own.add_argument("--seed", type=int, default=0,
                     help="the fake cluster's seed: fixes each rank's initial torch/Python/numpy "
                          "RNG state (same seed, same results)")
    acted = p.add_argument_group("torchrun options fakerun acts on")
    single = p.add_argument_group("torchrun options with one possible value (any other is refused, "
                                  "exit status 2)")
    quiet = p.add_argument_group("torchrun options accepted and ignored (nothing to act on in "
                                 "one process)")
    for dest, action in actions.items():
        if not action.option_strings:
            p._add_action(action)  # training_script, training_script_args
        elif dest in _ACTED_ON:
            action.help = _ACTED_ON[dest]
            acted._add_action(action)
        elif dest in _SINGLE_VALUED:
            action.help = _SINGLE_VALUED[dest]
            single._add_action(action)
        else:
            action.help = "torchrun: " + _first_sentence(action.help or "")
            quiet._add_action(action)
    return p


@dataclass
class _Plan:
    """What one fakerun invocation runs, derived from the command line."""

    nproc: int
    target: str
    module: bool
    argv: list[str]
    path0: str
    master_port: int
    seed: int
    timeout: float | None
    env: list[dict[str, str]]
    prefixes: list[str]
    show_out: list[bool]
    show_err: list[bool]
    files: list[tuple[str | None, str | None]] = field(default_factory=list)
    isolation: str = "thread"


def _nproc(value: str) -> int:
    from torch.distributed.run import determine_local_world_size

    try:
        n = determine_local_world_size(value)
    except ValueError:
        raise _UsageError(f"--nproc-per-node {value}: expected an integer >= 1 or one of "
                          f"auto, cpu, gpu, xpu") from None
    if n < 1:
        raise _UsageError(f"--nproc-per-node {value}: expected an integer >= 1")
    return n


def _check_single_node(args: argparse.Namespace) -> None:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        raise _UsageError(f"--nnodes {args.nnodes}: expected N or MIN:MAX") from None
    if (low, high) != (1, 1):
        raise _UsageError(f"--nnodes {args.nnodes}: the fake cluster is a single node in one "
                          f"process; use --nnodes 1 and set --nproc-per-node to the total world size")
    if args.node_rank != 0:
        raise _UsageError(f"--node-rank {args.node_rank}: the fake cluster is one node, rank 0")
    if args.no_python:
        raise _UsageError("--no-python: fakerun runs Python scripts and modules in this interpreter")
    if args.max_restarts != 0:
        raise _UsageError(f"--max-restarts {args.max_restarts}: fakerun does not restart a failed "
                          f"run (its deterministic world would fail the same way again); use 0")
    if not args.standalone and args.rdzv_endpoint and not _local_host(args.rdzv_endpoint):
        raise _UsageError(f"--rdzv-endpoint {args.rdzv_endpoint}: a rendezvous on another host "
                          f"joins several nodes; the fake cluster is one node in this process "
                          f"(drop the flag, or name localhost)")


def _first_sentence(text: str) -> str:
    head = text.split(". ")[0].strip().rstrip(".")
    return head if len(head) <= 70 else head[:67] + "..."


def _local_host(endpoint: str) -> bool:
    """Whether a rendezvous endpoint (``host[:port]``) names this machine."""
    import socket

    host = endpoint.strip()
    if host.startswith("["):  # [ipv6]:port
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host in ("", "localhost", "::1", "0.0.0.0", socket.gethostname()) \
        or host.startswith("127.")


def _plan(args: argparse.Namespace) -> _Plan:
    _check_single_node(args)
    n = _nproc(args.nproc_per_node)
    target = args.training_script
    if args.module:
        path0 = os.getcwd()
        argv0 = _module_file(target, path0)
    else:
        if not os.path.isfile(target):
            raise _UsageError(f"can't open file {os.path.abspath(target)!r}: no such file")
        path0 = os.path.dirname(os.path.realpath(target))
        argv0 = target
    port = 29500 if args.master_port is None else args.master_port
    local = [0 if args.virtual_local_rank else r for r in range(n)]
    env = [_rank_env(args, r, local[r], n, port) for r in range(n)]
    template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    prefixes = [f"[rank{r}]:" if not template else
                Template(template).safe_substitute(role_name=args.role, rank=r, local_rank=local[r])
                for r in range(n)]
    if args.timeout is not None and not args.timeout > 0:
        raise _UsageError(f"--timeout {args.timeout}: expected a number of seconds > 0")
    plan = _Plan(n, target, bool(args.module), [argv0, *args.training_script_args], path0, port,
                 args.seed, args.timeout, env, prefixes, [True] * n, [True] * n)
    plan.isolation = args.isolation
    _plan_logs(args, plan)
    return plan


def _module_file(name: str, path0: str) -> str:
    """The file ``python -m name`` puts in sys.argv[0] (a package runs its __main__)."""
    saved = sys.path[:]
    sys.path.insert(0, path0)
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(name + ".__main__")
    except ImportError:
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None or not spec.origin:
        raise _UsageError(f"No module named {name}")
    return spec.origin


def _rank_env(args: argparse.Namespace, rank: int, local_rank: int, n: int, port: int) -> dict[str, str]:
    """What torchrun's LocalElasticAgent._start_workers puts in a worker's environment."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
           "ROLE_RANK": str(rank), "ROLE_NAME": args.role, "ROLE_WORLD_SIZE": str(n),
           "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port),
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": str(args.max_restarts),
           "TORCHELASTIC_RUN_ID": args.rdzv_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    omp = os.environ.get("OMP_NUM_THREADS", "1" if n > 1 else None)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env


def _plan_logs(args: argparse.Namespace, plan: _Plan) -> None:
    """torchrun's --redirects/--tee/--log-dir/--local-ranks-filter, per rank."""
    from torch.distributed.elastic.multiprocessing.api import Std, to_map

    def streams(flag: str, value: str) -> dict:
        try:
            return to_map(Std.from_str(value), plan.nproc)
        except ValueError:
            raise _UsageError(f"{flag} {value}: expected 0-3 or LOCAL_RANK:0-3,... (1 stdout, "
                              f"2 stderr, 3 both)") from None

    redirects, tees = streams("--redirects", args.redirects), streams("--tee", args.tee)
    shown: set[int] | None = None
    if args.local_ranks_filter:
        try:
            shown = set(map(int, args.local_ranks_filter.split(",")))
        except ValueError:
            raise _UsageError(f"--local-ranks-filter {args.local_ranks_filter}: expected a "
                              f"comma-separated list of integers, e.g. 0,1,2") from None
        outside = sorted(r for r in shown if not 0 <= r < plan.nproc)
        if outside:  # torchrun would show nothing at all, silently
            raise _UsageError(f"--local-ranks-filter {args.local_ranks_filter}: no local rank "
                              f"{', '.join(map(str, outside))}; the local ranks are "
                              f"0..{plan.nproc - 1} (--nproc-per-node {plan.nproc})")
    to_file = [redirects.get(r, Std.NONE) | tees.get(r, Std.NONE) for r in range(plan.nproc)]
    attempt = None
    if args.log_dir or any(to_file):
        base = args.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
        if os.path.exists(base) and not os.path.isdir(base):
            raise _UsageError(f"--log-dir {base}: exists and is not a directory; name a "
                              f"directory (it is created if missing)")
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as e:
            raise _UsageError(f"--log-dir {base}: cannot create it ({e.strerror})") from None
        attempt = os.path.join(tempfile.mkdtemp(prefix=f"{args.rdzv_id}_", dir=base), "attempt_0")
    for r in range(plan.nproc):
        visible = shown is None or r in shown  # one node: local rank r is global rank r
        paths: list[str | None] = [None, None]
        for i, (std, name) in enumerate(((Std.OUT, "stdout"), (Std.ERR, "stderr"))):
            redirected = to_file[r] & std == std
            teed = tees.get(r, Std.NONE) & std == std
            if redirected and attempt is not None:
                paths[i] = os.path.join(attempt, str(r), f"{name}.log")
            (plan.show_out if i == 0 else plan.show_err)[r] = visible and (teed or not redirected)
        if attempt is not None:
            os.makedirs(os.path.join(attempt, str(r)), exist_ok=True)
            plan.env[r]["TORCHELASTIC_ERROR_FILE"] = os.path.join(attempt, str(r), "error.json")
        plan.files.append((paths[0], paths[1]))


def _run(plan: _Plan) -> None:
    def rank_main(rank: int) -> None:
        # Each rank owns its sys.argv (fakepg.world.isolation), with torchrun's ${local_rank} macro.
        sys.argv = [a.replace("${local_rank}", plan.env[rank]["LOCAL_RANK"]) for a in plan.argv]
        try:
            if plan.module:
                runpy.run_module(plan.target, run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(plan.target, run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                code = e.code if isinstance(e.code, int) else 1  # sys.exit("message"): 1
                if not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)  # as Python prints it on its way out
                exited = RankExited(f"the script exited with status {e.code}", code)
                exited._fakepg_printed = True  # type: ignore[attr-defined]  # Python prints none
                raise exited from e
        except RankOsExit as e:
            e._fakepg_printed = True  # type: ignore[attr-defined]  # os._exit prints nothing
            raise
        except Exception as e:
            if not isinstance(e, _CONSEQUENCES):
                # as the worker's Python prints it as it exits, in the rank's stream, when it
                # fails (the other ranks may run on): the closing report need not repeat it
                traceback.print_exc()
                e._fakepg_printed = True  # type: ignore[attr-defined]
            raise

    # Set for the run and put back after it (sys.path[0] is shared by the ranks; runpy's own
    # swaps of __main__ interleave across rank threads, so the host's is restored here too).
    saved_argv, saved_path0, saved_main = sys.argv, sys.path[0], sys.modules.get("__main__")
    sys.argv, sys.path[0] = list(plan.argv), plan.path0
    try:
        with rank_output(plan.prefixes, plan.show_out, plan.show_err, plan.files):
            # A torchrun worker starts with nothing initialised: the script's own
            # init_process_group sets the world up, with its timeout. On a CPU that is gloo
            # (init_process_group() with no backend): the world starts with gloo's personality;
            # ("nccl") still switches.
            spawn(rank_main, nprocs=plan.nproc, seed=plan.seed, master_port=plan.master_port,
                  env=lambda r: plan.env[r], timeout=plan.timeout, isolation=plan.isolation,
                  backend="gloo", init_process_group=False)
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == plan.path0:
            sys.path[0] = saved_path0
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def _failures(plan: _Plan, e: RankFailedError) -> str:
    """torchrun's closing summary: every failed rank with its exit code, then the root cause
    (the first rank that failed)."""
    codes = e.exit_codes or {e.rank: 1}
    lines = [f"fakerun: {os.path.basename(plan.argv[0])} FAILED", "Failures:"]
    lines += [f"  rank {r}: exitcode {c}" for r, c in sorted(codes.items()) if r != e.rank] or ["  <NO_OTHER_FAILURES>"]
    lines += ["Root Cause (first observed failure):", f"  rank {e.rank}: exitcode {codes.get(e.rank, 1)}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fakerun`` with ``argv`` (default: the command line); returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse's own usage errors (exit 2) and --help (exit 0)
        return e.code if isinstance(e.code, int) else 2
    try:
        plan = _plan(args)
    except _UsageError as e:
        print(f"fakerun: error: {e}", file=sys.stderr)
        return 2
    try:
        _run(plan)
    except RankFailedError as e:
        print(f"fakerun: {e}", file=sys.stderr)
        if e.__cause__ is not None and not getattr(e.__cause__, "_fakepg_printed", False):
            prefix = plan.prefixes[e.rank] if 0 <= e.rank < plan.nproc else ""
            for chunk in traceback.format_exception(e.__cause__):
                for line in chunk.splitlines():
                    print(f"{prefix}{line}", file=sys.stderr)
        print(_failures(plan, e), file=sys.stderr)
        return 1
    except FakePGError as e:
        print(f"fakerun: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
