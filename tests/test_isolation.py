"""The NumPy path of the core imports neither torch, nor horovod, nor cupy.

Checked in a fresh interpreter, since this test process may have imported them already.
"""

import json
import subprocess
import sys

CODE = r"""
import json, sys
import numpy as np
import slamb_comm as sc

arrs = [np.ones((100, 120), np.float32), np.ones(50, np.float32)]
for mask in ("cyclic", "bernoulli", "topk"):
    comm = sc.Communicator(None, arrs, ratio=0.1, mask=mask, value_dtype="float16")
    comm.masked_allreduce(arrs, 1)
    comm.masked_allreduce(np.concatenate([a.ravel() for a in arrs]), 2)
    comm.sparse_allgather(arrs)
    comm.sync(arrs)
    comm.state_dict()
    try:
        comm.sync([arrs[0]])
    except sc.LayoutError:
        pass
print(json.dumps(sorted(m for m in ("torch", "horovod", "cupy", "jax", "tensorflow") if m in sys.modules)))
"""


def test_numpy_path_imports_no_framework():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" not in loaded
    assert "horovod" not in loaded
    assert "cupy" not in loaded
    assert loaded == []


def test_import_alone_imports_no_framework_nor_mpi():
    code = "import sys, slamb_comm; print(sorted(m for m in ('torch', 'horovod', 'cupy', 'mpi4py.MPI') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
