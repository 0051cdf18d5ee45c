"""Shared set-up of the MPI tests (mpi_tests/), imported by pytest before any test module.

Horovod reads HOROVOD_DYNAMIC_PROCESS_SETS at ``hvd.init()``: with it, process sets can be
added and removed at run time (``hvd.add_process_set``), which test_horovod_idioms.py needs.
It must be set before the first ``hvd.init()`` of the process, so it is set here, at import.
``setdefault``: a value given by the caller wins.
"""

import os

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
