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
from slamb_comm.slamb import Slamb
mode = sys.argv[1]
x = [np.ones((100, 100), np.float32)]
comm = sc.Communicator(sc.MPITransport(), x, ratio=0.1)
opt = Slamb(comm, lr=0.01)
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
