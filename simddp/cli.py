"""``simddp``: what-if studies of distributed training from the command line.

::

    simddp whatif mlp --world-size 64,1024 --network ib-ndr --gpus-per-node 8 \\
        --bucket-cap-mb 1,25 --straggler 3:0.5 --out results/
    simddp whatif resnet50 --batch-size 32 --gpu v100 --step-time 0.097 --network dgx1-v100 \\
        --gpus-per-node 8 --world-size 1,2,4,8,16 --bucket-cap-mb 1,25 --json rows.json
    simddp replay results/capture.json --world-size 4096 --comm-hook none,fp16
    simddp calibrate --world-size 2,4 --workload vgg16 --json cal.json

``whatif`` takes a zoo scenario name (``fakepg.zoo``) or a script defining ``scenario``, runs
torch's real program for each ``--parallel`` layout once on the fake cluster (a capture: DDP,
FSDP2/HSDP, TP, PP, as the parallelism registry :mod:`simddp.program.registry` says; reused from
the on-disk cache :mod:`simddp.capture_cache` unless ``--no-cache``), then replays one row per
configuration (world sizes × networks × bucket caps × comm hooks) — see :mod:`simddp.whatif`.
Every option applies to the layout or is refused with the reason.
Progress goes to stderr, the table to stdout (80 columns unless ``$COLUMNS`` says otherwise);
``--out DIR`` writes rows.csv, scaling.png, breakdown.png, timeline.png (the slowest
configuration's notable ranks) and capture.json; ``--json FILE`` the rows.
``--workers N`` replays on a local process pool, ``--dask ADDRESS`` on a Dask cluster.
Exit status: 0, 1 on an error (one line on stderr), 2 on a usage error (one line: a bad
value, a malformed spec, an option that does not apply). This module imports no torch at
import time: ``simddp --help`` and ``simddp whatif --help`` stay fast.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import sys
from typing import Any, Callable, Iterator, Sequence

from . import cli_args as A
from .cli_calibrate import add_parser as add_calibrate_parser, run as run_calibrate
from .cli_plan import add_parser as add_plan_parser, run as run_plan

__all__ = ["main"]

def _networks(text: str) -> list[str]:
    """--network: presets, calibrate files, spec files and specs; a spec is checked here, so
    a wrong field fails as a bad argument (exit 2) naming the field and the accepted ones."""
    from .models.netspec import network_spec, split_networks

    if not text.strip():
        raise argparse.ArgumentTypeError("an empty --network: give a preset (e.g. ib-ndr), a "
                                         "calibrate file or fields (simddp whatif --help)")
    items = split_networks(text)
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} names no network")
    for item in items:
        try:
            network_spec(item)
        except (ValueError, OSError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return items


def _straggler(text: str) -> dict[int, float]:
    out = {}
    for part in text.split(","):
        rank, sep, speed = part.partition(":")
        try:
            out[int(rank)] = float(speed)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r}: give RANK:SPEED, e.g. 3:0.5 (rank 3 at half speed)") from None
        if not sep:
            raise argparse.ArgumentTypeError(f"{part!r}: give RANK:SPEED, e.g. 3:0.5")
        if int(rank) < 0 or not 0 < out[int(rank)] < float("inf"):
            raise argparse.ArgumentTypeError(f"{part!r}: RANK is >= 0 and SPEED a number > 0 "
                                             f"(0.5: half speed)")
    return out


def _grid_flags(p: argparse.ArgumentParser, *, world_default: str | None) -> None:
    g = p.add_argument_group("configurations (comma-separated lists: one row per combination)")
    g.add_argument("--world-size", type=A.listed(A.integer(1, A.MAX_WORLD, " ranks")),
                   default=None if world_default is None else A.listed(int)(world_default),
                   help="world sizes, e.g. 64,1024 (needed unless every --parallel spec gives "
                        "all its sizes, e.g. pp:4,fsdp:16,tp:8: then the ranks it lays out)")
    g.add_argument("--network", type=_networks, default=["ib-ndr"],
                   help="networks: presets (simddp.Network.preset), e.g. ib-ndr,100gbe; a "
                        "`simddp calibrate --json` file (this machine's measured costs); "
                        "fields, alone or after a preset, e.g. 'nvlink:GBps=72,gpus-per-node=8,"
                        "nic:Gbps=100,nics-per-node=4' or 'dgx-a100,nic:Gbps=100'; or a .toml/"
                        ".json file of those fields (simddp.models.netspec)")
    g.add_argument("--gpus-per-node", type=A.integer(1, 1024), default=None,
                   help="ranks per node (NVLink inside, the network between nodes)")
    g.add_argument("--bucket-cap-mb", type=A.listed(A.cap), default=[None],
                   help="DDP bucket caps in MB ('none': as captured)")
    g.add_argument("--comm-hook", type=A.listed(A.hook), default=[None],
                   help="comm hooks: none, fp16, bf16, powersgd")
    g.add_argument("--straggler", type=_straggler, action="append", default=[],
                   help="RANK:SPEED, e.g. 3:0.5 (repeatable; left out where a world is smaller)")
    g.add_argument("--contention", type=_contention, default="keep", metavar="SPEC",
                   help="compute slowed while the rank's collectives run, and a fixed cost per "
                        "issued collective, for every network: SLOWDOWN[:US] (e.g. 1.3:8.4), "
                        "or 'off'; default: each network's own (a calibrate file's measured "
                        "one, none for presets)")
    g.add_argument("--parallel", action="append", default=None, metavar="SPEC",
                   type=A.parallel_spec,
                   help="the layout: ddp (default), fsdp, hsdp:S (shard over S ranks, replicate "
                        "across the rest), dp (Megatron-style, with tp/pp and bf16), zero1, "
                        "zero2, zero3, distributed-optimizer, with tp:T (tensor parallelism over "
                        "T ranks, innermost) and pp:P (pipeline stages, outermost), e.g. "
                        "fsdp:32,tp:8, dp:8,tp:8 or pp:4,fsdp:16,tp:8; one spec per flag, repeat "
                        "it to compare layouts (the modes are listed below)")
    g.add_argument("--reshard-after-forward", type=A.listed(A.boolean), default=None,
                   metavar="BOOLS", help="FSDP2's reshard_after_forward, e.g. true,false "
                                         "(one capture each; default true)")
    g.add_argument("--forward-prefetch", type=A.integer(0, 1024), default=None, metavar="N",
                   help="FSDP2: units all-gathered ahead in forward (default 1; 0: no overlap)")
    g.add_argument("--backward-prefetch", type=A.integer(0, 1024), default=None, metavar="N",
                   help="FSDP2: units all-gathered ahead in backward (default 1)")
    g.add_argument("--param-dtype", type=A.dtype, default=None, metavar="DTYPE",
                   help="parameters' dtype: bf16, fp16, fp32 (FSDP2's MixedPrecisionPolicy "
                        "param_dtype; DDP: the model in that dtype)")
    g.add_argument("--reduce-dtype", type=A.dtype, default=None, metavar="DTYPE",
                   help="FSDP2 MixedPrecisionPolicy reduce_dtype: bf16, fp16, fp32")
    g.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   type=A.ac_policy, metavar="POLICY",
                   help="torchtitan's policies: full (the default with no value: every block "
                        "under torch's checkpoint_wrapper), selective-op, selective-layer:N "
                        "(every N-th block), none")
    g.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   help="tensor parallelism without sequence parallelism (plain colwise/rowwise "
                        "plan)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile (modelled by the compute model, or refused)")
    g.add_argument("--float8", action="store_true",
                   help="Float8 linear layers (modelled by the compute model, or refused)")
    g.add_argument("--async-tp", action="store_true",
                   help="async tensor parallelism (with tp:T; modelled or refused)")
    g.add_argument("--pp-schedule", type=A.listed(str), default=None, metavar="NAMES",
                   help="pipeline layouts (pp:P): torch's schedules, e.g. 1f1b,interleaved1f1b "
                        "(GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                        "ZBVZeroBubble, DualPipeV; default 1F1B)")
    g.add_argument("--microbatches", type=A.listed(A.integer(1, 1 << 20)), default=None,
                   metavar="COUNTS",
                   help="pipeline layouts: microbatches per step, e.g. 8,16 (default: the "
                        "fewest the schedule takes)")
    g.add_argument("--stages-per-rank", type=A.integer(1, 1024), default=None, metavar="V",
                   help="pipeline layouts: virtual stages per rank of multi-stage schedules "
                        "(default 2)")
    g.add_argument("--gpu-memory", type=A.real(positive=True, hi=1 << 20, what=" GiB"),
                   default=None, metavar="GiB",
                   help="device memory in GiB (2**30 bytes, as cards are sold) for the OOM "
                        "verdict (default: the --gpu preset's)")
    _cost_flags(p)
    g.add_argument("--iterations", type=A.integer(1, 10_000), default=1,
                   help="iterations replayed (default 1)")
    g.add_argument("--jitter", type=A.real(0.0, 1.0), default=0.0,
                   help="relative noise per segment (0 to 1)")
    g.add_argument("--seed", type=A.integer(0, (1 << 63) - 1), default=0)
    o = p.add_argument_group("output and execution")
    o.add_argument("--out", metavar="DIR", help="write rows.csv and plots here")
    o.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    o.add_argument("--workers", type=A.integer(1, 1024), default=None,
                   help="replay on a local pool of N processes")
    o.add_argument("--dask", metavar="SCHEDULER_ADDRESS",
                   help="replay on a Dask distributed cluster, e.g. tcp://10.0.0.5:8786")
    o.add_argument("--no-progress", action="store_true", help="no progress display")
    o.add_argument("--no-cache", action="store_true",
                   help="capture afresh, bypassing the capture cache ($SIMDDP_CACHE_DIR, else "
                        "~/.cache/simddp)")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a function, called only when help is printed,
    and whose usage errors are one line (``simddp whatif: error: ...``, exit status 2)."""

    def __init__(self, *args: Any, epilog_fn: Callable[[], str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._epilog_fn = epilog_fn

    def format_help(self) -> str:
        if self._epilog_fn is not None:
            self.epilog = self._epilog_fn()
        return super().format_help()

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} "
                     f"--help)\n")


