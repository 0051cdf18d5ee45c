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

Methods: dense LAMB (Horovod allreduce), 1-bit LAMB (DeepSpeed's rule: ``--freeze-step``
dense LAMB steps, default 15% of the run, then the 1-bit momentum exchange), SLAMB at ratio
0.1 (fp32 and fp16 payload) and 0.01 (cyclic mask, beta3 0.9, H = 100), top-k (k = 0.01)
error-feedback Adam, dense Adam.

Seeds and batch: ``--seeds 0,1,2`` runs every (method, lr) at each seed (model init, data
order, SLAMB mask); each method's best lr is the one with the lowest *mean* final validation
loss over the seeds (``--tune-seed 0``: the grid is swept at seed 0 only and the other seeds
run at each method's best lr there, a third of the runs), and the table gives that mean, the spread over seeds and the total bytes
handed to the collectives. ``--batch-size`` is sequences per rank (global batch = ranks x
batch size). The issue's comparison (4 ranks, three seeds, then a global batch of 256 at
seed 0):

    python3 benchmarks/convergence.py --methods "dense LAMB,1-bit LAMB,SLAMB k=0.1 fp32,SLAMB k=0.1 fp16" \
        --seeds 0,1,2 --tune-seed 0 --out benchmarks/results/convergence_onebit
    python3 benchmarks/convergence.py --methods "dense LAMB,1-bit LAMB,SLAMB k=0.1 fp32,SLAMB k=0.1 fp16" \
        --seeds 0 --batch-size 64 --steps 150 --eval-every 25 --grid-size 4 \
        --out benchmarks/results/convergence_onebit_b256

