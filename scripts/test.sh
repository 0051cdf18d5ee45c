#!/usr/bin/env bash
# Set everything up (idempotent), then run the whole test suite:
#   1. single-process tests (tests/), under an outer timeout;
#   2. MPI tests (mpi_tests/) under mpirun with pytest-mpi at 1, 2 and 4 ranks, each
#      under an outer timeout, so one failing rank cannot hang the run.
# pytest's exit code 5 ("no tests collected") counts as a failure here.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
bash scripts/setup.sh || exit 1
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
fail=0

run() {  # run NAME CMD...: report, and treat pytest's rc 5 as a failure
  local name="$1"; shift
  echo "=== $name"
  "$@"; local rc=$?
  if [ $rc -eq 5 ]; then echo "=== $name: no tests were collected (pytest rc 5): FAILED"; fail=1
  elif [ $rc -ne 0 ]; then echo "=== $name: FAILED (rc $rc)"; fail=1
  else echo "=== $name: ok"; fi
}

run "single-process tests" timeout --kill-after=30 2700 "$PY" -m pytest -q --color=no -p no:cacheprovider --durations=15 -m "not slow" tests
for np in 1 2 4; do
  run "MPI tests at $np rank(s)" bash scripts/mpirun.sh "$np" 1500 \
    "$PY" -m pytest -q --color=no -p no:cacheprovider --with-mpi -m "not slow" mpi_tests
done
run "slow MPI tests (10,000-step run) at 2 ranks" bash scripts/mpirun.sh 2 1500 \
  "$PY" -m pytest -q --color=no -p no:cacheprovider --with-mpi -m slow mpi_tests
if [ $fail -ne 0 ]; then echo "TESTS FAILED"; exit 1; fi
echo "ALL TESTS PASSED"