def _listing(label: str, items: Sequence[str], width: int) -> str:
    """``  label: a, b, c`` wrapped to ``width``, continuation lines indented."""
    import textwrap

    return textwrap.fill(", ".join(items), width, initial_indent=f"  {label}: ",
                         subsequent_indent="    ", break_on_hyphens=False)


def _whatif_epilog() -> str:
    """What ``whatif`` accepts: the parallelism registry (light) and static listings of the
    zoo and presets (:data:`~simddp.cli_args.HELP_LISTINGS`; their modules import torch)."""
    import shutil

    from .program.registry import REGISTRY

    width = max(40, shutil.get_terminal_size().columns - 2)  # as argparse wraps its own text
    tables = list(A.HELP_LISTINGS.items())
    return "\n".join([
        "workloads (WORKLOAD; or a .py script defining `scenario`):",
        *(_listing(label, names, width) for label, names in tables[:2]),
        "presets:",
        *(_listing(label, names, width) for label, names in tables[2:]),
        "parallel modes (--parallel; how the captured step is laid out across ranks):",
        *(_listing(name, [p.help + (f" (runs {p.runs})" if p.runs else "") +
                          (f" [{p.reserved}]" if p.reserved else "")], width)
          for name, p in REGISTRY.items()),
    ])
# the cost mechanisms' flags (docs/costs.md): flag → (Knobs field, type, help)
_COSTS: dict[str, tuple[str, Any, str]] = {
    "--no-overlap": ("overlap", None, "all_reduce after backward (a framework that does not "
                     "overlap communication with backward)"),
    "--host-per-sample-us": ("host_per_sample_us", float, "host µs to load, decode and augment "
                             "one sample (the data loader as a producer the step waits for)"),
    "--loader-workers": ("loader_workers", int, "DataLoader workers per rank (default 0: the "
                         "main process loads, on the step's critical path)"),
    "--host-cores": ("host_cores", int, "CPU cores per node (loaders and ranks share them)"),
    "--ranks-per-host": ("ranks_per_host", int, "ranks per node (default: --gpus-per-node, "
                         "else 1)"),
    "--rank-threads": ("rank_threads", float, "cores one rank's compute keeps busy (CPU "
                       "training: compute slows by ranks-per-host x this / host-cores)"),
    "--samples-per-rank": ("samples_per_rank", int, "samples a rank loads per iteration "
                           "(default: the capture's batch size)"),
    "--sync-points": ("sync_points", int, "host syncs per step (loss.item(), ...)"),
    "--sync-us": ("sync_us", float, "µs per host sync (default 10)"),
    "--metric-allreduces": ("metric_allreduces", int, "small all_reduces per step (metrics)"),
    "--protocol-latency": ("protocol_latency", None, "NCCL's tuning model (tuning.cc: latency, "
                           "algorithm and protocol per collective; default on NCCL fabrics)"),
    "--no-protocol-latency": ("protocol_latency", False, "the plain α-β network, without "
                              "NCCL's tuning model (a study)"),
    "--gpu-contention": ("gpu_contention", str, "NCCL's SM share as compute contention: "
                         "v100, a100, h100 or GPU:CHANNELS (default: the preset's GPU)"),
    "--no-gpu-contention": ("gpu_contention", False, "no SM share nor launch cost (a study)"),
}


