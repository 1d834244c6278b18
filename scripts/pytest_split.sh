#!/usr/bin/env bash
# Run a pytest selection as two pytest processes side by side, on this machine's two cores:
# the tests that start processes (marked multiprocess or slow), one at a time as in a serial run,
# and next to them the single-process tests.  Each half prints its own report, the process
# half's after the other's; the exit code is the first failing half's.
#
#   bash scripts/pytest_split.sh PYTHON [pytest arguments: paths, options; no -m]
#
# The tests that start processes keep the machine to themselves otherwise: several wait on
# timeouts measured in wall time, and two 4-rank runs at once would double their ranks' load.
set -uo pipefail
PY=$1
shift
PROCESSES="multiprocess or slow"
log=$(mktemp)
"$PY" -m pytest -m "$PROCESSES" "$@" >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
"$PY" -m pytest -m "not ($PROCESSES)" "$@"
single=$?
wait "$pid"
processes=$?
echo
echo "---- the tests that start processes (-m \"$PROCESSES\") ----"
cat "$log"
# pytest's 5 (no test selected) is not a failure of a half: a selection may have none of one kind
[ "$single" = 5 ] && single=0
[ "$processes" = 5 ] && processes=0
[ "$single" = 0 ] || exit "$single"
exit "$processes"
