# torchrun --standalone --nproc_per_node 4 examples/fsdp_slamb.py --replicas 2 --steps 20
"""A stock FSDP2/HSDP script (torchtitan's layout) trained with SLAMB across the replicas.

HSDP puts the ranks on a 2-D mesh (replicas x shards): FSDP2 reduce-scatters each gradient
inside a shard group and all-reduces every gradient piece across the replicas, densely. Here
the model is sharded over the mesh's "shard" dimension only, so FSDP2 makes no replica
allreduce, and :class:`HybridSLAMB` exchanges the momentum of each rank's pieces with their
replicas sparsely in ``step()``. Three lines differ from a stock HSDP script, marked ``HSDP:``
below, and the log line reads the step's bytes. The model is examples/common.py's small
transformer, byte-level on the standard library's source; each rank draws its own batches.
Rank 0 logs the loss (the mean over ranks) and its own bytes of the step against HSDP's dense
replica allreduce of its gradient pieces; at the end, every rank's bytes sent across the
replicas against that dense allreduce. CPU and gloo by default, CUDA and NCCL when there are
GPUs. docs/launchers.md section 6 has the recipe.
"""

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import slamb_comm
from slamb_comm.adapters.torch import HybridSLAMB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ap = argparse.ArgumentParser(description="SLAMB across the replicas of an FSDP2-sharded transformer")
ap.add_argument("--replicas", type=int, default=2, help="R: the mesh is R x (ranks / R)")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--lr", type=float, default=0.01)
ap.add_argument("--ratio", type=float, default=0.1)
ap.add_argument("--sync-interval", type=int, default=100)
ap.add_argument("--batch", type=int, default=16, help="sequences per rank")
ap.add_argument("--files", type=int, default=30, help="standard-library modules in the corpus")
ap.add_argument("--log-every", type=int, default=5)
args = ap.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets rank, size, address
rank, size = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.set_num_threads(1)

R = args.replicas
mesh = init_device_mesh(device.type, (R, size // R), mesh_dim_names=("replicate", "shard"))

torch.manual_seed(0)  # the same model everywhere (HybridSLAMB also broadcasts replica 0's pieces)
context = 64
# flat_logits: the logits as the head's own (batch * length, vocab) output, not a view of it (FSDP2 warns at views)
model = common.tiny_transformer(d_model=128, n_layers=2, context=context, flat_logits=True).to(device)
for block in model.blocks.layers:
    fully_shard(block, mesh=mesh["shard"])  # HSDP: fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh["shard"])  # HSDP: fully_shard(model, mesh=mesh)
opt = HybridSLAMB(model, mesh, lr=args.lr, ratio=args.ratio,  # HSDP: torch.optim.AdamW(model.parameters(), ...)
                  sync_interval=args.sync_interval)

train_data, _ = common.stdlib_corpus(args.files)
rng = np.random.default_rng([1, rank])  # each rank its own batches
total = slamb_comm.Traffic()
for step in range(1, args.steps + 1):
    x, y = (torch.from_numpy(a).to(device) for a in common.lm_batch(train_data, args.batch, context, rng))
    loss = F.cross_entropy(model(x), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    t = opt.step_traffic()  # this rank's bytes to its replicas, and HSDP's dense allreduce of its pieces
    total = total + t
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0 and (step == 1 or step % args.log_every == 0):
        print(f"step {step:4d}  loss {mean.item() / size:.4f}  sent {t.payload_bytes} B, {t.ratio:.3f} of dense",
              flush=True)

sent = torch.tensor([total.payload_bytes, total.dense_payload_bytes], dtype=torch.float64, device=device)
dist.all_reduce(sent)  # over every rank: the pieces differ per rank
if rank == 0:
    print(f"ranks {size} ({R} replicas x {size // R} shards): {args.steps} steps, sent {sent[0].item() / 1e6:.3f} MB "
          f"across replicas vs HSDP's dense replica allreduce {sent[1].item() / 1e6:.3f} MB: "
          f"{sent[0].item() / sent[1].item():.1%} of the bytes", flush=True)
dist.destroy_process_group()
