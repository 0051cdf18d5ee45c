"""A rank that raises or dies mid-training ends the whole job quickly, naming the rank.

Launched like a user would (mpirun through scripts/mpirun.sh), with a hard outer
timeout: a regression shows up as a failed assertion on the elapsed time, not a hung CI.
"""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import os, sys, numpy as np, slamb_comm as sc
from slamb_comm.methods.slamb import SlambRule
mode = sys.argv[1]
x = [np.ones((100, 100), np.float32)]
comm = sc.Communicator(sc.MPITransport(), x, ratio=0.1)
opt = SlambRule(comm, lr=0.01)
for t in range(1, 10000):
    if t == 3 and comm.rank == 1:
        if mode == "raise":
            raise RuntimeError("failing on purpose")
        os._exit(7)
    opt.step(x, [np.ones((100, 100), np.float32)])
"""


@pytest.mark.parametrize("mode", ["raise", "die"])
def test_failing_rank_ends_the_job_and_is_named(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), "2", "120", sys.executable, str(script), mode],
        cwd=ROOT, capture_output=True, text=True, timeout=200,
    )
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out[-3000:]  # failed, and not by the outer timeout
    assert elapsed < 60, f"the other rank took {elapsed:.0f} s to end"
    if mode == "raise":
        assert "uncaught RuntimeError on rank 1" in out, out[-3000:]
    else:
        assert "[[" in out and ",1]" in out and "Exit code:    7" in out, out[-3000:]  # mpirun names rank 1


HOROVOD_SCRIPT = """
import os, sys, torch, horovod.torch as hvd
import slamb_comm.adapters.horovod as sh
hvd.init()
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = sh.DistributedOptimizer(sh.SLAMB(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
for t in range(1, 10000):
    if t == 3 and hvd.rank() == 1:
        if sys.argv[1] == "raise":
            raise RuntimeError("failing on purpose")
        os._exit(7)
    opt.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
"""


@pytest.mark.parametrize("mode", ["raise", "die"])
def test_failing_rank_under_horovodrun(tmp_path, mode):
    import shutil

    horovodrun = shutil.which("horovodrun")
    if horovodrun is None:
        pytest.skip("horovodrun is not installed")
    script = tmp_path / "train.py"
    script.write_text(HOROVOD_SCRIPT)
    mpi_args = "--oversubscribe" + (" --allow-run-as-root" if os.geteuid() == 0 else "")
    t0 = time.monotonic()
    proc = subprocess.run(["timeout", "150", horovodrun, "-np", "2", f"--mpi-args={mpi_args}", sys.executable,
                           str(script), mode], cwd=ROOT, capture_output=True, text=True, timeout=200)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
    assert "Process name: [[" in out and ",1]" in out, out[-3000:]  # mpirun names rank 1
    if mode == "raise":
        assert "failing on purpose" in out
        assert "uncaught RuntimeError on Horovod rank 1" in out, out[-3000:]


ONEBIT_ELASTIC = """
import os, torch, horovod.torch as hvd
import slamb_comm.adapters.horovod as sh
hvd.init()
os.environ["HOROVOD_ELASTIC"] = "1"  # what horovodrun --min-np/--max-np/--host-discovery-script sets
model = torch.nn.Linear(8, 4)
try:
    sh.DistributedOptimizer(sh.OneBitLAMB(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
except RuntimeError as e:
    print("refused:", e)
"""


def test_onebit_lamb_is_refused_under_elastic_horovod():
    """1-bit LAMB's server errors are one chunk per rank: a worker that leaves takes its chunk, so
    Elastic Horovod is refused at construction, naming what works (SLAMB and TopK are supported:
    tests/test_horovod_elastic.py)."""
    proc = subprocess.run([sys.executable, "-c", ONEBIT_ELASTIC], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert "refused: OneBitLAMB does not support Elastic Horovod" in out and "torchrun --max-restarts" in out, out


NCCL_SCRIPT = """
import numpy as np
from tests.support import strict_cupy
strict_cupy.install()  # the CuPy double: its NCCL runs over MPI, and blocks like NCCL would
import cupy
import slamb_comm as sc
from slamb_comm.methods.slamb import SlambRule
transport = sc.NCCLTransport()
x = [cupy.ones((100, 100), np.float32)]
comm = sc.Communicator(transport, x, ratio=0.1)
opt = SlambRule(comm, lr=0.01)
for t in range(1, 10000):
    if t == 3 and comm.rank == 1:
        raise RuntimeError("failing on purpose")
    opt.step(x, [cupy.ones((100, 100), np.float32)])
"""


def test_failing_rank_with_nccl_ends_the_job(tmp_path):
    """With NCCLTransport alone (no MPITransport in the job), an uncaught exception on one rank
    used to leave the others inside an NCCL collective forever; now it aborts NCCL, then MPI."""
    pytest.importorskip("mpi4py")
    t0 = time.monotonic()
    proc = subprocess.run(  # python -c: the working directory (the repository) on the path, for tests.support
        ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), "2", "90", sys.executable, "-c", NCCL_SCRIPT],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out[-3000:]  # failed, and not by the outer timeout
    assert elapsed < 60, f"the other rank took {elapsed:.0f} s to end"
    assert "uncaught RuntimeError on rank 1" in out, out[-3000:]
