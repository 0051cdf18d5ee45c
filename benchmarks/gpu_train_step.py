# python3 benchmarks/gpu_train_step.py --out benchmarks/results/gpu_train_step.csv   (one CUDA GPU; the CPU: shrink it)
"""A whole training step of a GPT-like model on one GPU: SLAMB against AdamW(fused=True).

What a user pays per step: forward, backward and the optimizer step of a decoder-only
transformer (defaults: 12 layers, width 1024, 16 heads, vocabulary 32,000, 8 sequences of 512
tokens: 217M parameters in 149 tensors), under bf16 autocast on CUDA (float32 on the CPU), on
random tokens. Torch only: pre-norm blocks with ``F.scaled_dot_product_attention`` (causal) and
a 4x GELU MLP, learned positions, an untied output layer.

Arms, each on its own copy of the same initial model:

* ``adamw-fused``: ``torch.optim.AdamW(fused=True)`` (``fused=False`` on the CPU), the baseline;
* ``slamb``: ``slamb_comm.adapters.torch.SLAMB(ratio=0.1, value_dtype="float16", beta3=0.9)``,
  alone (one process, P = 1), its CUDA default (the device kernels, ``fused=None``);
* ``slamb-distributed``: ``DistributedOptimizer(SLAMB(...), named_parameters=...)`` on a 1-rank
  process group made in this process (NCCL on CUDA, gloo on the CPU; a ``FileStore``, no
  torchrun): its gradient hooks start each tensor's exchange during the backward pass.

Timing: after ``--warmup`` untimed steps per arm, ``--repeats`` rounds; in each round every arm
in turn takes ``--steps`` timed steps (arms interleaved round by round). A step is timed with
CUDA events from before ``zero_grad`` to after ``step()`` (``perf_counter`` on the CPU), and
the optimizer's own part from before ``step()`` to after it (for ``slamb-distributed`` part of
its work runs in the backward pass, in the hooks, and is not in that part). Per round the
median of the steps; reported: the median over the rounds and their range, and the ratio to
``adamw-fused`` in the same round (median and range). Writes ``--out`` (CSV: one row per arm,
with the device name and the date) and prints a table.
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from csvout import write_rows  # noqa: E402
from gpu_step import device_name, today  # noqa: E402

ARMS = ("adamw-fused", "slamb", "slamb-distributed")


class Block(nn.Module):
    """Pre-norm decoder block: causal multi-head attention, then a 4x GELU MLP."""

    def __init__(self, width, heads):
        super().__init__()
        if width % heads:
            raise SystemExit(f"--width {width} is not a multiple of --heads {heads}")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, width, layers, heads, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_model(args, device):
    torch.manual_seed(0)  # the same initial model for every arm
    with torch.device(device):
        return GPT(args.vocab, args.width, args.layers, args.heads, args.seq)


def make_optimizer(arm, model, device):
    from slamb_comm.adapters.torch import SLAMB, DistributedOptimizer

    if arm == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=device.type == "cuda")
    opt = SLAMB(model.parameters(), lr=1e-2, weight_decay=0.01, ratio=0.1, value_dtype="float16", beta3=0.9)
    if arm == "slamb":
        return opt
    if arm == "slamb-distributed":
        return DistributedOptimizer(opt, named_parameters=model.named_parameters())
    raise SystemExit(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")


@contextlib.contextmanager
def one_rank_group(device):
    """A process group of this process alone (NCCL on CUDA, gloo on the CPU), on a FileStore."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class Arm:
    """One arm's model, optimizer, batches, and its train step timed in two parts."""

    def __init__(self, name, args, device):
        self.name, self.device = name, device
        self.model = make_model(args, device)
        self.opt = make_optimizer(name, self.model, device)
        g = torch.Generator(device=device).manual_seed(1)
        self.batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g, device=device)
                        for _ in range(4)]
        self.amp = device.type == "cuda"
        self.i, self.loss = 0, float("nan")

    def forward_backward(self):
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            logits = self.model(b[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b[:, 1:].reshape(-1))
        loss.backward()
        return loss

    def steps(self, n):
        """``n`` steps; their (step ms, optimizer ms) lists."""
        if self.device.type != "cuda":
            marks = []
            for _ in range(n):
                t0 = time.perf_counter()
                loss = self.forward_backward()
                t1 = time.perf_counter()
                self.opt.step()
                marks.append((t0, t1, time.perf_counter()))
            self.loss = float(loss.detach())
            return [1e3 * (c - a) for a, _, c in marks], [1e3 * (c - b) for _, b, c in marks]
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
        for a, b, c in ev:
            a.record()
            loss = self.forward_backward()
            b.record()
            self.opt.step()
            c.record()
        torch.cuda.synchronize(self.device)
        self.loss = float(loss.detach())
        return [a.elapsed_time(c) for a, _, c in ev], [b.elapsed_time(c) for _, b, c in ev]


def run(args, device):
    """{arm: [(step ms, optimizer ms) median of each round]} and the arms (for their losses)."""
    arms = [Arm(name, args, device) for name in args.arms.split(",")]
    for arm in arms:
        arm.steps(args.warmup)
    rounds = {arm.name: [] for arm in arms}
    for _ in range(args.repeats):
        for arm in arms:
            step_ms, opt_ms = arm.steps(args.steps)
            rounds[arm.name].append((statistics.median(step_ms), statistics.median(opt_ms)))
    return rounds, arms


def summarize(rounds, arms, args, device):
    """One row per arm: medians and ranges over the rounds, ratios to the first arm's round."""
    base = rounds[arms[0].name]
    n_params = sum(p.numel() for p in arms[0].model.parameters())
    n_tensors = len(list(arms[0].model.parameters()))
    rows, name = [], device_name(device)
    for arm in arms:
        step_ms = [s for s, _ in rounds[arm.name]]
        opt_ms = [o for _, o in rounds[arm.name]]
        ratio = [s / b for (s, _), (b, _) in zip(rounds[arm.name], base)]
        rows.append({"arm": arm.name, "step_ms_median": statistics.median(step_ms), "step_ms_min": min(step_ms),
                     "step_ms_max": max(step_ms), "opt_ms_median": statistics.median(opt_ms),
                     "opt_ms_min": min(opt_ms), "opt_ms_max": max(opt_ms),
                     "opt_share": statistics.median(opt_ms) / statistics.median(step_ms),
                     f"vs_{arms[0].name}_median": statistics.median(ratio), f"vs_{arms[0].name}_min": min(ratio),
                     f"vs_{arms[0].name}_max": max(ratio), "loss_last": arm.loss,
                     "params": n_params, "tensors": n_tensors, "layers": args.layers, "width": args.width,
                     "heads": args.heads, "vocab": args.vocab, "batch": args.batch, "seq": args.seq,
                     "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                     "autocast": "bf16" if device.type == "cuda" else "none", "device": name,
                     "torch": torch.__version__, "date": today()})
    return rows


def print_table(rows, device):
    r0 = rows[0]
    print(f"{device_name(device)}, {today()}: {r0['params']:,} parameters in {r0['tensors']} tensors, "
          f"{r0['batch']} x {r0['seq']} tokens, autocast {r0['autocast']}; {r0['repeats']} rounds of {r0['steps']} "
          f"steps after {r0['warmup']}: medians (ranges)\n")
    print(f"| arm | step ms | optimizer ms | optimizer share | / {r0['arm']} |")
    print("|---|---|---|---|---|")
    key = f"vs_{r0['arm']}"
    for r in rows:
        print(f"| {r['arm']} | {r['step_ms_median']:.2f} ({r['step_ms_min']:.2f}-{r['step_ms_max']:.2f}) | "
              f"{r['opt_ms_median']:.2f} ({r['opt_ms_min']:.2f}-{r['opt_ms_max']:.2f}) | {r['opt_share']:.0%} | "
              f"{r[key + '_median']:.2f} ({r[key + '_min']:.2f}-{r[key + '_max']:.2f}) |", flush=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated; the first is the baseline of the ratios")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per arm per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per arm first")
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where torch sees one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        ap.error("--steps and --repeats must be >= 1, --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gpu_train_step.py --device cuda: torch sees no CUDA device (use --device cpu)")
        torch.cuda.set_device(device)
    group = one_rank_group(device) if "slamb-distributed" in args.arms.split(",") else contextlib.nullcontext()
    with group:
        rounds, arms = run(args, device)
        rows = summarize(rounds, arms, args, device)
    print_table(rows, device)
    if args.out:
        write_rows(rows, args.out)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
