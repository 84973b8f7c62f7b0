#!/usr/bin/env bash
# Set up .venv with the project and its test tools. On this project's CPU machines the
# torch pin takes the local 2.13.0 CPU wheel (a looser range would pull the CUDA build);
# the package metadata itself keeps a normal range (torch>=2.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,plot]"
# fairscale (SlowMo tests) is a source distribution that builds with the venv's setuptools
# (Python 3.12 venvs have none by default).
.venv/bin/python -m pip install -q --disable-pip-version-check setuptools wheel
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation fairscale==0.4.13
