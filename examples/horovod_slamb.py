# horovodrun -np 4 python examples/horovod_slamb.py
# (or: bash scripts/mpirun.sh 4 120 python3 examples/horovod_slamb.py, i.e. mpirun -np 4 python ...)
"""A standard Horovod PyTorch training script, trained with SLAMB.

The only line that differs from a stock Horovod script is the optimizer line, marked
below. Stock Horovod would read:

    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size()),
        named_parameters=model.named_parameters())

A small MLP regresses a fixed random teacher network on synthetic data (each rank draws
its own batches). Rank 0 logs the loss and the bytes each step handed to the collectives,
next to what a dense allreduce of the same tensors would have moved.
"""

import argparse

import torch
import torch.nn.functional as F

import horovod.torch as hvd
import slamb_comm
import slamb_comm.adapters.horovod as slamb_hvd

parser = argparse.ArgumentParser(description="SLAMB on a synthetic regression task")
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--log-every", type=int, default=5)
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234)
torch.set_num_threads(1)

# Data: a fixed random teacher, the same on every rank; batches drawn per rank.
teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
gen = torch.Generator().manual_seed(hvd.rank())


def get_batch():
    x = torch.randn(args.batch_size, 32, generator=gen)
    with torch.no_grad():
        y = teacher(x)
    return x, y


model = torch.nn.Sequential(
    torch.nn.Linear(32, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 8),
)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)

# ---- the one line that differs from stock Horovod:
optimizer = slamb_hvd.DistributedOptimizer(slamb_hvd.SLAMB(model.parameters(), lr=args.lr, ratio=0.1, beta3=0.9),
                                           named_parameters=model.named_parameters())
# ----

hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for step in range(1, args.steps + 1):
    x, y = get_batch()
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    traffic = optimizer.step_traffic()  # what this step moved, from the communicators' statistics
    mean_loss = hvd.allreduce(loss.detach(), name="loss", op=hvd.Average)
    if hvd.rank() == 0 and (step % args.log_every == 0 or step == 1):
        print(f"step {step:4d}  loss {mean_loss.item():.5f}  sent {traffic.payload_bytes / 1e3:8.1f} kB  "
              f"vs dense {traffic.dense_payload_bytes / 1e3:8.1f} kB  ({traffic.ratio:6.1%})", flush=True)

if hvd.rank() == 0:
    total = sum((c.stats.total for c in optimizer.communicators), slamb_comm.Traffic())
    print(f"ranks {hvd.size()}: {args.steps} steps, payload {total.payload_bytes / 1e6:.3f} MB "
          f"vs dense {total.dense_payload_bytes / 1e6:.3f} MB ({total.ratio:.1%} of dense)", flush=True)
