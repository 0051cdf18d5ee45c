"""torchrun --nproc_per_node 2 benchmarks/ddp_step.py --out benchmarks/results/ddp_step.csv

Step time of SLAMB under DDP (``slamb_hook``) against stock DDP, under torchrun on gloo, one
thread per rank (one rank per core on this 2-core machine). The model is the language model of
``examples/train_lm.py`` widened to ``--d-model`` 512 (6.6M parameters, 26 tensors); each rank
draws its own random token batches (``--batch`` sequences of ``--context`` tokens).

Arms, each a fresh model and optimizer, run one after the other within a repeat, and the
repeats interleaved (``--repeats``; medians and ranges of the per-repeat ratios):

* ``ddp_lamb``: stock DDP (dense gradient allreduce) and LAMB (``SLAMB(ratio=1.0)`` alone,
  which is LAMB exactly): the baseline of the ratios;
* ``ddp_adamw``: stock DDP and ``torch.optim.AdamW(foreach=True)``: the users' baseline;
* ``hook_fp32`` / ``hook_fp16``: ``DistributedOptimizer(SLAMB(ratio=0.1))`` with ``slamb_hook``,
  the payload in float32 / float16;
* ``hook_flat``: ``hook_fp32`` with ``fused=True`` (flat buffers, the default on CUDA; on the
  CPU the core's whole-buffer step is slower than its blocked tensor-by-tensor one, so this
  arm shows what the GPU path costs here, not what a GPU pays).

A step is ``zero_grad``, forward, backward, ``step``; its time is the wall time of ``--steps``
steps after ``--warmup`` untimed ones, divided by ``--steps``, the slowest rank's (every arm
ends with a barrier). Writes a CSV (one row per arm and repeat) and prints a markdown table.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from common import tiny_transformer  # noqa: E402
from csvout import write_rows  # noqa: E402

ARMS = ("ddp_lamb", "ddp_adamw", "hook_fp32", "hook_fp16", "hook_flat")


def build(arm, args):
    from slamb_comm.adapters import torch as st

    torch.manual_seed(0)
    model = tiny_transformer(d_model=args.d_model, n_layers=args.layers, context=args.context)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if arm == "ddp_lamb":
        opt = st.SLAMB(ddp.parameters(), lr=1e-3, weight_decay=0.01, ratio=1.0, fused=False)
    elif arm == "ddp_adamw":
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    else:
        vdt = "float16" if arm == "hook_fp16" else "float32"
        opt = st.DistributedOptimizer(
            st.SLAMB(ddp.parameters(), lr=1e-3, weight_decay=0.01, ratio=0.1, beta3=0.9, value_dtype=vdt,
                     fused=arm == "hook_flat"),
            named_parameters=model.named_parameters())
        ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    return ddp, opt


def run_arm(arm, args, rank):
    ddp, opt = build(arm, args)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, 256, (args.batch, args.context + 1), generator=gen) for _ in range(8)]

    def step(i):
        b = batches[i % len(batches)]
        opt.zero_grad()
        logits = ddp(b[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1)).backward()
        opt.step()

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    mine = torch.tensor([(time.perf_counter() - t0) / args.steps])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    dist.barrier()
    return float(mine[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if "ddp_lamb" not in arms:
        ap.error("--arms must include ddp_lamb (the baseline of the ratios)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = []
    for rep in range(args.repeats):
        times = {arm: run_arm(arm, args, rank) for arm in arms}
        for arm in arms:
            rows.append({"repeat": rep, "arm": arm, "ranks": size, "step_ms": round(1e3 * times[arm], 2),
                         "ratio_to_ddp_lamb": round(times[arm] / times["ddp_lamb"], 4),
                         "d_model": args.d_model, "steps": args.steps, "batch": args.batch})
    if rank == 0:
        n = sum(p.numel() for p in tiny_transformer(d_model=args.d_model, n_layers=args.layers,
                                                    context=args.context).parameters())
        print(f"{size} ranks, {n:,} parameters, {args.repeats} interleaved repeats of {args.steps} steps "
              f"(after {args.warmup}); medians (ranges)\n")
        print("| arm | step | / stock DDP + LAMB |")
        print("|---|---|---|")
        for arm in arms:
            ms = [r["step_ms"] for r in rows if r["arm"] == arm]
            rs = [r["ratio_to_ddp_lamb"] for r in rows if r["arm"] == arm]
            print(f"| {arm} | {np.median(ms):.0f} ms ({min(ms):.0f}-{max(ms):.0f}) | "
                  f"{np.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}) |")
        if args.out:
            write_rows(rows, args.out)
            print(f"\nwrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
