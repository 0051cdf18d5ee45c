"""Jobs for tests/test_fsdp.py: HybridSLAMB on a model sharded by FSDP2, under torchrun (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/fsdp_job.py match 2 2 OUT_DIR
    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/fsdp_job.py match+errors 2 2 OUT_DIR

``match R S``: an R x S mesh; each rank (replica r, piece s) trains on its own batches; FSDP2
averages the gradient over the S ranks of a replica (its reduce-scatter) and HybridSLAMB exchanges
the momentum across the R replicas. Every rank runs the dense float64 reference of SLAMB at R
ranks on the whole (unsharded) model alongside (mpi_tests/slamb_reference.py, with each replica's
gradient computed in float64 by autograd on a plain copy of the model), and compares its pieces
with the reference's at every step. ``errors``: the setups HybridSLAMB refuses. Each rank writes
``OUT_DIR/<mode>.<rank>.json``.
"""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from slamb_comm.codecs import Layout
from slamb_comm.errors import ConfigError
from slamb_comm.masks import CyclicMask
from slamb_comm.adapters import torch as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi_tests"))
from slamb_reference import ReferenceSlamb  # noqa: E402

torch.set_num_threads(1)
STEPS, RATIO, H, DENSE = 9, 0.25, 4, 90
OPTS = dict(lr=0.02, weight_decay=0.01, beta3=0.9)


def make_model():
    torch.manual_seed(0)
    # weights of 264, 165 and 99 elements are compressible (DENSE = 90); the biases are always dense;
    # at S = 2 the 33-, 5- and 3-row weights are cut unevenly (17/16, 3/2, 2/1 rows)
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).double()


def batch(t, r, s):
    g = torch.Generator().manual_seed(1000 * t + 10 * r + s)
    return torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def shard(model, mesh):
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def reference_grads(ref, plain, t, r, S):
    """Replica r's gradient at the reference's parameters: the mean over its S ranks' batches."""
    with torch.no_grad():
        for p, a in zip(plain.parameters(), ref.x[r]):
            p.copy_(torch.from_numpy(a))
    plain.zero_grad()
    for s in range(S):
        (loss_of(plain, *batch(t, r, s)) / S).backward()
    return [p.grad.numpy().copy() for p in plain.parameters()]


def match(R, S):
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    rank = dist.get_rank()
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    model = shard(make_model(), mesh["shard"])
    opt = st.HybridSLAMB(model.parameters(), mesh, ratio=RATIO, sync_interval=H, dense_threshold=DENSE, seed=3, **OPTS)
    plain = make_model()
    x0 = [p.detach().numpy().copy() for p in plain.parameters()]
    whole = Layout([a.shape for a in x0], "float64", dense_threshold=DENSE)
    ref = ReferenceSlamb([x0] * R, whole.offsets, H=H, wd=OPTS["weight_decay"], lr=OPTS["lr"], beta3=OPTS["beta3"])
    mask = CyclicMask(whole, RATIO, 3)
    worst, traffic = [], []
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(model, *batch(t, r, s)).backward()
        opt.step()
        ref.step([reference_grads(ref, plain, t, q, S) for q in range(R)], mask.select(t).index.astype(np.int64))
        err = 0.0
        for p, want in zip(model.parameters(), ref.x[r]):
            mine = p.to_local().detach().numpy()
            piece = want.reshape(-1)[_start(p, S, s): _start(p, S, s) + mine.size]
            if mine.size:
                err = max(err, float(np.max(np.abs(mine.reshape(-1) - piece)) / np.max(np.abs(want))))
        worst.append(err)
        tr = opt.step_traffic()
        traffic.append([tr.payload_bytes, tr.dense_payload_bytes])
    return {"rank": rank, "r": r, "s": s, "worst": worst, "traffic": traffic, "steps": opt.steps_taken()}


def _start(p, S, s):
    n0 = p.shape[0]
    c = -(-n0 // S)
    return min(s * c, n0) * int(np.prod(p.shape[1:]))


def errors(R, S):
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    out = {}

    def refused(key, build):
        try:
            build()
        except ConfigError as e:
            out[key] = str(e)
        else:
            out[key] = None

    refused("plain_slamb", lambda: st.SLAMB(shard(make_model(), mesh["shard"]).parameters()))
    refused("whole_mesh", lambda: st.HybridSLAMB(shard(make_model(), mesh).parameters(), mesh))
    flat = init_device_mesh("cpu", (R * S,), mesh_dim_names=("shard",))
    refused("pure_fsdp", lambda: st.HybridSLAMB(shard(make_model(), flat).parameters(), flat))
    refused("unsharded", lambda: st.HybridSLAMB(make_model().parameters(), mesh))
    return out


def main():
    mode, R, S, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    for m in mode.split("+"):  # "match+errors": both in one launch
        result = match(R, S) if m == "match" else errors(R, S)
        with open(os.path.join(out_dir, f"{m}.{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
