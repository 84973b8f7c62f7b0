"""A warm interpreter that runs scripts in forked children: the docs' python blocks.

A fresh interpreter spends seconds importing torch, fakepg, simddp and torch._dynamo (what
DDP's constructor imports) before a block's first line; across the docs' blocks that was a
tenth of the suite. This process imports them once and forks a child per script, which runs
it as ``python SCRIPT`` would (``__main__``, ``sys.argv``, its exit status, the interpreter's
normal shutdown: atexit handlers and non-daemon threads) with stdout and stderr in one file.

Protocol (one line each way per script, on stdin/stdout): ``SCRIPT<TAB>OUTPUT`` in; the
child's pid, then its exit status (negative: killed by that signal) out.
Nothing computes here before a fork, so the children inherit no OpenMP pool or thread.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading

import fakepg  # noqa: F401 - warmed for the children
import simddp  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.nn.parallel.distributed  # noqa: F401


def _child(script: str, output: str) -> None:
    """Become ``python SCRIPT``: never returns (the interpreter's own exit ends the child)."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    raise SystemExit(0)


def main() -> None:
    assert threading.active_count() == 1, "a thread here would not survive the fork"
    for line in sys.stdin:
        script, output = line.rstrip("\n").split("\t")
        pid = os.fork()
        if pid == 0:
            _child(script, output)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
