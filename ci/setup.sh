#!/usr/bin/env bash
# Set up .venv with the project and its test tools. On this project's CPU machines the
# torch pin takes the local 2.13.0 CPU wheel (a looser range would pull the CUDA build);
# the package metadata itself keeps a normal range (torch>=2.11).
# Each step says what it does; pip shows its own progress (a cold setup takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
START=$SECONDS
step() { echo "==> [setup $((SECONDS - START)) s] $*"; }
PIP=(.venv/bin/python -m pip install --disable-pip-version-check --progress-bar on)

if [ ! -x .venv/bin/python ]; then
    step "creating .venv with $("$PY" --version 2>&1) ($PY)"
    "$PY" -m venv .venv
else
    step "reusing .venv ($(.venv/bin/python --version 2>&1)); already-installed packages are skipped"
fi
step "1/4 torch==${TORCH_VERSION:-2.13.0} (the largest download; set TORCH_VERSION to change it)"
"${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
step "2/4 the project, editable, with its test and plot extras (pytest, hypothesis, accelerate, lightning, transformers, ...)"
"${PIP[@]}" -e ".[test,plot]"
# fairscale (SlowMo tests) is a source distribution that builds with the venv's setuptools
# (Python 3.12 venvs have none by default).
step "3/4 setuptools and wheel (to build fairscale)"
"${PIP[@]}" setuptools wheel
step "4/4 fairscale==0.4.13 (SlowMo tests; built from source without its dependencies)"
"${PIP[@]}" --no-deps --no-build-isolation fairscale==0.4.13
step "done: .venv ready; run the tests with .venv/bin/python -m pytest -n 2"
