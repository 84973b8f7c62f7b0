"""Every code block in README.md and docs/*.md runs, so an example cannot drift from the code.

One test per block, named ``FILE:LINE`` (the line of its opening fence). The convention
(docs/index.md repeats it for writers):

- ```python — run as a standalone script, as ``python SCRIPT`` from the repository root would,
  in a child forked from a warm interpreter that has imported torch, fakepg and simddp
  (``tests/warm_python.py``: the imports took a tenth of the suite); self-contained, quick,
  writing files only under ``out/`` or a tmp dir.
- ```console — each line starting with ``$ `` is a shell command run by bash from the
  repository root with the interpreter's bin directory first on PATH and ``COLUMNS=80``; the
  lines after it, up to the next ``$ ``, are its expected output (stdout and stderr together).
  Lines are compared stripped, blank lines are ignored, and a line ``...`` matches any run of
  lines. A command with expected output is judged by its output (so a failing command may be
  shown with its error); a command with none must exit with status 0.
- ```bash — a script run by ``bash -euo pipefail`` from the repository root, its output not
  checked (it must exit with status 0).
- ```text — output or an illustration; not run.
- A block preceded by the line ``<!-- doc-test: skip (reason) -->`` is not run; the reason is
  required.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "console", "bash", "text")
# A generous bound per block: the writers' aim is < 20 s, on a machine shared by many jobs.
BLOCK_TIMEOUT_S = 300
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
SKIP_REASON = re.compile(r"^skip\s*\((.+)\)$")
# Pages a link may name before they exist (none: every page is written).
PAGES_IN_PROGRESS: set[str] = set()


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    language: str
    code: str
    directive: str | None  # the text of a preceding <!-- doc-test: ... --> comment

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file, with the directive in front of each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, language = m.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        if end == len(lines):
            raise ValueError(f"{path.relative_to(ROOT)}:{i + 1}: code block is never closed")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1:end]]
        prev = i - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        directive = SKIP.match(lines[prev]) if prev >= 0 else None
        found.append(Block(path, i + 1, language, "\n".join(body) + "\n",
                           directive.group(1) if directive else None))
        i = end + 1
    return found


ALL_BLOCKS = [b for path in DOC_FILES for b in blocks_of(path)]


def env_for_docs() -> dict[str, str]:
    """The environment a reader who followed the README has: .venv/bin first, an 80-column log."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(COLUMNS="80", PYTHONUNBUFFERED="1", NO_COLOR="1", TERM="dumb")
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def console_steps(code: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines with the expected output lines that follow each."""
    steps: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"a console block starts with output, not a '$ ' command: {line!r}")
    return steps


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Stripped, non-blank lines equal, where an expected ``...`` matches any run of lines."""
    exp = [line.strip() for line in expected if line.strip()]
    act = [line.strip() for line in actual if line.strip()]

    def match(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(act)
        if exp[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(act) + 1))
        return j < len(act) and exp[i] == act[j] and match(i + 1, j + 1)

    return match(0, 0)


def run_shell(command: str, *, script: bool = False) -> subprocess.CompletedProcess[str]:
    args = ["bash", "-euo", "pipefail", "-c", command] if script else ["bash", "-c", command]
    return subprocess.run(args, cwd=ROOT, env=env_for_docs(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S)


def check_directive(block: Block) -> None:
    if block.directive is None:
        return
    m = SKIP_REASON.match(block.directive)
    if not m or not m.group(1).strip():
        pytest.fail(f"{block.id}: '<!-- doc-test: {block.directive} -->' is not a directive; "
                    "write '<!-- doc-test: skip (why it must not run) -->'", pytrace=False)
    pytest.skip(f"doc-test: skip ({m.group(1).strip()})")


class WarmPython:
    """``tests/warm_python.py`` as a server: a script's exit status and output, each run in a
    child forked from it (restarted if it died)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def _server(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "warm_python.py")], cwd=ROOT,
                env=env_for_docs(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self.proc

    def run(self, script: Path, output: Path) -> tuple[int, str]:
        proc = self._server()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"{script}\t{output}\n")
        proc.stdin.flush()
        pid = int(proc.stdout.readline())
        timer = threading.Timer(BLOCK_TIMEOUT_S, os.kill, (pid, signal.SIGKILL))
        timer.start()
        try:
            status = int(proc.stdout.readline())
        finally:
            timer.cancel()
        return status, output.read_text(encoding="utf-8", errors="replace")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def warm_python() -> Iterator[WarmPython]:
    warm = WarmPython()
    yield warm
    warm.close()


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_doc_code_block_runs_as_shown(block: Block, tmp_path: Path, warm_python: WarmPython
                                      ) -> None:
    check_directive(block)
    if block.language not in LANGUAGES:
        pytest.fail(f"{block.id}: a code block needs one of the languages {', '.join(LANGUAGES)} "
                    f"(got {block.language or 'none'!r}); use 'text' for output that is not run",
                    pytrace=False)
    if block.language == "text":
        return
    if block.language == "python":
        script = tmp_path / f"doc_{block.path.stem}_{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        status, output = warm_python.run(script, tmp_path / "output.txt")
        if status:
            pytest.fail(f"{block.id}: the python block exited with status {status}:\n"
                        f"{output}", pytrace=False)
        return
    if block.language == "bash":
        proc = run_shell(block.code, script=True)
        if proc.returncode:
            pytest.fail(f"{block.id}: the bash block exited with status {proc.returncode}:\n"
                        f"{proc.stdout}", pytrace=False)
        return
    steps = console_steps(block.code)
    if not steps:
        pytest.fail(f"{block.id}: a console block holds no '$ ' command", pytrace=False)
    for command, expected in steps:
        proc = run_shell(command)
        actual = proc.stdout.splitlines()
        if not [line for line in expected if line.strip()]:
            if proc.returncode:
                pytest.fail(f"{block.id}: '$ {command}' exited with status {proc.returncode}:\n"
                            f"{proc.stdout}", pytrace=False)
        elif not output_matches(expected, actual):
            pytest.fail(f"{block.id}: '$ {command}' printed something else than the page shows.\n"
                        f"--- the page shows:\n" + "\n".join(expected).strip("\n") +
                        f"\n--- it printed (exit status {proc.returncode}):\n{proc.stdout}",
                        pytrace=False)


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_doc_links_to_files_of_the_repository_resolve(path: Path) -> None:
    """A relative link names a file or folder that exists (pages being written aside)."""
    text = "\n".join(_outside_code(path))
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            if not (resolved.parent == ROOT / "docs" and resolved.name in PAGES_IN_PROGRESS):
                missing.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            missing.append(target)
    assert not missing, (f"{path.relative_to(ROOT)} links to files or headings that do not "
                         f"exist: {missing}")


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation dropped,
    spaces as hyphens)."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for line in _outside_code(path) if (m := re.match(r"^#{1,6} (.+)$", line))}


def _outside_code(path: Path) -> list[str]:
    """The lines of a Markdown file outside its fenced code blocks."""
    out, fence = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and (fence is None or line.strip() == fence):
            fence = m.group(2) if fence is None else None
            continue
        if fence is None:
            out.append(line)
    return out


def test_output_matching_takes_dots_for_any_run_of_lines() -> None:
    assert output_matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert output_matches(["a", "...", "b"], ["a", "b"])
    assert output_matches(["  a  ", "", "b"], ["a", "b   "])
    assert not output_matches(["a", "d"], ["a", "b", "d"])
    assert not output_matches(["a"], ["a", "b"])


def test_every_skipped_block_gives_its_reason() -> None:
    bad = [b.id for b in ALL_BLOCKS if b.directive is not None
           and not (SKIP_REASON.match(b.directive) and SKIP_REASON.match(b.directive).group(1).strip())]
    assert not bad, f"'<!-- doc-test: skip (reason) -->' without a reason before: {bad}"


def test_readme_is_a_front_page_of_at_most_250_lines() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_doc_headings_start_at_one_title_and_skip_no_level(path: Path) -> None:
    levels = [len(m.group(1)) for line in _outside_code(path)
              if (m := re.match(r"^(#{1,6}) \S", line))]
    assert levels[:1] == [1] and levels.count(1) == 1, f"{path.name}: one '# title' first"
    skipped = [(a, b) for a, b in zip(levels, levels[1:]) if b > a + 1]
    assert not skipped, f"{path.name}: heading levels skipped: {skipped}"
