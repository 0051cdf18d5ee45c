"""Scripts that end without tearing anything down (no ``destroy_process_group()``, no
``hvd.shutdown()``) exit 0 on every rank, run after run: nothing of slamb_comm's is in flight
once ``backward()`` and ``step()`` have returned (the step's collectives finish inside them),
and on gloo the process groups are torn down at exit while the interpreter is whole (see
``slamb_comm.adapters.torch.transport``). Launched as users launch them, under outer
timeouts: torchrun (a DDP script, an Accelerate loop with a BERT model built from a config)
and mpirun (Horovod). The abort this guards against needs a loaded machine to show (1 in 12
runs of the DDP script under three busy loops, before the teardown).
"""

import pytest

from tests.support.launch import mpirun, torchrun  # noqa: E402

pytest.importorskip("torch")

DDP_NO_TEARDOWN = """
import torch, torch.distributed as dist
from slamb_comm.adapters import torch as st
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = st.DistributedOptimizer(st.SLAMB(ddp.parameters(), lr=0.01, ratio=0.1, sync_interval=5),
                              named_parameters=model.named_parameters())
ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
for t in range(1, 31):
    opt.zero_grad()
    ddp(torch.randn(8, 32)).square().mean().backward()
    opt.step()
print("done", dist.get_rank(), flush=True)
"""

ACCELERATE_NO_TEARDOWN = """
import torch
from accelerate import Accelerator
from transformers import BertConfig, BertForMaskedLM
from slamb_comm.adapters import torch as st
torch.manual_seed(0)
accelerator = Accelerator(cpu=True)
config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, max_position_embeddings=64)
model = BertForMaskedLM(config)
opt = st.DistributedOptimizer(st.SLAMB(model.parameters(), lr=1e-3, ratio=0.1),
                              named_parameters=model.named_parameters())
model, prepared = accelerator.prepare(model, opt)
model.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
g = torch.Generator().manual_seed(accelerator.process_index)
for t in range(30):
    ids = torch.randint(0, 256, (8, 32), generator=g)
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    prepared.step()
    prepared.zero_grad()
print("done", accelerator.process_index, flush=True)
"""


HOROVOD_NO_SHUTDOWN = """
import torch, horovod.torch as hvd
from slamb_comm.adapters import horovod as sh
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = sh.DistributedOptimizer(sh.SLAMB(model.parameters(), lr=0.01, ratio=0.1, sync_interval=5),
                              named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for t in range(1, 31):
    opt.zero_grad()
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
print("done", hvd.rank(), flush=True)
"""


@pytest.mark.parametrize("script", ["ddp", "accelerate"])
def test_a_script_that_ends_without_teardown_exits_cleanly(tmp_path, script):
    """No ``destroy_process_group()`` at the end: every run exits 0 on every rank (nothing of
    slamb_comm's is in flight once ``backward()`` and ``step()`` have returned)."""
    if script == "accelerate":
        pytest.importorskip("accelerate")
        pytest.importorskip("transformers")
    path = tmp_path / "train.py"
    path.write_text(DDP_NO_TEARDOWN if script == "ddp" else ACCELERATE_NO_TEARDOWN)
    for run in range(3):
        proc = torchrun(2, str(path))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and out.count("done") == 2, f"run {run}: rc {proc.returncode}\n{out[-3000:]}"


def test_a_horovod_script_without_shutdown_exits_cleanly(tmp_path):
    pytest.importorskip("horovod.torch")
    path = tmp_path / "train.py"
    path.write_text(HOROVOD_NO_SHUTDOWN)
    for run in range(3):
        out = mpirun(2, str(path), timeout=120)  # asserts exit code 0
        assert out.count("done") == 2, f"run {run}:\n{out[-3000:]}"
