# python3 benchmarks/resize_cost.py --out benchmarks/results/resize
# (each run: bash scripts/mpirun.sh N ... python3 examples/train_lm.py ... [--save-at S | --resume])
"""What a change of the number of ranks mid-run costs in final validation loss (issue 23).

The language model of ``examples/train_lm.py`` (its defaults: 600 steps, 16 sequences per
rank), for each method and seed:

* **4 ranks, uninterrupted**, saving every rank's state with ``slamb_comm.methods.checkpoint`` at
  ``--at`` (step 300);
* **4 -> 2**: that checkpoint resumed on 2 ranks (resized by docs/algorithm.md section 10's
  rule) and trained to the end;
* **2 ranks, uninterrupted**, saving at the same step;
* **2 -> 4**: that checkpoint resumed on 4 ranks.

The per-rank batch is fixed, so the global batch halves (or doubles) with the ranks: the
resized run should land between the two uninterrupted ones; what the rule costs is how far it
lands from the interpolation. Writes ``<out>/runs.csv`` (the last evaluation of every run) and
``<out>/resize.md`` (means over seeds with their range). Runs already in ``<out>/runs/`` are
reused (``--rerun`` to redo).
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import time

from csvout import write_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

METHODS = {  # label: train_lm.py arguments (each method's best lr of benchmarks/convergence.py)
    "SLAMB k=0.1 fp16": ["--optimizer", "slamb", "--ratio", "0.1", "--value-dtype", "float16", "--lr", "0.01"],
    "top-k Adam k=0.01": ["--optimizer", "topk-adam", "--ratio", "0.01", "--lr", "0.002"],
    "1-bit LAMB": ["--optimizer", "onebit_lamb", "--eps", "1e-6", "--lr", "0.01"],
}
ARMS = ("4 ranks", "4 -> 2", "2 ranks", "2 -> 4")


def tag(label, seed, arm):
    return "".join(c if c.isalnum() else "_" for c in f"{label}_{arm}_seed{seed}")


def run(label, seed, arm, args):
    """One run of ``arm``; returns its last CSV row."""
    out = os.path.join(args.out, "runs")
    path = os.path.join(out, tag(label, seed, arm) + ".csv")
    if os.path.exists(path) and not args.rerun:
        print(f"[resize] {label} seed {seed} {arm}: reusing {path}", flush=True)
    else:
        ranks = int(arm.split()[-1]) if "->" in arm else int(arm.split()[0])
        source = "4 ranks" if arm == "4 -> 2" else "2 ranks"
        ckpt = os.path.join(args.scratch, tag(label, seed, source if "->" in arm else arm))
        cmd = ["bash", os.path.join(ROOT, "scripts", "mpirun.sh"), str(ranks), str(args.timeout), sys.executable,
               os.path.join(ROOT, "examples", "train_lm.py"), *METHODS[label], "--seed", str(seed),
               "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--no-progress", "--csv", path,
               "--checkpoint-dir", ckpt]
        if "->" in arm:
            cmd.append("--resume")
        else:
            shutil.rmtree(ckpt, ignore_errors=True)
            cmd += ["--save-at", str(args.at)]
        if "onebit_lamb" in METHODS[label]:  # the same warm-up in every arm: 15% of the whole run
            cmd += ["--freeze-step", str(max(10, round(0.15 * args.steps)))]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{label} seed {seed} {arm} failed (rc {proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        print(f"[resize] {label} seed {seed} {arm}: {time.time() - t0:.0f} s", flush=True)
    row = list(csv.DictReader(open(path)))[-1]
    return dict(row, label=label, seed=seed, arm=arm)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "resize"))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--at", type=int, default=300, help="the step after which the checkpoint is taken")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--timeout", type=int, default=1800, help="outer timeout of each run, seconds")
    ap.add_argument("--rerun", action="store_true")
    ap.add_argument("--scratch", default="/tmp/slamb_comm_resize", help="where the step-300 checkpoints go")
    args = ap.parse_args(argv)
    labels = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in labels if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:  # every method at one seed before the next seed
        for label in labels:
            for arm in ARMS:  # each resized arm after the run that wrote its checkpoint
                rows.append(run(label, seed, arm, args))
            write_rows(rows, os.path.join(args.out, "runs.csv"))
    lines = [f"`python3 benchmarks/resize_cost.py --seeds {args.seeds} --steps {args.steps} --at {args.at}`: final "
             f"validation loss (nats per byte), mean over seeds {args.seeds} (min-max); the checkpoint is taken "
             f"after step {args.at} of {args.steps}.", "",
             "| method | " + " | ".join(ARMS) + " | 4 -> 2 minus the mean of 4 and 2 | 2 -> 4 minus that mean |",
             "|---" * (len(ARMS) + 3) + "|"]
    for label in labels:
        cell, mean = [], {}
        for arm in ARMS:
            v = [float(r["val_loss"]) for r in rows if r["label"] == label and r["arm"] == arm]
            mean[arm] = sum(v) / len(v)
            cell.append(f"{mean[arm]:.4f} ({min(v):.4f}-{max(v):.4f})")
        mid = (mean["4 ranks"] + mean["2 ranks"]) / 2
        lines.append(f"| {label} | " + " | ".join(cell)
                     + f" | {mean['4 -> 2'] - mid:+.4f} | {mean['2 -> 4'] - mid:+.4f} |")
    with open(os.path.join(args.out, "resize.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
