# python3 benchmarks/lr_table.py          (one torchrun launch, 2 ranks on gloo; about 15 minutes on 2 cores)
# python3 benchmarks/lr_table.py --quick  (a smoke run: 3 steps, one lr per method, one seed)
"""Final loss against learning rate for SLAMB, dense LAMB and AdamW: an AdamW lr does not carry over (issue 37).

LAMB's update of a layer is ``lr * ||w|| * u / ||u||`` (the trust ratio, docs/algorithm.md
section 1): its size is set by the layer's weight norm, whereas AdamW moves every element by
about ``lr``. So an lr tuned for AdamW is far too small for SLAMB and LAMB on a model with small
weights, and the factor between the two depends on the model's initialisation. This measures it
on two models, each at 2 ranks (torchrun, gloo, one thread per rank; every method really at 2
ranks, nothing emulated):

* ``gpt2``: the tiny GPT-2 of issue 37 (``transformers.GPT2LMHeadModel``: 2 layers, d = 64, 4
  heads, context 64, vocabulary 256 bytes, no dropout: 120,576 parameters, GPT-2's N(0, 0.02)
  initialisation);
* ``lm``: the language model of ``examples/train_lm.py`` (``examples/common.py``'s
  ``tiny_transformer``: 2 layers, d = 128, 470,784 parameters, PyTorch's default initialisation).

Both read the same byte-level corpus (the standard library's source, ``examples/common.py``), 16
sequences of 64 bytes per rank and step, the same batches for every method and lr of a seed.
Methods, each as a user writes it: ``adamw`` (DDP + ``torch.optim.AdamW``), ``lamb`` (DDP +
``slamb_comm.adapters.torch.LAMB``: dense LAMB) and ``slamb``
(``DistributedOptimizer(SLAMB(ratio=0.1, beta3=0.9))``, no DDP, the default ``sync_interval=100``
and float32 payload); weight decay 0.01, constant lr, no warm-up, no clipping. The loss is the
validation loss of the mean of the replicas (:func:`slamb_comm.adapters.torch.averaged_state_dict`)
on 8 fixed batches, at step 30 (issue 37's horizon) and at the last step. For SLAMB the payload
of step 1 (the first parameter sync) and of step 2 (a step without one) is recorded against a
dense allreduce.

Writes ``<out>/lr_table.csv`` (one row per run) and ``<out>/lr_table.md`` (per model, final loss
per lr and method: mean over seeds, min-max), and prints the table. Runs already in the CSV are
not run again (``--rerun`` runs them anew).
"""

import argparse
import copy
import csv
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from csvout import write_rows  # noqa: E402

LAMB_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
ADAMW_GRID = (3e-4, 1e-3, 3e-3, 1e-2)
GRIDS = {"adamw": ADAMW_GRID, "lamb": LAMB_GRID, "slamb": LAMB_GRID}
MODELS = ("gpt2", "lm")
BATCH, CONTEXT, EARLY = 16, 64, 30


# ---------------------------------------------------------------------------- one run (a torchrun worker)
def make_model(name):
    """The model ``name`` (``gpt2`` or ``lm``), mapping byte ids ``[B, T]`` to logits ``[B, T, 256]``."""
    import torch

    import common

    if name == "lm":
        return common.tiny_transformer()
    import transformers

    cfg = transformers.GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

    class TinyGPT2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = transformers.GPT2LMHeadModel(cfg)

        def forward(self, idx):
            return self.gpt2(input_ids=idx).logits

    return TinyGPT2()


def build(method, lr, model):
    """``(optimizer, ddp_or_None, traffic_fn_or_None)`` for ``method``: what a user writes."""
    import torch

    import slamb_comm.adapters.torch as st

    if method in ("adamw", "lamb"):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        cls = torch.optim.AdamW if method == "adamw" else st.LAMB
        return cls(ddp.parameters(), lr=lr, weight_decay=0.01), ddp, None
    if method == "slamb":
        opt = st.DistributedOptimizer(st.SLAMB(model.parameters(), lr=lr, weight_decay=0.01, ratio=0.1, beta3=0.9),
                                      named_parameters=model.named_parameters())
        return opt, None, opt.step_traffic
    raise SystemExit(f"unknown method {method!r}; known: {list(GRIDS)}")


