"""A GPU user's install: the extras that bring CuPy, and the error a CUDA array meets without it.

``setup.cfg`` offers ``slamb_comm[cuda12]`` (``cupy-cuda12x``) and ``slamb_comm[cuda13]``
(``cupy-cuda13x``): wheels, not the ``cupy`` source distribution that compiles for a long time.
A CUDA array handed to the core where CuPy cannot be imported raises
:class:`slamb_comm.arrays.CuPyMissingError` (an ``ImportError`` and a ``SlambCommError``) whose
message names those extras. No GPU needed: a fake array that says, through DLPack, that it
lives in CUDA memory, with ``cupy`` made unimportable.
"""

import configparser
import os
import sys

import numpy as np
import pytest

import slamb_comm as sc
from slamb_comm.arrays import CuPyMissingError, as_array, import_cupy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeCudaArray:
    """What a torch CUDA tensor shows the core: ``__dlpack__`` and a CUDA ``__dlpack_device__``."""

    dtype = "float32"
    shape = (4,)

    def __init__(self, dev_type=2):
        self.dev_type = dev_type

    def __dlpack__(self, stream=None):
        raise AssertionError("the core must not ask for the capsule when it cannot import it")

    def __dlpack_device__(self):
        return (self.dev_type, 0)


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ModuleNotFoundError


@pytest.mark.parametrize("dev_type", [2, 13], ids=["cuda", "cuda-managed"])
def test_cuda_array_without_cupy_names_the_extra(no_cupy, dev_type):
    with pytest.raises(CuPyMissingError) as info:
        as_array(FakeCudaArray(dev_type))
    e = info.value
    assert isinstance(e, ImportError) and isinstance(e, sc.SlambCommError)
    msg = str(e)
    assert 'pip install "slamb_comm[cuda12]"' in msg and '"slamb_comm[cuda13]"' in msg, msg
    assert "needs CuPy for CUDA arrays" in msg and "FakeCudaArray" in msg, msg
    assert isinstance(e.__cause__, ImportError)


def test_import_cupy_names_what_needed_it(no_cupy):
    with pytest.raises(ImportError, match=r"cuda:1 is in CUDA memory.*slamb_comm\[cuda12\]"):
        import_cupy("cuda:1")


def test_communicator_raises_it_through_its_collective_check(no_cupy):
    """A SlambCommError, so the construction's collective check reports it (on every rank: a
    rank without CuPy fails with it, the others with PeerError) instead of escaping on one rank."""
    with pytest.raises(CuPyMissingError, match=r"slamb_comm\[cuda12\]"):
        sc.Communicator(sc.LocalTransport(), [FakeCudaArray(), np.zeros(3, np.float32)], ratio=0.5)


def test_cpu_dlpack_objects_do_not_need_cupy(no_cupy):
    class HostArray:
        def __init__(self):
            self.a = np.arange(5, dtype=np.float32)

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    h = HostArray()
    out = as_array(h)
    assert isinstance(out, np.ndarray) and np.shares_memory(out, h.a)


def test_extras_are_the_cupy_wheels():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    extras = cfg["options.extras_require"]
    assert extras["cuda12"].split() == ["cupy-cuda12x>=13"]
    assert extras["cuda13"].split() == ["cupy-cuda13x>=13"]
    assert "gpu" not in extras, "[gpu] asked for the cupy sdist; [cuda12]/[cuda13] replace it"
