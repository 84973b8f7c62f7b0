"""``simddp whatif`` and ``simddp replay``'s flags: the configuration grid, the cost
mechanisms, and the parser class whose help lists the zoo, the presets and the parallel modes.
Each value is checked where it is parsed (:mod:`simddp.cli_args` has the argument types), so a
bad one is a usage error (exit status 2). Nothing here imports torch: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from . import cli_args as A

__all__ = ["grid_flags", "executor_flags", "grid_kwargs", "cost_knobs", "Parser", "whatif_epilog"]


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


def grid_flags(p: argparse.ArgumentParser, *, world_default: str | None) -> None:
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
    executor_flags(o)
    o.add_argument("--no-progress", action="store_true", help="no progress display")
    o.add_argument("--no-cache", action="store_true",
                   help="capture afresh, bypassing the capture cache ($SIMDDP_CACHE_DIR, else "
                        "~/.cache/simddp)")


def executor_flags(g: Any) -> None:
    """--workers and --dask: where the replays run (cli.py's ``_executor`` reads them)."""
    g.add_argument("--workers", type=A.integer(1, 1024), default=None,
                   help="replay on a local pool of N processes")
    g.add_argument("--dask", metavar="SCHEDULER_ADDRESS",
                   help="replay on a Dask distributed cluster, e.g. tcp://10.0.0.5:8786")


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


def grid_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration grid's keyword arguments (``whatif``, ``replay_grid``) from its flags."""
    speeds: dict[int, float] = {}
    for s in args.straggler:
        speeds.update(s)
    from .models.netspec import network_spec

    networks = [network_spec(n, gpus_per_node=args.gpus_per_node) for n in args.network]
    return dict(world_size=_world_sizes(args), network=networks,
                gpus_per_node=args.gpus_per_node, bucket_cap_mb=args.bucket_cap_mb,
                comm_hook=args.comm_hook, rank_speed=speeds, contention=args.contention,
                **cost_knobs(args))


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


def cost_knobs(args: argparse.Namespace) -> dict[str, Any]:
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


class Parser(argparse.ArgumentParser):
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


def whatif_epilog() -> str:
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
