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


# ----------------------------------------------------------------------------- the torch adapter's rooms
import pathlib  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

TORCH_PKG = pathlib.Path(__file__).resolve().parents[1] / "adapters" / "torch"
TORCH_MODULES = sorted(".".join(p.relative_to(TORCH_PKG).with_suffix("").parts) for p in TORCH_PKG.rglob("*.py")
                       if p.stem != "__init__")


@pytest.mark.parametrize("module", TORCH_MODULES)
def test_each_torch_adapter_module_imports_alone(module):
    """Every module of ``slamb_comm.adapters.torch`` imports first, in a fresh interpreter: an
    import circle between them would fail here for the module that closes it."""
    pytest.importorskip("torch")
    code = f"import importlib; importlib.import_module('slamb_comm.adapters.torch.{module}'); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_torch_adapter_modules_are_small_and_import_no_private_names():
    """No module of the adapters is over 700 lines, and none imports a private name
    (``_name``) from a sibling module: what is shared between rooms is named as shared."""
    too_long, private = [], []
    for path in sorted(TORCH_PKG.rglob("*.py")) + sorted(TORCH_PKG.parent.glob("*.py")):
        text = path.read_text()
        if text.count("\n") > 700:
            too_long.append(f"{path.name}: {text.count(chr(10))} lines")
        for m in re.finditer(r"^\s*from \.+([\w.]*) import ([^\n]+)", text, re.M):
            names = [n.strip(" ()").split(" as ")[0] for n in m.group(2).split(",")]
            private += [f"{path.name}: {n} from .{m.group(1)}" for n in names if n.startswith("_")]
    assert not too_long, too_long
    assert not private, private