(150 steps at 4 x 64 sequences see the same number of sequences as 600 steps at 4 x 16.)
"""

import argparse
import csv
import math
import os
import subprocess
import sys
import time

from csvout import write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import common  # noqa: E402  (examples/common.py: the default 1-bit LAMB freeze_step)

# --grid-size N takes the first N points (default 3); the fourth extends the LAMB grid for runs
# whose best lr is at its top (the global batch of 256: --grid-size 4)
LAMB_GRID = (0.005, 0.01, 0.02, 0.04)
ADAM_GRID = (0.001, 0.002, 0.004, 0.008)
METHODS = [
    # (label, train_lm.py arguments, lr grid)
    ("dense LAMB", ["--optimizer", "lamb"], LAMB_GRID),
    # eps 1e-6 as the LAMB arms (SLAMB's default) rather than DeepSpeed's 1e-8: with 1e-8 1-bit
    # LAMB diverges on models with near-zero second moments (docs/onebit_lamb.md section 4)
    ("1-bit LAMB", ["--optimizer", "onebit_lamb", "--eps", "1e-6"], LAMB_GRID),
    ("SLAMB k=0.1 fp32", ["--optimizer", "slamb", "--ratio", "0.1"], LAMB_GRID),
    ("SLAMB k=0.1 fp16", ["--optimizer", "slamb", "--ratio", "0.1", "--value-dtype", "float16"], LAMB_GRID),
    ("SLAMB k=0.01 fp32", ["--optimizer", "slamb", "--ratio", "0.01"], LAMB_GRID),
    ("top-k Adam k=0.01", ["--optimizer", "topk-adam", "--ratio", "0.01"], ADAM_GRID),
    ("dense Adam", ["--optimizer", "adam"], ADAM_GRID),
]
METHOD_ARGS = {label: extra for label, extra, _ in METHODS}


DEFAULT_BATCH = 16  # sequences per rank: examples/train_lm.py's default
DEFAULT_STEPS = 600


def run_tag(label, lr, seed, args):
    """The run's CSV name. Seed 0, the default batch and steps give the historical name
    (``<label>_<lr>``), so runs already in an output folder are reused."""
    tag = f"{label}_{lr}"
    if seed != 0:
        tag += f"_seed{seed}"
    if args.batch_size != DEFAULT_BATCH:
        tag += f"_batch{args.batch_size}"
    if args.steps != DEFAULT_STEPS:
        tag += f"_steps{args.steps}"
    if args.freeze_step is not None and "onebit_lamb" in METHOD_ARGS.get(label, []):
        tag += f"_freeze{args.freeze_step}"
    return "".join(c if c.isalnum() else "_" for c in tag)


def run_one(label, extra, lr, seed, args, out_dir):
    path = os.path.join(out_dir, "runs", f"{run_tag(label, lr, seed, args)}.csv")
    if os.path.exists(path) and not args.rerun:
        print(f"[convergence] {label} lr={lr} seed={seed}: reusing {path}", flush=True)
    else:
        cmd = ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), str(args.ranks), str(args.timeout),
               sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), *extra, "--lr", str(lr),
               "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--beta3", str(args.beta3),
               "--seed", str(seed), "--batch", str(args.batch_size), "--no-progress", "--csv", path]
        if args.freeze_step is not None and "onebit_lamb" in extra:
            cmd += ["--freeze-step", str(args.freeze_step)]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{label} lr={lr} seed={seed} failed (rc {proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        print(f"[convergence] {label} lr={lr} seed={seed}: {time.time() - t0:.0f} s", flush=True)
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        r["label"] = label
        r["seed"] = seed
        r["batch_per_rank"] = args.batch_size
    return rows


def mean_sd(xs):
    """Mean and sample standard deviation (0 for one value)."""
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def plot(best, out_dir, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, runs in best.items():  # runs: one list of rows per seed; the curve is their mean
        rows = runs[0]
        steps = [int(r["step"]) for r in rows]
        loss = [sum(float(run[i]["val_loss"]) for run in runs) / len(runs) for i in range(len(rows))]
        mb = [float(r["bytes"]) / 1e6 for r in rows]
        a.plot(steps, loss, marker=".", label=f"{label} (lr {rows[0]['lr']})")
        b.plot(mb, loss, marker=".", label=label)
    a.set_xlabel("step")
    a.set_ylabel("validation loss (nats/byte), mean over seeds")
    b.set_xlabel("MB handed to the collectives per rank")
    b.set_xscale("log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "convergence.png"), dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/convergence")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--beta3", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0, help="the seed, when --seeds is not given")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (e.g. 0,1,2): every run at each")
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH,
                    help="sequences per rank (global batch = ranks x this); e.g. 64 at 4 ranks for 256")
    ap.add_argument("--freeze-step", type=int, default=None,
                    help="1-bit LAMB warm-up steps (default: train_lm.py's, 15%% of --steps)")
    ap.add_argument("--tune-seed", type=int, default=None,
                    help="sweep the lr grid at this seed only, then run the other --seeds at each method's "
                         "best lr (default: the whole grid at every seed)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--methods", default="all", help="comma-separated labels, or 'all'")
    ap.add_argument("--grid-size", type=int, default=3, help="use the first N learning rates of each grid (at most 4)")
    ap.add_argument("--rerun", action="store_true", help="rerun runs whose CSV exists")
    args = ap.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    out_dir = os.path.join(ROOT, args.out) if not os.path.isabs(args.out) else args.out
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
    wanted = None if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    if wanted:
        unknown = [m for m in wanted if m not in METHOD_ARGS]
        if unknown:
            raise SystemExit(f"unknown method(s) {unknown}; choose from {list(METHOD_ARGS)}")
    methods = METHODS if wanted is None else [m for m in METHODS if m[0] in wanted]

    if args.tune_seed is not None and args.tune_seed not in seeds:
        raise SystemExit(f"--tune-seed {args.tune_seed} is not one of --seeds {seeds}")
    all_rows, best = [], {}
    for label, extra, grid in methods:
        finals = {}  # lr -> one list of rows per seed
        sweep = [args.tune_seed] if args.tune_seed is not None else seeds
        for lr in grid[: args.grid_size]:
            finals[lr] = []
            for seed in sweep:
                rows = run_one(label, extra, lr, seed, args, out_dir)
                all_rows += rows
                finals[lr].append(rows)
        lr_best = min(finals, key=lambda lr: mean_sd([float(run[-1]["val_loss"]) for run in finals[lr]])[0])
        for seed in seeds:  # with --tune-seed: the other seeds at the chosen lr only
            if seed not in sweep:
                rows = run_one(label, extra, lr_best, seed, args, out_dir)
                all_rows += rows
                finals[lr_best].append(rows)
        best[label] = sorted(finals[lr_best], key=lambda run: int(run[0]["seed"]))

    write_rows(all_rows, os.path.join(out_dir, "runs.csv"))
    seeds_txt = ", ".join(map(str, seeds))
    plot(best, out_dir, f"byte-level LM on the Python stdlib, {args.ranks} ranks x {args.batch_size} sequences, "
                        f"seed(s) {seeds_txt}, best lr per method")

    freeze = common.onebit_freeze_step(args)
    command = "python3 benchmarks/convergence.py " + " ".join(
        f'"{a}"' if (" " in a or "," in a) else a for a in (argv if argv is not None else sys.argv[1:]))
    ref = best.get("dense LAMB")
    ref_mean = mean_sd([float(run[-1]["val_loss"]) for run in ref])[0] if ref else None
    chosen = (f"best lr per method by final validation loss at seed {args.tune_seed}, the other seeds at that lr)."
              if args.tune_seed is not None else "best lr per method by mean final validation loss over the seeds).")
    lines = [
        f"Command: `{command.strip()}` ({args.ranks} ranks, {args.steps} steps, "
        f"global batch {args.ranks} x {args.batch_size} sequences x 64 bytes, seed(s) {seeds_txt}, "
        f"SLAMB beta3 {args.beta3}, H = 100, cyclic mask; 1-bit LAMB freeze_step {freeze}, eps 1e-6; "
        f"lr grids: LAMB/SLAMB/1-bit LAMB {LAMB_GRID[: args.grid_size]}, Adam {ADAM_GRID[: args.grid_size]}; "
        + chosen,
        "",
        "| method | best lr | final val loss (mean) | sd over seeds | per seed | vs dense LAMB | "
        "bytes vs dense allreduce | MB handed to the collectives per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, runs in best.items():
        lasts = [run[-1] for run in runs]
        m, sd = mean_sd([float(r["val_loss"]) for r in lasts])
        mb, _ = mean_sd([float(r["bytes"]) / 1e6 for r in lasts])
        vs = f"{m / ref_mean - 1:+.1%}" if ref_mean else "-"
        per_seed = " / ".join(f"{float(r['val_loss']):.4f}" for r in lasts)
        lines.append(f"| {label} | {lasts[0]['lr']} | {m:.4f} | {sd:.4f} | {per_seed} | {vs} | "
                     f"{float(lasts[0]['bytes_vs_dense']):.1%} | {mb:.1f} |")
    table = "\n".join(lines)
    with open(os.path.join(out_dir, "convergence.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
