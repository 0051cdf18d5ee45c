"""DDP misuse is never silent (issue 22), and SlambHookState binds after DDP wraps the model:
2 ranks under torchrun (gloo, CPU) with an outer timeout (tests/support/launch.py).

The script asserts on every rank: a SLAMB or top-k distributed optimizer whose parameters
belong to a DDP module without slamb_comm's hook raises at its first step naming the fix; a
hook state that DDP never called raises at the first step; a bucket that reaches an unbound
SlambHookState raises naming bind(); a state bound after DDP wrapped the model trains bitwise
as one built with the optimizer.
"""

from tests.support.launch import torchrun

import pytest

pytest.importorskip("torch")

SCRIPT = r'''
import time, torch, torch.distributed as dist
import slamb_comm
from slamb_comm.adapters import torch as st
from slamb_comm.adapters.torch.distributed import contract
dist.init_process_group("gloo")
rank = dist.get_rank()
DDP = torch.nn.parallel.DistributedDataParallel


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def slamb(m):
    return st.DistributedOptimizer(st.SLAMB(m.parameters(), lr=0.01, ratio=0.25, dense_threshold=100, seed=3),
                                   named_parameters=m.named_parameters())


def train(net, opt, steps=3):
    for t in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()


def raises(fn, *needles):
    try:
        fn()
    except Exception as err:
        msg = f"{type(err).__name__}: {err}"
        assert all(n in msg for n in needles), msg
        return
    raise AssertionError(f"no error naming {needles}")


# bound after DDP wrapped the model: bitwise the state built with the optimizer
a, b = model(), model()
da, db = DDP(a), DDP(b)
oa = slamb(a)
da.register_comm_hook(st.SlambHookState(oa), st.slamb_hook)
state = st.SlambHookState()
db.register_comm_hook(state, st.slamb_hook)
ob = state.bind(slamb(b))
train(da, oa)
train(db, ob)
assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
assert state.calls >= 3, state.calls

# binding a bare SLAMB names DistributedOptimizer
raises(lambda: st.SlambHookState().bind(st.SLAMB(model().parameters())), "TypeError", "DistributedOptimizer")

# top-k DistributedOptimizer under DDP: at the first step, naming topk_hook
m = model()
d = DDP(m)
opt = st.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                              compression=slamb_comm.TopK(0.1))
raises(lambda: train(d, opt, 1), "RuntimeError", "topk_hook", "register_comm_hook")

# a TopKHookState that DDP never called (not registered): the plain optimizer's first step raises
m = model()
d = DDP(m)
hs = st.TopKHookState(m.named_parameters(), slamb_comm.TopK(0.1))
raises(lambda: train(d, torch.optim.SGD(m.parameters(), lr=0.1), 1), "RuntimeError", "never called",
       "register_comm_hook")

# SLAMB under DDP without slamb_hook: at the first step, naming the fix
m = model()
d = DDP(m)
opt = slamb(m)
t0 = time.perf_counter()
raises(lambda: train(d, opt, 1), "RuntimeError", "slamb_hook", "register_comm_hook", "SlambDDPStrategy")
print(f"rank {rank}: the first step's check and its error took {time.perf_counter() - t0:.3f} s", flush=True)

# a SlambHookState bound but never handed a bucket (no DDP ran the backward pass)
m = model()
opt = slamb(m)
st.SlambHookState(opt)
raises(lambda: train(m, opt, 1), "RuntimeError", "never called")

# an unbound state reached by DDP: the backward pass raises, naming bind()
m = model()
d = DDP(m)
d.register_comm_hook(st.SlambHookState(), st.slamb_hook)
raises(lambda: torch.nn.functional.mse_loss(d(torch.randn(4, 8)), torch.randn(4, 4)).backward(), "bind(")
print(f"rank {rank}: MISUSE OK", flush=True)
'''


def test_misuse_raises_and_bind_later(tmp_path):
    script = tmp_path / "misuse.py"
    script.write_text(SCRIPT)
    proc = torchrun(2, str(script), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("MISUSE OK") == 2, out[-4000:]
