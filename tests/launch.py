"""Launching the project's scripts from tests as users launch them (shared by the smoke tests)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpirun(np_, *cmd, timeout=240):
    """Run ``python cmd...`` on ``np_`` ranks through scripts/mpirun.sh (outer timeout); return stdout."""
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), str(np_), str(timeout), sys.executable, *cmd],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc.stdout


def torchrun(nproc, *cmd, timeout=240, flags=()):
    """Run ``torchrun --standalone --nproc_per_node nproc [flags] cmd...`` under an outer timeout;
    return the CompletedProcess (the caller checks the exit code)."""
    return subprocess.run(
        ["timeout", "--kill-after=30", str(timeout), sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node", str(nproc), *flags, *cmd],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
