# torchrun --nproc_per_node 2 examples/ddp_slamb.py --steps 50
# (top-k gradients under Adam instead: ... --mode topk)
"""A stock PyTorch DistributedDataParallel script, trained with SLAMB through a DDP comm hook.

Two statements differ from a stock DDP script, marked below, and the log line reads the step's
bytes. Stock DDP would read:

    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    # (no communication hook: DDP averages the gradients)

With SLAMB, DDP keeps each rank's gradients local and the hook starts each bucket's masked
momentum exchange as soon as the bucket is ready; ``optimizer.step()`` finishes it. With
``--mode topk`` a stock ``torch.optim.Adam`` steps on the mean of the ranks' top-k gradients
(error feedback keeps the rest). A small MLP regresses a fixed random teacher network on
synthetic data (each rank draws its own batches); rank 0 logs the loss and the bytes handed
to the collectives against what DDP's dense allreduce of the same gradients would move.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import slamb_comm
from slamb_comm.adapters import torch as slamb_torch

parser = argparse.ArgumentParser(description="SLAMB under DDP on a synthetic regression task")
parser.add_argument("--mode", choices=["slamb", "topk"], default="slamb")
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--log-every", type=int, default=10)
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # torchrun sets rank, size, address
rank, size = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
torch.manual_seed(1234)
torch.set_num_threads(1)

teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(device)
gen = torch.Generator(device=device).manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 8)).to(device)
ddp = torch.nn.parallel.DistributedDataParallel(model)

# ---- the two statements that differ from stock DDP:
if args.mode == "slamb":
    optimizer = slamb_torch.DistributedOptimizer(slamb_torch.SLAMB(ddp.parameters(), lr=args.lr, ratio=0.1, beta3=0.9),
                                                 named_parameters=model.named_parameters())
    ddp.register_comm_hook(slamb_torch.SlambHookState(optimizer), slamb_torch.slamb_hook)
else:
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    ddp.register_comm_hook(hook_state := slamb_torch.TopKHookState(model.named_parameters(), slamb_comm.TopK(0.05)),
                           slamb_torch.topk_hook)
# ----
stats = optimizer if args.mode == "slamb" else hook_state  # what counts the bytes
total = slamb_comm.Traffic()

for step in range(1, args.steps + 1):
    x = torch.randn(args.batch_size, 32, generator=gen, device=device)
    with torch.no_grad():
        y = teacher(x)
    optimizer.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    loss.backward()
    optimizer.step()
    t = stats.step_traffic()  # what this step handed to the collectives, against DDP's dense allreduce
    total = total + t
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    if rank == 0 and (step % args.log_every == 0 or step == 1):
        print(f"step {step:4d}  loss {mean_loss.item() / size:.5f}  sent {t.payload_bytes} B, {t.ratio:.3f} of dense",
              flush=True)

if rank == 0:
    print(f"ranks {size}: {args.steps} steps ({args.mode}), payload {total.payload_bytes / 1e6:.3f} MB vs DDP's dense "
          f"allreduce {total.dense_payload_bytes / 1e6:.3f} MB: {total.ratio:.1%} of the bytes, "
          f"{1 - total.ratio:.1%} saved", flush=True)
dist.destroy_process_group()
