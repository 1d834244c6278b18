#!/usr/bin/env bash
# Create .venv with the CPU build of torch first (an unpinned torch pulls a multi-GB CUDA
# build), then the package with its dev and hf (transformers) extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0"
# builds the package's wheel without build isolation (tests/cli/test_pip_install.py does, offline)
.venv/bin/python -m pip install -q "setuptools>=70.1"
.venv/bin/python -m pip install -q -e ".[dev,hf]"
.venv/bin/python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
