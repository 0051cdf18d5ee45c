#!/usr/bin/env bash
# mpirun with the flags this kind of machine needs, and an outer timeout so that one
# failing rank can never hang the caller:  scripts/mpirun.sh NP TIMEOUT_S cmd args...
# (--allow-run-as-root only when running as root; --oversubscribe for more ranks than cores.)
set -euo pipefail
np="$1"; limit="$2"; shift 2
flags=(--oversubscribe --bind-to none -np "$np")
[ "$(id -u)" = 0 ] && flags=(--allow-run-as-root "${flags[@]}")
export OMPI_MCA_btl_vader_single_copy_mechanism=none   # containers often forbid CMA (ptrace)
export OMPI_MCA_rmaps_base_oversubscribe=1
# More ranks than cores: a rank waiting in MPI yields its core instead of busy-polling
export OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}"
exec timeout --signal=TERM --kill-after=30 "$limit" mpirun "${flags[@]}" "$@"
