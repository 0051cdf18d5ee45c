"""The MPI tests, run under mpirun with pytest-mpi (``bash scripts/mpirun.sh 2 3000 python3 -m pytest
--with-mpi mpi_tests``; docs/testing.md).

A package, as tests/ is: its modules are ``mpi_tests.test_*`` (apart from ``tests.test_*`` of the same
names) and import their helpers from ``tests.support``.
"""
