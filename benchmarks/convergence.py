# python benchmarks/convergence.py --out benchmarks/results/convergence
# (each run is launched as: bash scripts/mpirun.sh 4 ... python3 examples/train_lm.py ...)
"""Does SLAMB train as well as dense LAMB while moving a fraction of the bytes?

Runs the byte-level language model of ``examples/train_lm.py`` at 4 ranks with the same
model, data, seed, global batch (4 x 16 sequences of 64 bytes) and step budget for every
method, sweeps each method's learning rate over its own grid (same number of points for
each), keeps each method's best final validation loss, and writes:

* ``<out>/runs.csv``: every evaluation of every run;
* ``<out>/convergence.png``: validation loss against step and against bytes moved;
* ``<out>/convergence.md``: the table for the README, with the command that made it.

Methods: dense LAMB (Horovod allreduce), SLAMB at ratio 0.1 (fp32 and fp16 payload) and
0.01 (cyclic mask, beta3 0.9, H = 100), top-k (k = 0.01) error-feedback Adam, dense Adam.
"""

import argparse
import csv
import os
import subprocess
import sys
import time

from csvout import write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAMB_GRID = (0.005, 0.01, 0.02)
ADAM_GRID = (0.001, 0.002, 0.004)
METHODS = [
    # (label, train_lm.py arguments, lr grid)
    ("dense LAMB", ["--optimizer", "lamb"], LAMB_GRID),
    ("SLAMB k=0.1 fp32", ["--optimizer", "slamb", "--ratio", "0.1"], LAMB_GRID),
    ("SLAMB k=0.1 fp16", ["--optimizer", "slamb", "--ratio", "0.1", "--value-dtype", "float16"], LAMB_GRID),
    ("SLAMB k=0.01 fp32", ["--optimizer", "slamb", "--ratio", "0.01"], LAMB_GRID),
    ("top-k Adam k=0.01", ["--optimizer", "topk-adam", "--ratio", "0.01"], ADAM_GRID),
    ("dense Adam", ["--optimizer", "adam"], ADAM_GRID),
]


def run_one(label, extra, lr, args, out_dir):
    tag = "".join(c if c.isalnum() else "_" for c in f"{label}_{lr}")
    path = os.path.join(out_dir, "runs", f"{tag}.csv")
    if os.path.exists(path) and not args.rerun:
        print(f"[convergence] {label} lr={lr}: reusing {path}", flush=True)
    else:
        cmd = ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), str(args.ranks), str(args.timeout),
               sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), *extra, "--lr", str(lr),
               "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--beta3", str(args.beta3),
               "--seed", str(args.seed), "--no-progress", "--csv", path]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{label} lr={lr} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        print(f"[convergence] {label} lr={lr}: {time.time() - t0:.0f} s", flush=True)
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        r["label"] = label
    return rows


def plot(best, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rows in best.items():
        steps = [int(r["step"]) for r in rows]
        loss = [float(r["val_loss"]) for r in rows]
        mb = [float(r["bytes"]) / 1e6 for r in rows]
        a.plot(steps, loss, marker=".", label=f"{label} (lr {rows[0]['lr']})")
        b.plot(mb, loss, marker=".", label=label)
    a.set_xlabel("step")
    a.set_ylabel("validation loss (nats/byte)")
    b.set_xlabel("MB handed to the collectives per rank")
    b.set_xscale("log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle("byte-level LM on the Python stdlib, 4 ranks, best lr per method")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "convergence.png"), dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/convergence")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--beta3", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--methods", default="all", help="comma-separated labels, or 'all'")
    ap.add_argument("--grid-size", type=int, default=3, help="use the first N learning rates of each grid")
    ap.add_argument("--rerun", action="store_true", help="rerun runs whose CSV exists")
    args = ap.parse_args(argv)
    out_dir = os.path.join(ROOT, args.out) if not os.path.isabs(args.out) else args.out
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    methods = METHODS if args.methods == "all" else [m for m in METHODS if m[0] in args.methods.split(",")]

    all_rows, best = [], {}
    for label, extra, grid in methods:
        finals = {}
        for lr in grid[: args.grid_size]:
            rows = run_one(label, extra, lr, args, out_dir)
            all_rows += rows
            finals[lr] = rows
        lr_best = min(finals, key=lambda lr: float(finals[lr][-1]["val_loss"]))
        best[label] = finals[lr_best]

    write_rows(all_rows, os.path.join(out_dir, "runs.csv"))
    plot(best, out_dir)

    ref = best.get("dense LAMB")
    lines = [
        f"Command: `python3 benchmarks/convergence.py --out {args.out}` ({args.ranks} ranks, {args.steps} steps, "
        f"global batch {args.ranks} x 16 sequences x 64 bytes, seed {args.seed}, SLAMB beta3 {args.beta3}, H = 100, cyclic mask; "
        f"lr grids: LAMB/SLAMB {LAMB_GRID[: args.grid_size]}, Adam {ADAM_GRID[: args.grid_size]}; "
        "best final validation loss per method).",
        "",
        "| method | best lr | final val loss | vs dense LAMB | bytes vs dense allreduce |",
        "|---|---|---|---|---|",
    ]
    for label, rows in best.items():
        last = rows[-1]
        vs = f"{float(last['val_loss']) / float(ref[-1]['val_loss']) - 1:+.1%}" if ref else "-"
        lines.append(f"| {label} | {last['lr']} | {float(last['val_loss']):.4f} | {vs} | "
                     f"{float(last['bytes_vs_dense']):.1%} |")
    table = "\n".join(lines)
    with open(os.path.join(out_dir, "convergence.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