def _cost_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost mechanisms (docs/costs.md)")
    for flag, (dest, kind, text) in _COSTS.items():
        if kind is False:  # an opt-out of a mechanism on by default
            g.add_argument(flag, dest=f"cost_off_{dest}", action="store_true", help=text)
        elif kind is None:
            g.add_argument(flag, dest=f"cost_{dest}", action="store_true", help=text)
        else:
            checked = {int: A.integer(0, 1 << 30), float: A.real(0.0)}.get(kind, kind)
            g.add_argument(flag, dest=f"cost_{dest}", type=checked, default=None, help=text,
                           metavar={int: "N", float: "X"}.get(kind, "SPEC"))


def _cost_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The cost mechanisms' Knobs fields the command line set."""
    out: dict[str, Any] = {}
    for dest, kind, _ in _COSTS.values():
        if kind is False:
            if getattr(args, f"cost_off_{dest}"):
                out[dest] = False if dest == "protocol_latency" else "off"
            continue
        v = getattr(args, f"cost_{dest}")
        if kind is None and v:
            out[dest] = dest != "overlap"  # --no-overlap sets overlap=False
        elif kind is not None and v is not None:
            out[dest] = v
    return out


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="simddp", description="What-if timing of distributed PyTorch training "
                "(DDP, FSDP2/HSDP, tensor, pipeline parallelism): torch's real program on a "
                "fake cluster, replayed at any scale.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    w = sub.add_parser("whatif", help="capture a workload once, replay it per configuration",
                       description="One row per configuration of a zoo scenario or script.",
                       epilog_fn=_whatif_epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("workload", nargs="?", default=None,
                   help="zoo scenario or benchmark workload (listed below), a .py script "
                        "defining `scenario`, a Hugging Face config.json, a torchtitan flavor "
                        "(llama3:8B) or a shape (llama:dim=4096,layers=32,heads=32,...); "
                        "docs/configurations.md")
    j = w.add_argument_group("the user's configuration (docs/configurations.md)")
    j.add_argument("--torchtitan", metavar="FILE", help="torchtitan's job TOML (its model, "
                   "batch, layout and knobs; --world-size fills a degree left at -1)")
    j.add_argument("--megatron", metavar="ARGS", help="a Megatron-LM argument line, quoted")
    j.add_argument("--seq-len", type=A.integer(1, 1 << 24, " tokens"), default=None,
                   help="tokens per sequence")
    j.add_argument("--local-batch", type=A.integer(1, 1 << 24, " sequences"), default=None,
                   help="sequences per rank per microbatch")
    j.add_argument("--global-batch", type=A.integer(1, 1 << 30, " sequences"), default=None,
                   help="sequences per optimizer step (gradient accumulation beyond what the "
                        "layout runs at once)")
    w.add_argument("--gpu", default="a100", help="PRESET[,field=value...]: the device the "
                   "compute model costs kernels on (presets listed below; default a100; fields: "
                   "memory-GiB, hbm-TBps, tdp-W, bf16-TFLOPs, fp8-TFLOPs, sms, ...)")
    w.add_argument("--step-time", type=A.real(positive=True, hi=86400.0, what=" seconds"),
                   default=None, metavar="SECONDS",
                   help="scale compute so one rank's step without DDP takes this long")
    w.add_argument("--batch-size", type=A.integer(1, 1 << 24), default=None,
                   help="the workload's batch size")
    w.add_argument("--capture-ranks", type=A.integer(1, 64), default=None,
                   help="DDP layouts: fake ranks the capture runs on (default 1)")
    w.add_argument("--save-capture", metavar="FILE", help="write the capture (JSON)")
    _grid_flags(w, world_default=None)
    r = sub.add_parser("replay", help="replay a saved capture per configuration",
                       description="Replay a capture (whatif --out DIR writes DIR/capture.json).")
    r.add_argument("capture", help="a capture JSON (CapturedIteration.save)")
    _grid_flags(r, world_default=None)
    add_plan_parser(sub)
    add_calibrate_parser(sub)
    return p


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[tuple[Callable[[str], None], Any, Any]]:
    """(status, rows, replay) callbacks drawing a rich progress display on stderr: stages,
    configurations done, and how far the running replay got (a million ranks take a while)."""
    if not enabled:
        yield (lambda text: None), None, None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=console.is_terminal) as prog:
        state: dict[str, Any] = {"task": None, "rows": None, "replay": None}

        def status(text: str) -> None:
            if state["task"] is not None:
                prog.update(state["task"], completed=1, total=1)
            state["task"] = prog.add_task(text, total=None)
            if not console.is_terminal:
                console.print(f"simddp: {text}")

        def rows(done: int, total: int, row: dict) -> None:
            if state["rows"] is None:
                if state["task"] is not None:
                    prog.update(state["task"], completed=1, total=1)
                state["rows"] = prog.add_task("replaying configurations", total=total)
            prog.update(state["rows"], completed=done)

        def replay(done: int, total: int, description: str) -> None:
            if state["replay"] is None:
                state["replay"] = prog.add_task(description, total=total)
            prog.update(state["replay"], completed=done, total=total, description=description)
            if done >= total:  # the next replay starts a fresh bar
                prog.remove_task(state["replay"])
                state["replay"] = None

        yield status, rows, replay


