"""docs/failures.md's errors as a user meets them (issue 46): under torchrun + gloo, one job of 2 workers runs
every case in turn (tests/support/peer_errors_job.py: an invalid or differing option on one rank, a NaN on
one rank under each exchange of the torch adapter, the construction's warning when compression cannot
save); here, in one process, the dtype errors and the torch adapter's warning. mpi_tests/test_peer_errors.py
checks the same under mpirun (torch.distributed and Horovod)."""

import numpy as np
import pytest

import slamb_comm as sc
from tests.support.launch import torchrun

torch = pytest.importorskip("torch")
from slamb_comm.adapters import torch as st  # noqa: E402


def test_peer_errors_under_torchrun():
    proc = torchrun(2, "-m", "tests.support.peer_errors_job", timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("peer errors OK") == 2, out[-4000:]


def test_dtype_errors_name_what_was_passed_and_the_fix():
    with pytest.raises(sc.DTypeError) as err:
        sc.Communicator(None, [np.zeros((3, 3), np.float16), np.zeros(4, np.float32)], names=["w", "b"])
    text = str(err.value)
    assert "you passed 2 arrays" in text and "array 1 ('b') is float32" in text, text
    assert "build one communicator per dtype" in text and "astype" in text, text
    comm = sc.Communicator(None, [np.zeros((100, 100), np.float32)], ratio=0.1)
    with pytest.raises(sc.LayoutError, match=r"has dtype float64, expected float32, the dtype it was built for: cast"):
        comm.sync([np.zeros((100, 100), np.float64)])
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = st.SLAMB([p])
    p.data, p.grad = p.data.float(), torch.zeros(3)
    with pytest.raises(sc.LayoutError, match=r"changed dtype .* it is now torch.float32 .* cast the model"):
        opt.step()


def test_torch_adapter_warns_once_when_compression_cannot_save(caplog):
    """Distributed (here on a transport of one rank), a model of small tensors only warns once at
    construction, naming the fix; a rebuild of the buckets does not warn again; a model whose large
    tensors the mask compresses does not warn; nor does a SLAMB alone (it sends nothing)."""
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    with caplog.at_level("WARNING", logger="slamb_comm"):
        opt = st.SLAMB(tiny.parameters(), lr=0.01, transport=sc.LocalTransport())
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        assert sum(len(b.params) for b in opt.buckets) == 5  # rebuilt
        st.SLAMB(tiny.parameters(), lr=0.01)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "SLAMB expects to send" in warned[0], warned
    assert "4 of 4 tensors are always sent whole" in warned[0] and "Lower dense_threshold=" in warned[0], warned
    caplog.clear()
    big = torch.nn.Sequential(torch.nn.Linear(200, 200), torch.nn.Linear(200, 200))
    with caplog.at_level("WARNING", logger="slamb_comm"):
        st.SLAMB(big.parameters(), lr=0.01, transport=sc.LocalTransport())
    assert not caplog.records, caplog.text


def test_an_invalid_option_in_one_process_raises_at_construction():
    """Only in a job of several ranks does the constructor keep an invalid option for the distributed
    optimizer's agreement; alone it raises at once, as before."""
    w = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(sc.ConfigError, match="lr must be"):
        st.SLAMB([w], lr=-1.0)
    with pytest.raises(sc.ConfigError, match="ratio must be in"):
        st.SLAMB([w], ratio=2.0)
