#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the whole test suite, then the lowest supported torch's subset
# (scripts/compat_torch.sh; BYTESCALE_SKIP_COMPAT=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 WANDB_MODE=offline WANDB_SILENT=true
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
if [ "${BYTESCALE_SKIP_COMPAT:-0}" != 1 ]; then
    bash scripts/compat_torch.sh
fi