@contextlib.contextmanager
def _executor(args: argparse.Namespace) -> Iterator[concurrent.futures.Executor | None]:
    if args.dask:
        try:
            from distributed import Client
        except ImportError as e:
            raise RuntimeError(f"--dask needs dask.distributed ({e}): "
                               f"pip install 'fakepg-simddp[sweeps]'") from None
        client = Client(args.dask, timeout=30)
        try:
            yield client.get_executor()
        finally:
            client.close()
    elif args.workers:
        with concurrent.futures.ProcessPoolExecutor(args.workers) as ex:
            yield ex
    else:
        yield None


def _contention(text: str) -> Any:
    """--contention: "off", "SLOWDOWN" or "SLOWDOWN:US" → a Contention (None for off)."""
    from .models import Contention

    if text.strip().lower() in ("off", "none"):
        return None
    if text == "keep":  # the default: each network's own
        return text
    try:
        parts = [float(x) for x in text.split(":")]
        if len(parts) > 2:
            raise ValueError(text)
        return Contention(slowdown=parts[0], per_collective_us=parts[1] if len(parts) > 1 else 0.0,
                          source="--contention")
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected SLOWDOWN[:US] (e.g. 1.3:8.4) or 'off', got {text!r} ({e})") from None


def _world_sizes(args: argparse.Namespace) -> list[int]:
    """--world-size, else the ranks that --parallel specs with every size given lay out
    (:meth:`~simddp.program.parallel.Parallel.fixed_world_size`; a malformed spec raises its
    own reason here)."""
    from .program.parallel import Parallel

    fixed = [Parallel.fixed_world_size(spec) for spec in args.parallel or []]
    if args.world_size is not None:
        return args.world_size
    if fixed and None not in fixed:
        return sorted(set(fixed))  # type: ignore[arg-type]
    raise ValueError("--world-size is needed (e.g. --world-size 64,1024), unless every "
                     "--parallel spec gives all its sizes (e.g. pp:4,fsdp:16,tp:8)")


