"""docs/failures.md under torchrun + gloo, case after case in one job (tests/test_peer_errors.py launches it on
2 workers): an invalid option on the last rank only (ConfigError there, PeerError naming that rank and the
option elsewhere), a valid option that differs on the last rank (ConfigError on every rank naming it and the
option), a NaN on the last rank under each exchange of the torch adapter and under FSDP2 (every rank's log
names that rank), and the construction's warning when compression cannot save (once, on rank 0 only). Every rank prints
``rank R: peer errors OK`` at the end, or its failures and exits 1."""

import logging
import sys

import torch
import torch.distributed as dist

import slamb_comm
from slamb_comm.adapters import torch as st

dist.init_process_group("gloo")
RANK, P = dist.get_rank(), dist.get_world_size()
BAD = P - 1
failures = []


class Records(logging.Handler):
    """What logger ``slamb_comm`` logs, as text."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


LOG = Records()
logging.getLogger("slamb_comm").addHandler(LOG)


def check(cond, msg):
    if not cond:
        failures.append(f"rank {RANK}: {msg}")


def model(width=64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


def slamb(net, names, **kw):
    return st.DistributedOptimizer(st.SLAMB(net.parameters(), **{"lr": 0.01, "ratio": 0.25, "dense_threshold": 100,
                                                                 **kw}), named_parameters=names)


def one_step(net, opt, nan=False, clip=False):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(RANK))
    if nan:
        x[0, 0] = float("nan")
    opt.zero_grad()
    net(x).square().mean().backward()
    if clip:  # a recipe between backward() and step(): the exchange is made again from step()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
    opt.step()


def invalid_option_on_one_rank(option, value):
    """DDP + slamb_hook, ``option=value`` on the last rank only: ConfigError there, PeerError naming it elsewhere."""
    m = model()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    err = None
    try:
        opt = slamb(ddp, m.named_parameters(), **({option: value} if RANK == BAD else {}))
        ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    except slamb_comm.SlambCommError as e:
        err = e
    if RANK == BAD:
        check(isinstance(err, slamb_comm.ConfigError) and option in str(err), f"{option}={value}: {err!r}")
    else:
        check(isinstance(err, slamb_comm.PeerError) and err.ranks == (BAD,), f"{option}={value}: {err!r}")
        check(f"rank {BAD}: ConfigError: {option}" in str(err), f"{option}={value}: no option in the PeerError: {err}")


def invalid_topk_on_one_rank():
    """DDP + topk_hook with TopK(ratio=2.0) on the last rank only: the hook's first exchange agrees on it (its
    Communicator's construction), so backward() raises on every rank -- ConfigError's text there, PeerError's
    naming that rank elsewhere (DDP may hand a hook's error on as a RuntimeError with its text)."""
    m = model(seed=3)
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    ddp.register_comm_hook(st.TopKHookState(m.named_parameters(), slamb_comm.TopK(2.0 if RANK == BAD else 0.1)),
                           st.topk_hook)
    err = None
    try:
        ddp(torch.randn(16, 8)).square().mean().backward()
    except Exception as e:  # noqa: BLE001 -- DDP's reducer may re-raise the hook's error as a RuntimeError
        err = e
    if RANK == BAD:
        check("ratio must be in (0, 1], got 2.0" in str(err), f"TopK(2.0) here: {err!r}")
    else:
        check(f"rank(s) [{BAD}] rejected their arguments" in str(err) and "got 2.0" in str(err),
              f"TopK(2.0) on rank {BAD}: {err!r}")


def differing_lr():
    """A valid lr that differs on the last rank: ConfigError on every rank at the first step, naming it and lr."""
    m = model()
    opt = slamb(m, m.named_parameters(), lr=0.02 if RANK == BAD else 0.01)
    try:
        one_step(m, opt)
        err = None
    except slamb_comm.SlambCommError as e:
        err = e
    check(isinstance(err, slamb_comm.ConfigError) and f"rank(s) [{BAD}] differ from rank 0 in lr" in str(err),
          f"differing lr: {err!r}")


def nan_on_one_rank(what, make, ddp=False, hook=None, clip=False, mesh=None):
    """A NaN in the last rank's input at step 2: the step is skipped on every rank, and the log names that rank.
    ``mesh``: the model sharded by FSDP2 over its shard dimension."""
    m = model() if mesh is None else sharded(model(), mesh)
    net = torch.nn.parallel.DistributedDataParallel(m) if ddp else m
    opt = make(net, m)
    if hook is not None:
        hook(net, opt, m)
    before = len(LOG.lines)
    for t in (1, 2, 3):
        one_step(net, opt, nan=t == 2 and RANK == BAD, clip=clip)
    skips = [line for line in LOG.lines[before:] if "skipped" in line or "made NaN" in line]
    check(len(skips) == 1 and f"rank(s) [{BAD}]" in skips[0], f"{what}: the skip's log: {skips}")
    check(opt.skipped_steps == 1 if hasattr(opt, "skipped_steps") else True, f"{what}: {opt.skipped_steps} skipped")


def hsdp_mesh(R, S):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))


