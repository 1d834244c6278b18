#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the whole test suite, then the lowest supported torch's subset
# (scripts/compat_torch.sh; BYTESCALE_SKIP_COMPAT=1 skips it).
#
# Without arguments the suite runs as two pytest processes side by side (scripts/pytest_split.sh:
# the tests that start processes, and the single-process ones); with arguments it is one plain
# pytest run of those.  The lowest torch's venv (about 3 GB of wheels to fetch and unpack, mostly
# waiting on the network and the disk) is built meanwhile, in the background.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 WANDB_MODE=offline WANDB_SILENT=true
compat_pid=
if [ "${BYTESCALE_SKIP_COMPAT:-0}" != 1 ]; then
    compat_log=$(mktemp)
    bash scripts/compat_torch.sh --install-only >"$compat_log" 2>&1 &
    compat_pid=$!
    trap 'kill "$compat_pid" 2>/dev/null || true' EXIT
fi
if [ $# -eq 0 ]; then
    bash scripts/pytest_split.sh .venv/bin/python -q -p no:cacheprovider --durations=15
else
    .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
fi
if [ -n "$compat_pid" ]; then
    if ! wait "$compat_pid"; then
        cat "$compat_log"
        echo "building the lowest torch's venv (scripts/compat_torch.sh --install-only) failed" >&2
        exit 1
    fi
    trap - EXIT
    grep -v "^WARNING: Location" "$compat_log" || true
    bash scripts/compat_torch.sh --tests-only
fi
