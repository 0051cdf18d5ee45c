# horovodrun -np 4 python examples/horovod_slamb.py
# (or: bash scripts/mpirun.sh 4 120 python3 examples/horovod_slamb.py, i.e. mpirun -np 4 python ...)
# checkpoint and resume:  ... --checkpoint /tmp/ckpt.pt   then   ... --checkpoint /tmp/ckpt.pt --resume
"""A standard Horovod PyTorch training script, trained with SLAMB (or with top-k gradients).

The only statement that differs from a stock Horovod script is the optimizer, marked below,
and the log line reads the step's bytes. Stock Horovod would read:

    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size()),
        named_parameters=model.named_parameters())

``--mode slamb`` (default) uses slamb_comm's SLAMB optimizer; ``--mode topk`` keeps a stock
``torch.optim.Adam`` and exchanges its gradients as top-k with error feedback
(``compression=slamb_comm.TopK(0.1)``).

Checkpoints follow Horovod's own idiom, unchanged: rank 0 saves ``{"model", "optimizer",
"step"}`` at the end (``--checkpoint PATH``; written to a temporary file, then renamed, so
a crash never leaves half a checkpoint); with ``--resume`` rank 0 alone loads it, and
``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state`` hand rank 0's parameters
and optimizer state to every rank, and ``hvd.broadcast_object`` the step to go on from.
(With SLAMB, every rank then continues from rank 0's moments: a valid run, not bitwise the
interrupted one, and the other ranks log a warning saying so; slamb_comm.methods.checkpoint saves
and loads every rank's own state for a bitwise resume.)

A small MLP regresses a fixed random teacher network on synthetic data (each rank draws
its own batches). Rank 0 logs the loss and the bytes each step handed to the collectives,
against what a dense allreduce of the same tensors would have moved.
"""

import argparse
import os

import torch
import torch.nn.functional as F

import horovod.torch as hvd
import slamb_comm
import slamb_comm.adapters.horovod as slamb_hvd

parser = argparse.ArgumentParser(description="SLAMB on a synthetic regression task")
parser.add_argument("--mode", choices=["slamb", "topk"], default="slamb",
                    help="slamb: the SLAMB optimizer; topk: torch.optim.Adam with top-k gradient exchange")
parser.add_argument("--steps", type=int, default=50, help="steps to train in this run")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--log-every", type=int, default=5)
parser.add_argument("--checkpoint", default=None, help="rank 0 saves model, optimizer and step here at the end")
parser.add_argument("--resume", action="store_true", help="rank 0 loads --checkpoint (if it exists) first")
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234)
torch.set_num_threads(1)

# Data: a fixed random teacher, the same on every rank; batches drawn per rank.
teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))

model = torch.nn.Sequential(
    torch.nn.Linear(32, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 8),
)

# ---- the one statement that differs from stock Horovod:
if args.mode == "slamb":
    optimizer = slamb_hvd.DistributedOptimizer(slamb_hvd.SLAMB(model.parameters(), lr=args.lr, ratio=0.1, beta3=0.9),
                                               named_parameters=model.named_parameters())
else:
    optimizer = slamb_hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                               named_parameters=model.named_parameters(),
                                               compression=slamb_comm.TopK(0.1))
# ----

# Horovod's resume idiom: rank 0 restores, then everyone takes rank 0's parameters, state and step.
start = 0
if args.resume and args.checkpoint and hvd.rank() == 0 and os.path.exists(args.checkpoint):
    checkpoint = torch.load(args.checkpoint)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    start = int(checkpoint["step"])
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
start = hvd.broadcast_object(start, root_rank=0, name="start_step")
if hvd.rank() == 0 and start:
    print(f"resumed from step {start} ({args.checkpoint})", flush=True)

gen = torch.Generator().manual_seed(hvd.rank() + 7919 * start)  # fresh batches after a resume


def get_batch():
    x = torch.randn(args.batch_size, 32, generator=gen)
    with torch.no_grad():
        y = teacher(x)
    return x, y


step = start
total = slamb_comm.Traffic()
for step in range(start + 1, start + args.steps + 1):
    x, y = get_batch()
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    t = optimizer.step_traffic()  # what this step handed to the collectives, against a dense allreduce
    total = total + t
    mean_loss = hvd.allreduce(loss.detach(), name="loss", op=hvd.Average)
    if hvd.rank() == 0 and (step % args.log_every == 0 or step == start + 1):
        print(f"step {step:4d}  loss {mean_loss.item():.5f}  sent {t.payload_bytes} B, {t.ratio:.3f} of dense",
              flush=True)

if hvd.rank() == 0:
    print(f"ranks {hvd.size()}: {args.steps} steps ({args.mode}), payload {total.payload_bytes / 1e6:.3f} MB "
          f"vs dense {total.dense_payload_bytes / 1e6:.3f} MB ({total.ratio:.1%} of dense)", flush=True)
    if args.checkpoint:
        tmp = f"{args.checkpoint}.tmp{os.getpid()}"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        os.replace(tmp, args.checkpoint)  # atomic: a reader sees the old checkpoint or the new one
        print(f"saved checkpoint at step {step} to {args.checkpoint}", flush=True)