def _grid_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    speeds: dict[int, float] = {}
    for s in args.straggler:
        speeds.update(s)
    from .models.netspec import network_spec

    networks = [network_spec(n, gpus_per_node=args.gpus_per_node) for n in args.network]
    return dict(world_size=_world_sizes(args), network=networks,
                gpus_per_node=args.gpus_per_node, bucket_cap_mb=args.bucket_cap_mb,
                comm_hook=args.comm_hook, rank_speed=speeds, contention=args.contention,
                **_cost_knobs(args))


def _write_outputs(res: Any, args: argparse.Namespace) -> list[str]:
    written = []
    if args.json:
        res.to_json(args.json)
        written.append(args.json)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        written.append(res.to_csv(os.path.join(args.out, "rows.csv")) and
                       os.path.join(args.out, "rows.csv"))
        written.append(res.plot_scaling(os.path.join(args.out, "scaling.png")))
        written.append(res.plot_breakdown(os.path.join(args.out, "breakdown.png")))
        # the slowest configuration at the largest world: where stragglers show most
        top = max(r["world_size"] for r in res)
        i = max((k for k, r in enumerate(res) if r["world_size"] == top),
                key=lambda k: (res[k]["iteration_time_s"], -k))
        tl = res.replay(i).timeline
        written.append(tl.plot(os.path.join(args.out, "timeline.png"),
                               title=f"simddp timeline: {res.configuration(res[i])}, "
                                     f"{top} ranks (notable ranks)"
                               if tl.nranks > 16 else None))
        path = os.path.join(args.out, "capture.json")
        res.captured.save(path)
        written.append(path)
    return written


