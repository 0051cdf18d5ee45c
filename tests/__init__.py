"""The single-process tests (``python3 -m pytest tests``; docs/testing.md).

A package, as mpi_tests/ is: pytest imports each test module by its dotted name (``tests.test_demo``
beside ``mpi_tests.test_demo``), with the repository's root on the path, so that modules of the
same name in both folders do not collide and both import the helpers of ``tests.support``
without editing the import path.
"""
