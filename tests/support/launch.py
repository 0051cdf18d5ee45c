"""Launching the project's scripts from tests as users launch them (shared by the smoke tests): a job of
this package as a module (``torchrun(2, "-m", "tests.support.hf_job", ...)``, from the repository's
root), a script by its path; and a script imported as a module without editing the import path."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


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


def script_module(path):
    """Import the script at ``path`` (from the repository's root: ``"examples/common.py"``) as the
    module of its file's name, as ``import`` would from its folder, without putting that folder on
    the import path (a script that imports its neighbours puts its own folder there itself)."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses and pickle look the module up there)
    spec.loader.exec_module(module)
    return module