_GIB_IN_GB = (1 << 30) / 1e9  # --gpu-memory is GiB; the knob (gpu_memory_gb) counts 10**9


def _whatif(args: argparse.Namespace) -> int:
    from .jobs.cli import apply_job
    from .whatif import whatif

    memory = None if args.gpu_memory is None else args.gpu_memory * _GIB_IN_GB
    workload = apply_job(args, whatif)  # --torchtitan/--megatron/--seq-len/...: simddp.jobs
    with _executor(args) as ex, _progress(not args.no_progress) as (status, rows, one):
        res = whatif(workload, **_grid_kwargs(args), gpu=args.gpu,
                     step_time_s=args.step_time, batch_size=args.batch_size,
                     capture_ranks=args.capture_ranks, iterations=args.iterations,
                     jitter=args.jitter, seed=args.seed, parallel=args.parallel,
                     reshard_after_forward=args.reshard_after_forward,
                     forward_prefetch=args.forward_prefetch,
                     backward_prefetch=args.backward_prefetch, param_dtype=args.param_dtype,
                     reduce_dtype=args.reduce_dtype, gpu_memory_gb=memory,
                     activation_checkpointing=args.activation_checkpointing,
                     sequence_parallel=args.sequence_parallel, compile=args.compile,
                     float8=args.float8, async_tp=args.async_tp,
                     cache=False if args.no_cache else None,
                     pp_schedule=args.pp_schedule, microbatches=args.microbatches,
                     stages_per_rank=args.stages_per_rank, executor=ex, progress=rows,
                     status=status, replay_progress=one)
    if args.save_capture:
        res.captured.save(args.save_capture)
    return _finish(res, args)


# flags that choose how the real program runs: a saved capture replays as it was captured
_CAPTURE_FLAGS = {"param_dtype": "--param-dtype", "reduce_dtype": "--reduce-dtype",
                  "activation_checkpointing": "--activation-checkpointing",
                  "compile": "--compile", "float8": "--float8", "async_tp": "--async-tp",
                  "no_cache": "--no-cache"}