def sharded(m, mesh):
    """``m`` sharded by FSDP2 over the shard dimension of ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    for module in (m[0], m[2], m):
        fully_shard(module, mesh=mesh["shard"])
    return m


def hsdp_cases():
    """FSDP2: an invalid lr on the last rank of a 1 x P mesh (the ranks share no replica group) raises on every
    rank; a NaN on the last rank of a P x 1 mesh is logged with that rank, by HybridSLAMB and HybridTopK."""
    mesh = hsdp_mesh(1, P)
    try:
        st.HybridSLAMB(sharded(model(), mesh), mesh, lr=-1.0 if RANK == BAD else 0.01, dense_threshold=100)
        err = None
    except slamb_comm.SlambCommError as e:
        err = e
    want = slamb_comm.ConfigError if RANK == BAD else slamb_comm.PeerError
    check(isinstance(err, want) and "lr" in str(err), f"HybridSLAMB, lr=-1 on rank {BAD}: {err!r}")
    mesh = hsdp_mesh(P, 1)
    nan_on_one_rank("HybridSLAMB", lambda net, m: st.HybridSLAMB(net, mesh, lr=0.01, ratio=0.25, dense_threshold=100),
                    mesh=mesh)
    nan_on_one_rank("HybridTopK", lambda net, m: st.HybridTopK(torch.optim.SGD(net.parameters(), lr=0.01), mesh,
                                                               slamb_comm.TopK(0.25),
                                                               named_parameters=net.named_parameters()), mesh=mesh)


def warning_when_compression_cannot_save():
    """Small tensors only (all under dense_threshold): one warning, on rank 0 only; a large model: none."""
    before = len(LOG.lines)
    m = model(width=4)
    slamb(m, m.named_parameters(), dense_threshold=9000)
    big = model(width=400)
    slamb(big, big.named_parameters())
    warned = [line for line in LOG.lines[before:] if "of a dense allreduce's bytes" in line]
    check(len(warned) == (1 if RANK == 0 else 0), f"the payload warning: {warned}")
    check(not warned or "4 of 4 tensors are always sent whole" in warned[0] and "dense_threshold=" in warned[0],
          f"the payload warning: {warned}")


invalid_option_on_one_rank("lr", -1.0)
invalid_option_on_one_rank("ratio", 2.0)
invalid_topk_on_one_rank()
differing_lr()
ddp_hook = lambda net, opt, m: net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)  # noqa: E731
nan_on_one_rank("hooks", lambda net, m: slamb(net, m.named_parameters()))
nan_on_one_rank("DDP hooks", lambda net, m: slamb(net, m.named_parameters()), ddp=True, hook=ddp_hook)
nan_on_one_rank("deferred", lambda net, m: slamb(net, m.named_parameters()), clip=True)
nan_on_one_rank("flat buffers", lambda net, m: slamb(net, m.named_parameters(), fused=True))
nan_on_one_rank("topk mask", lambda net, m: slamb(net, m.named_parameters(), mask="topk"))
nan_on_one_rank("1-bit LAMB", lambda net, m: st.DistributedOptimizer(st.OneBitLAMB(net.parameters(), lr=0.01),
                                                                      named_parameters=m.named_parameters()))
nan_on_one_rank("top-k", lambda net, m: st.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                                                 named_parameters=m.named_parameters(),
                                                                 compression=slamb_comm.TopK(0.1)))
hsdp_cases()
warning_when_compression_cannot_save()

everyone = [None] * P
dist.all_gather_object(everyone, failures)
if any(everyone):
    print("\n".join(f for fs in everyone for f in fs), flush=True)
    sys.exit(1)
print(f"rank {RANK}: peer errors OK", flush=True)
