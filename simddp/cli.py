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
from typing import Iterator, Sequence

from . import cli_args as A, cli_flags as F
from .cli_calibrate import add_parser as add_calibrate_parser, run as run_calibrate
from .cli_output import finish, progress
from .cli_plan import add_parser as add_plan_parser, run as run_plan

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = F.Parser(prog="simddp", description="What-if timing of distributed PyTorch training "
                "(DDP, FSDP2/HSDP, tensor, pipeline parallelism): torch's real program on a "
                "fake cluster, replayed at any scale.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    w = sub.add_parser("whatif", help="capture a workload once, replay it per configuration",
                       description="One row per configuration of a zoo scenario or script.",
                       epilog_fn=F.whatif_epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    F.grid_flags(w, world_default=None)
    r = sub.add_parser("replay", help="replay a saved capture per configuration",
                       description="Replay a capture (whatif --out DIR writes DIR/capture.json).")
    r.add_argument("capture", help="a capture JSON (CapturedIteration.save)")
    F.grid_flags(r, world_default=None)
    add_plan_parser(sub)
    add_calibrate_parser(sub)
    return p


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


_GIB_IN_GB = (1 << 30) / 1e9  # --gpu-memory is GiB; the knob (gpu_memory_gb) counts 10**9


def _whatif(args: argparse.Namespace) -> int:
    from .jobs.cli import apply_job
    from .whatif import whatif

    memory = None if args.gpu_memory is None else args.gpu_memory * _GIB_IN_GB
    workload = apply_job(args, whatif)  # --torchtitan/--megatron/--seq-len/...: simddp.jobs
    with _executor(args) as ex, progress(not args.no_progress) as (status, rows, one):
        res = whatif(workload, **F.grid_kwargs(args), gpu=args.gpu,
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
    return finish(res, args)


# flags that choose how the real program runs: a saved capture replays as it was captured
_CAPTURE_FLAGS = {"param_dtype": "--param-dtype", "reduce_dtype": "--reduce-dtype",
                  "activation_checkpointing": "--activation-checkpointing",
                  "compile": "--compile", "float8": "--float8", "async_tp": "--async-tp",
                  "no_cache": "--no-cache"}


def _replay(args: argparse.Namespace) -> int:
    from .analysis.sweeps import SweepResult
    from .program.captured import CapturedIteration, CapturedPipeline, load_capture
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
    with _executor(args) as ex, progress(not args.no_progress) as (status, rows, one):
        raf = args.reshard_after_forward
        parts = []
        for schedule in (args.pp_schedule or [None]) if pipeline else [None]:
            for m in (args.microbatches or [None]) if pipeline else [None]:
                more = dict(pipeline, pp_schedule=schedule, microbatches=m) if pipeline else {}
                parts.append(replay_grid(
                    cap, **F.grid_kwargs(args), iterations=args.iterations,
                    jitter=args.jitter, seed=args.seed, executor=ex, progress=rows,
                    replay_progress=one, parallel=(args.parallel or [None])[0],
                    reshard_after_forward=None if not raf else raf[0],
                    gpu_memory_gb=memory, **fsdp,
                    title=f"simddp replay {cap.name} (captured on {cap.world_size} ranks)",
                    **more))
        res = parts[0] if len(parts) == 1 else SweepResult.concat(parts, title=parts[0].title)
    return finish(res, args)


def _plan(args: argparse.Namespace) -> int:
    with _executor(args) as ex, progress(not args.no_progress) as (status, _, _):
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
