#!/usr/bin/env bash
# The lowest supported torch, in a second virtual environment: the tests that matter on a GPU.
#
# pyproject.toml says torch>=2.11; this is where 2.11 is tested.  torch==2.11.0 from PyPI is
# the GPU machines' build (2.11.0+cu130, with its nvidia-* wheels, about 3 GB); it imports and
# runs on a CPU machine, so the CPU paths run on it for real and the CUDA paths on fake CUDA
# (tests/fake_cuda) and the collectives on fake NCCL (tests/fake_nccl).  The subset and its cost are in CONTRIBUTING.md ("The lowest torch").
#
#   bash scripts/compat_torch.sh                  # builds .venv-torch-compat once, then runs the subset
#   bash scripts/compat_torch.sh --install-only   # only the venv (scripts/test.sh builds it while the suite runs)
#   bash scripts/compat_torch.sh --tests-only -x  # only the subset, in the venv built before
#   COMPAT_TORCH=2.12.0 bash scripts/compat_torch.sh -x
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${COMPAT_TORCH:-2.11.0}
VENV=${COMPAT_VENV:-.venv-torch-compat}
STAGE=all
case "${1:-}" in
    --install-only) STAGE=install; shift ;;
    --tests-only) STAGE=tests; shift ;;
esac
if [ "$STAGE" != tests ]; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "torch==$TORCH"
    "$VENV/bin/python" -m pip install -q "setuptools>=70.1,<82"  # torch 2.11 asks for <82
    "$VENV/bin/python" -m pip install -q -e ".[dev,hf]"
fi
"$VENV/bin/python" -c "import sys, torch; v = torch.__version__; print('compat: torch', v); sys.exit(0 if v.split('+')[0] == '$TORCH' else 1)"
[ "$STAGE" != install ] || exit 0
export OMP_NUM_THREADS=1 WANDB_MODE=offline WANDB_SILENT=true
# The floors whose code calls torch APIs that change between releases (attention kernels and
# their feature detection, fake CUDA, DTensor/FSDP2, the collectives, one Trainer file); the rest
# of the suite runs once, on the pinned torch (CONTRIBUTING.md, "The lowest torch").  Two pytest
# processes side by side, as in scripts/test.sh.
exec bash scripts/pytest_split.sh "$VENV/bin/python" -q -p no:cacheprovider --durations=10 \
    tests/fake_cuda tests/fake_nccl tests/packed_attention tests/models tests/offload tests/parallel \
    --ignore=tests/packed_attention/test_attention_gpu_check.py \
    tests/engine/test_engine_distributed.py tests/engine/test_grad_sync.py \
    tests/hf/test_hf_attention.py tests/hf/test_hf_equivalence.py tests/hf/test_hf_tensor_parallel.py \
    tests/hf/test_hf_pipeline_step.py \
    tests/lightning/test_pipeline_precision.py \
    "tests/lightning/test_pipeline_strategy.py::test_2x2_validates_exactly_and_its_checkpoint_exports_as_one_model" \
    tests/lightning/test_strategy.py \
    "$@"
