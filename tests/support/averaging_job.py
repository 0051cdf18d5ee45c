"""Jobs for tests/test_averaging.py: ``averaged_state_dict`` at 2 ranks, under torchrun or mpirun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.support.averaging_job torch OUT_DIR
    bash scripts/mpirun.sh 2 120 python3 -m tests.support.averaging_job horovod OUT_DIR

Each method trains a few steps with per-rank data at ``sync_interval=100``, so the replicas
differ; every rank then writes its own state dict to ``OUT_DIR/<method>.own.<rank>.pt`` and rank
0 the averaged one to ``OUT_DIR/<method>.mean.pt``: the test computes the float64 mean itself.
The job asserts what only it can see (the live model unchanged, tied entries still tied) and
writes ``OUT_DIR/<mode>.<rank>.json``.
"""

import json
import os
import sys

import torch

from slamb_comm.adapters import torch as st

torch.set_num_threads(1)
STEPS = 8


class Net(torch.nn.Module):
    """Embedding tied to the output layer, a BatchNorm (running statistics differ per rank and an
    integer counter), and a bfloat16 layer."""

    def __init__(self, extra=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 200)
        self.bn = torch.nn.BatchNorm1d(200)
        self.low = torch.nn.Linear(200, 16).to(torch.bfloat16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        if extra:  # a model that differs between the ranks (the misuse)
            self.more = torch.nn.Linear(3, 3)

    def forward(self, idx):
        h = self.bn(torch.tanh(self.lin(self.emb(idx).mean(1))))
        return self.head(self.low(h.to(torch.bfloat16)).float())


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, 50, (16, 5), generator=g), torch.randint(0, 50, (16,), generator=g))
            for _ in range(STEPS)]


def train(model, opt, rank):
    for x, y in batches(rank):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def check_and_write(name, model, mean, out, rank):
    """What the job asserts about ``mean`` (the averaged state dict of ``model``), then the files."""
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items()), f"{name}: the live model changed"
    assert mean["emb.weight"] is mean["head.weight"], f"{name}: the tied weights are no longer tied"
    assert mean["low.weight"].dtype == torch.bfloat16 and mean["bn.num_batches_tracked"].dtype == torch.int64
    torch.save(own, os.path.join(out, f"{name}.own.{rank}.pt"))
    if rank == 0:
        torch.save(mean, os.path.join(out, f"{name}.mean.pt"))


def torch_optimizers(model):
    """The methods whose replicas drift, as a torchrun script builds them (no DDP)."""
    named = list(model.named_parameters())
    sparse = {"lr": 0.01, "ratio": 0.1, "dense_threshold": 100, "sync_interval": 100}
    return {
        "slamb": lambda: st.DistributedOptimizer(st.SLAMB(model.parameters(), **sparse), named_parameters=named),
        "sadamw": lambda: st.DistributedOptimizer(st.SAdamW(model.parameters(), **sparse), named_parameters=named),
        "diloco": lambda: st.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-3), sync_interval=100),
        "desloc": lambda: st.DesLoc(torch.optim.AdamW(model.parameters(), lr=1e-3), sync_interval=100),
    }


def run_torch(out):
    import torch.distributed as dist

    st.init_process_group("gloo")
    rank, res = dist.get_rank(), {}
    for name in ("slamb", "sadamw", "diloco", "desloc"):
        model = Net()
        train(model, torch_optimizers(model)[name](), rank)
        check_and_write(name, model, st.averaged_state_dict(model), out, rank)
    try:  # a model that differs between the ranks: ValueError on every rank, no hang
        st.averaged_state_dict(Net(extra=rank == 1))
        res["misuse"] = None
    except ValueError as err:
        res["misuse"] = str(err)
    return rank, res


def run_horovod(out):
    import horovod.torch as hvd

    from slamb_comm.adapters import horovod as shvd

    hvd.init()
    rank = hvd.rank()
    model = Net()  # seeded alike on every rank (hvd.broadcast_parameters carries no bfloat16)
    opt = shvd.DistributedOptimizer(shvd.SLAMB(model.parameters(), lr=0.01, ratio=0.1, dense_threshold=100),
                                    named_parameters=model.named_parameters())
    train(model, opt, rank)
    check_and_write("horovod_slamb", model, shvd.averaged_state_dict(model), out, rank)
    try:
        shvd.averaged_state_dict(Net(extra=rank == 1))
        res = {"misuse": None}
    except ValueError as err:
        res = {"misuse": str(err)}
    return rank, res


def main():
    mode, out = sys.argv[1], sys.argv[2]
    rank, res = run_torch(out) if mode == "torch" else run_horovod(out)
    with open(os.path.join(out, f"{mode}.{rank}.json"), "w") as f:
        json.dump(res, f)
    print(f"{mode} OK {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main()