def run_one(job, data, steps, eval_batches):
    """Train one ``job`` (a dict: model, method, lr, seed); returns its CSV row (on every rank)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import common
    from slamb_comm.adapters.torch import averaged_state_dict

    me = dist.get_rank()
    train_data, val_data = data
    torch.manual_seed(job["seed"])
    model = make_model(job["model"])
    for p in model.parameters():  # the same start on every rank
        dist.broadcast(p.data, 0)
    val = [(torch.from_numpy(x), torch.from_numpy(y))
           for x, y in common.lm_eval_batches(val_data, BATCH, CONTEXT, eval_batches)]
    opt, ddp, traffic = build(job["method"], job["lr"], model)
    net = ddp if ddp is not None else model

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate():  # the mean of the replicas, as a saved model is
        mean = copy.deepcopy(model)
        mean.load_state_dict(averaged_state_dict(model))
        with torch.no_grad():
            return float(np.mean([loss_fn(mean(x), y).item() for x, y in val]))

    row = dict(job, params=sum(p.numel() for p in model.parameters()), ranks=dist.get_world_size(), steps=steps)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        rng = np.random.default_rng([job["seed"], me, step])
        x, y = common.lm_batch(train_data, BATCH, CONTEXT, rng)
        opt.zero_grad()
        loss_fn(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        if traffic is not None and step <= 2:
            row[f"payload_step{step}"] = traffic().ratio
        if step == EARLY:
            row["val_loss_30"] = evaluate()
    row["val_loss"] = evaluate()
    row["seconds"] = time.perf_counter() - t0
    return row


def worker(args):
    import torch
    import torch.distributed as dist

    import common
    from slamb_comm.adapters.torch import init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo")
    with open(args.jobs) as fh:
        jobs = json.load(fh)
    data = common.stdlib_corpus(args.files)
    for job in jobs:
        row = run_one(job, data, args.steps, args.eval_batches)
        if dist.get_rank() == 0:
            done = read(args.csv)
            write_rows(done + [row], args.csv)
            print(f"[lr_table] {job['model']} {job['method']} lr {job['lr']} seed {job['seed']}: "
                  f"val {row['val_loss']:.4f} ({row['seconds']:.0f} s)", flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver
def read(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return list(csv.DictReader(fh))


def key(row):
    return (row["model"], row["method"], float(row["lr"]), int(row["seed"]), int(row["steps"]))


def fmt_lr(lr):
    return f"{lr:g}"


DIVERGED = math.log(256)  # a uniform guess over the bytes: a run that ends above it diverged


def cell(losses, best):
    if not losses:
        return ""
    if not all(math.isfinite(v) and v < DIVERGED for v in losses):
        return "diverged"
    mean = sum(losses) / len(losses)
    text = f"{mean:.3f}" + (f" ({min(losses):.3f}-{max(losses):.3f})" if len(losses) > 1 else "")
    return f"**{text}**" if best else text


def table(rows, model, column, methods):
    """Markdown: one row per lr, one column per method, ``column``'s mean over seeds (the best lr
    of each method in bold); returns ``(lines, best lr per method)``."""
    by = {}
    for r in rows:
        if r["model"] == model and r.get(column) not in (None, ""):
            by.setdefault((r["method"], float(r["lr"])), []).append(float(r[column]))
    lrs = sorted({lr for _, lr in by})
    best = {}
    for m in methods:
        scores = {lr: sum(v) / len(v) for (mm, lr), v in by.items()
                  if mm == m and all(math.isfinite(x) and x < DIVERGED for x in v)}
        if scores:
            best[m] = min(scores, key=scores.get)
    lines = ["| lr | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for lr in lrs:
        lines.append(f"| {fmt_lr(lr)} | " + " | ".join(cell(by.get((m, lr), []), best.get(m) == lr)
                                                      for m in methods) + " |")
    return lines, best


def report(rows, args, methods):
    """Write and print ``lr_table.md``: per model the final-loss and step-30 tables, the best lr
    per method, the factor from AdamW's best lr to SLAMB's, and SLAMB's payload."""
    seeds = sorted({int(r["seed"]) for r in rows})
    out = [f"`python3 benchmarks/lr_table.py{' --quick' if args.quick else ''}`: {args.steps} steps at 2 ranks "
           f"(torchrun, gloo), 16 x 64 bytes per rank and step, seeds {','.join(map(str, seeds))}; validation loss "
           "(nats per byte) of the mean of the replicas, mean over seeds (min-max); the best lr of each method in "
           f"bold; diverged: a seed ended above ln 256 = {DIVERGED:.3f} (a uniform guess) or at NaN.", ""]
    for model in MODELS:
        mrows = [r for r in rows if r["model"] == model]
        if not mrows:
            continue
        params = int(mrows[0]["params"])
        lines, best = table(rows, model, "val_loss", methods)
        out += [f"**{model}** ({params:,} parameters), final loss at step {args.steps}:", ""] + lines + [""]
        if args.steps > EARLY:
            early, _ = table(rows, model, "val_loss_30", methods)
            out += [f"{model}, loss at step {EARLY}:", ""] + early + [""]
        if "adamw" in best and "slamb" in best:
            out.append(f"{model}: best lr AdamW {fmt_lr(best['adamw'])}, LAMB {fmt_lr(best.get('lamb', math.nan))}, "
                       f"SLAMB {fmt_lr(best['slamb'])}: SLAMB's is {best['slamb'] / best['adamw']:.3g}x AdamW's.")
        pay = [r for r in mrows if r["method"] == "slamb" and r.get("payload_step2")]
        if pay:
            out.append(f"{model}: SLAMB ratio 0.1 sent {float(pay[0]['payload_step1']):.3f} of a dense allreduce at "
                       f"step 1 (the first parameter sync) and {float(pay[0]['payload_step2']):.3f} at step 2.")
        out.append("")
    text = "\n".join(out)
    with open(os.path.join(args.out, "lr_table.md"), "w") as fh:
        fh.write(text)
    print(text, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--csv", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lr_table"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join(GRIDS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lrs", default=None, help="comma-separated lrs for every method instead of the grids")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--files", type=int, default=200, help="standard-library modules in the corpus")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=3600, help="outer timeout of the torchrun launch, seconds")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 steps, one lr per method, seed 0")
    ap.add_argument("--rerun", action="store_true", help="run again what the CSV already has")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    models = [m for m in args.models.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in models if m not in MODELS] + [m for m in methods if m not in GRIDS]
    if bad:
        raise SystemExit(f"unknown model or method {bad}: models {list(MODELS)}, methods {list(GRIDS)}")
    grids = dict(GRIDS) if args.lrs is None else {m: tuple(float(x) for x in args.lrs.split(",")) for m in GRIDS}
    if args.quick:
        args.steps, args.seeds, args.files, args.eval_batches = 3, "0", 5, 1
        grids = {"adamw": (1e-3,), "lamb": (1e-2,), "slamb": (1e-2,)}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "lr_table.csv")
    jobs = [{"model": mo, "method": me, "lr": lr, "seed": int(s)} for s in args.seeds.split(",") for mo in models
            for me in methods for lr in grids[me]]
    wanted = {(j["model"], j["method"], j["lr"], j["seed"], args.steps) for j in jobs}
    rows = read(path)
    if args.rerun and rows:
        write_rows([r for r in rows if key(r) not in wanted], path)
    done = {key(r) for r in read(path)}
    todo = [j for j in jobs if (j["model"], j["method"], j["lr"], j["seed"], args.steps) not in done]
    if todo:
        with open(os.path.join(args.out, "jobs.json"), "w") as fh:
            json.dump(todo, fh)
        cmd = ["timeout", "--kill-after=30", str(args.timeout), sys.executable, "-m", "torch.distributed.run",
               "--standalone", "--nproc_per_node", "2", os.path.abspath(__file__), "--worker", "--jobs",
               os.path.join(args.out, "jobs.json"), "--csv", path, "--steps", str(args.steps), "--files",
               str(args.files), "--eval-batches", str(args.eval_batches)]
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, cwd=ROOT, env=env)
        os.remove(os.path.join(args.out, "jobs.json"))
        if proc.returncode != 0:
            raise SystemExit(f"the torchrun launch failed (rc {proc.returncode}); finished runs are in {path}")
    report([r for r in read(path) if key(r) in wanted], args, methods)


if __name__ == "__main__":
    main()