def _replay(args: argparse.Namespace) -> int:
    from .analysis.sweeps import SweepResult
    from .program.captured import CapturedIteration, CapturedPipeline, CapturedStep, load_capture
    from .program.parallel import UsageError
    from .whatif import replay_grid

    given = [flag for dest, flag in _CAPTURE_FLAGS.items() if getattr(args, dest)]
    if not args.sequence_parallel:
        given.append("--no-sequence-parallel")
    if given:
        raise UsageError(f"{', '.join(given)}: chosen when capturing (simddp whatif); a saved "
                         f"capture replays as it was captured")
    cap = load_capture(args.capture)
    kind = type(cap)
    pipeline = {}
    if kind is CapturedPipeline:
        pipeline = {"stages_per_rank": args.stages_per_rank}
    elif args.pp_schedule or args.microbatches or args.stages_per_rank:
        raise UsageError(f"--pp-schedule, --microbatches and --stages-per-rank replay a "
                         f"pipeline capture; {args.capture} is a {kind.__name__}")
    if kind is not CapturedIteration and (args.bucket_cap_mb != [None] or
                                          args.comm_hook != [None]):
        raise UsageError(f"--bucket-cap-mb and --comm-hook replay a DDP capture; "
                         f"{args.capture} is a {kind.__name__}")
    if kind is CapturedIteration and (args.reshard_after_forward or
                                      args.forward_prefetch is not None or
                                      args.backward_prefetch is not None):
        raise UsageError(f"--reshard-after-forward and --forward/--backward-prefetch replay an "
                         f"FSDP2 capture; {args.capture} is a DDP capture")
    if args.parallel and len(args.parallel) > 1:
        raise UsageError("replay takes one --parallel layout (the capture's kind); "
                         "`simddp whatif` compares several")
    memory = None if args.gpu_memory is None else args.gpu_memory * _GIB_IN_GB
    fsdp = {} if kind is CapturedIteration else {
        "forward_prefetch": 1 if args.forward_prefetch is None else args.forward_prefetch,
        "backward_prefetch": 1 if args.backward_prefetch is None else args.backward_prefetch}
    with _executor(args) as ex, _progress(not args.no_progress) as (status, rows, one):
        raf = args.reshard_after_forward
        parts = []
        for schedule in (args.pp_schedule or [None]) if pipeline else [None]:
            for m in (args.microbatches or [None]) if pipeline else [None]:
                more = dict(pipeline, pp_schedule=schedule, microbatches=m) if pipeline else {}
                parts.append(replay_grid(
                    cap, **_grid_kwargs(args), iterations=args.iterations,
                    jitter=args.jitter, seed=args.seed, executor=ex, progress=rows,
                    replay_progress=one, parallel=(args.parallel or [None])[0],
                    reshard_after_forward=None if not raf else raf[0],
                    gpu_memory_gb=memory, **fsdp,
                    title=f"simddp replay {cap.name} (captured on {cap.world_size} ranks)",
                    **more))
        res = parts[0] if len(parts) == 1 else SweepResult.concat(parts, title=parts[0].title)
    return _finish(res, args)


def _finish(res: Any, args: argparse.Namespace) -> int:
    print(res.table(), end="")
    for path in _write_outputs(res, args):
        print(f"wrote {path}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    with _executor(args) as ex, _progress(not args.no_progress) as (status, _, _):
        return run_plan(args, ex, status)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``simddp`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    from .program.parallel import UsageError

    try:
        return {"whatif": _whatif, "replay": _replay, "calibrate": run_calibrate,
                "plan": _plan}[args.command](args)
    except KeyboardInterrupt:
        print("simddp: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:
        print(f"simddp {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError, OSError,
            ArithmeticError, MemoryError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"simddp {args.command}: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: one line by default, the traceback when asked for
        if os.environ.get("SIMDDP_TRACEBACK"):
            raise
        print(f"simddp {args.command}: internal error: {type(e).__name__}: "
              f"{' '.join(str(e).split())} (SIMDDP_TRACEBACK=1 shows where; please report it)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
