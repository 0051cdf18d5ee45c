"""Shared set-up of the MPI tests (mpi_tests/), imported by pytest before any test module.

Horovod reads HOROVOD_DYNAMIC_PROCESS_SETS at ``hvd.init()``: with it, process sets can be
added and removed at run time (``hvd.add_process_set``), which test_horovod_idioms.py needs.
It must be set before the first ``hvd.init()`` of the process, so it is set here, at import.
``setdefault``: a value given by the caller wins.

Two module-scoped fixtures that the torch test modules share: ``gloo`` (a torch.distributed
gloo group over the MPI ranks, torn down after the module) and ``horovod`` (``hvd.init()``).
"""

import datetime
import os
import socket

import pytest

os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")


@pytest.fixture(scope="module")
def gloo():
    from mpi4py import MPI

    dist = pytest.importorskip("torch.distributed")
    world = MPI.COMM_WORLD
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size, timeout=datetime.timedelta(seconds=90))
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def horovod():
    hvd = pytest.importorskip("horovod.torch")
    hvd.init()
    return hvd
