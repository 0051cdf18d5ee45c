"""``averaged_state_dict``: the model to save is the float64 mean of the ranks' replicas (issue 37).

At 2 ranks under torchrun (SLAMB, SAdamW, DiLoCo and DES-LOC, whose replicas differ between
syncs) and under mpirun with Horovod (SLAMB), each launch under an outer timeout: the job
(tests/support/averaging_job.py) writes every rank's own state dict and the averaged one, and the test
computes the mean itself. A model that differs between the ranks raises on every rank. In a
single process the call is a copy.
"""

import json
import subprocess
import sys

import pytest

from tests.support.launch import mpirun, torchrun

torch = pytest.importorskip("torch")

JOB = "tests.support.averaging_job"  # a module: "-m", JOB


def assert_is_the_mean(out, name):
    """The saved mean against the float64 mean of the two ranks' own state dicts, entry by entry;
    returns how many floating entries differed between the ranks (and so were really averaged)."""
    own = [torch.load(out / f"{name}.own.{r}.pt") for r in (0, 1)]
    mean = torch.load(out / f"{name}.mean.pt")
    assert mean.keys() == own[0].keys()
    differ = 0
    for k, v in mean.items():
        a, b = own[0][k], own[1][k]
        if v.is_floating_point():
            assert v.dtype == a.dtype and torch.equal(v, ((a.double() + b.double()) / 2).to(a.dtype)), (name, k)
            differ += not torch.equal(a, b)
        else:
            assert torch.equal(v, a), (name, k)  # integer counters: this rank's (equal on both here)
    return differ


def test_torch_averaged_state_dict_for_every_method_whose_replicas_drift(tmp_path):
    proc = torchrun(2, "-m", JOB, "torch", str(tmp_path), timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for name in ("slamb", "sadamw", "diloco", "desloc"):
        # the weights, the bf16 layer and BatchNorm's running statistics differ per rank
        assert assert_is_the_mean(tmp_path, name) >= 5, name
    for rank in (0, 1):
        res = json.loads((tmp_path / f"torch.{rank}.json").read_text())
        assert "every rank must call it with the same model" in res["misuse"], res


def _have_horovod():
    return subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _have_horovod(), reason="horovod.torch is not installed")
def test_horovod_averaged_state_dict(tmp_path):
    mpirun(2, "-m", JOB, "horovod", str(tmp_path), timeout=120)
    assert assert_is_the_mean(tmp_path, "horovod_slamb") >= 5
    for rank in (0, 1):
        res = json.loads((tmp_path / f"horovod.{rank}.json").read_text())
        assert "every rank must call it with the same model" in res["misuse"], res


def test_single_process_is_a_copy_and_bad_input_is_named():
    import torch.distributed as dist

    from slamb_comm.adapters.torch import averaged_state_dict, traffic_metrics

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    got = averaged_state_dict(model)
    assert got.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v)
        if v.is_floating_point():
            assert got[k].data_ptr() != v.data_ptr(), k  # new tensors: saving them never aliases the live model
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        averaged_state_dict([1, 2])
    with pytest.raises(RuntimeError, match="init_process_group"):
        averaged_state_dict(model, group=object())
    assert traffic_metrics(None, steps=0) == {}
