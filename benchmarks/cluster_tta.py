"""Time to accuracy on the emulated cluster (``cluster.py tta``).

``examples/train_lm.py`` at the convergence benchmark's settings (``benchmarks/convergence.py``:
the same model, data, seed, batch and steps), run on ``--nodes`` emulated nodes whose links are
limited to ``--rate``, once per method at its best learning rate. The target is dense LAMB's
final validation loss **of the same run**; each method's time to it is the training time
(forward, backward, exchange and update: ``train_seconds``, evaluations excluded) at its first
evaluation at or below the target. Runs go to the end, nothing is extrapolated; a method that
never reaches the target says so. Evaluations every ``--eval-every`` steps bound the
resolution.

The learning rates: ``--lrs "dense LAMB=0.01,..."``, or ``--lr-from DIR``, a convergence
benchmark's output folder (its ``runs.csv``): each method's lr with the lowest final validation
loss at ``--seed`` and the batch and steps given here.
"""

import contextlib
import csv
import os
import shutil
import sys
import tempfile

from convergence import DEFAULT_BATCH, DEFAULT_STEPS, METHOD_ARGS
from csvout import write_rows
from netns import ROOT, Cluster, mpirun_local

DEFAULT_METHODS = "dense LAMB,1-bit LAMB,SLAMB k=0.1 fp32,SLAMB k=0.1 fp16"


def best_lrs(folder, labels, seed, batch, steps):
    """``{label: lr}`` from a convergence output folder: the lowest final validation loss at
    ``seed``, ``batch`` sequences per rank and ``steps`` steps."""
    with open(os.path.join(folder, "runs.csv")) as fh:
        rows = list(csv.DictReader(fh))
    out = {}
    for label in labels:
        finals = {}
        for r in rows:
            if (r["label"] == label and int(r["seed"]) == seed and int(r["batch_per_rank"]) == batch
                    and int(r["step"]) == steps):
                finals[r["lr"]] = float(r["val_loss"])
        if not finals:
            raise SystemExit(f"{folder}/runs.csv has no {label!r} run at seed {seed}, batch {batch}, {steps} steps")
        out[label] = float(min(finals, key=finals.get))
    return out


def time_to(rows, target):
    """The first evaluation at or below ``target``: (step, train seconds, bytes), or None."""
    for r in rows:
        if float(r["val_loss"]) <= target:
            return int(r["step"]), float(r["train_seconds"]), float(r["bytes"])
    return None


def tta_main(args):
    labels = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in labels if m not in METHOD_ARGS]
    if unknown or "dense LAMB" not in labels:
        raise SystemExit(f"--methods must include 'dense LAMB' (the target) and name known methods; "
                         f"unknown: {unknown}, known: {list(METHOD_ARGS)}")
    labels.remove("dense LAMB")
    labels.insert(0, "dense LAMB")  # first: it sets the target
    if args.lrs:
        lrs = {k.strip(): float(v) for k, v in (kv.rsplit("=", 1) for kv in args.lrs.split(","))}
    else:
        lrs = best_lrs(args.lr_from, labels, args.seed, args.batch, args.steps)
    missing = [m for m in labels if m not in lrs]
    if missing:
        raise SystemExit(f"no learning rate for {missing}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="slamb_tta_")
    rows, summary = [], []
    net = contextlib.nullcontext() if args.rate == "local" else Cluster(
        args.nodes, rate=args.rate, delay=args.delay, prefix=args.prefix, subnet=args.subnet)
    try:
        with net as cluster:
            for label in labels:
                out_csv = os.path.join(tmp, f"{label.replace(' ', '_')}.csv")
                cmd = [sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), *METHOD_ARGS[label],
                       "--lr", str(lrs[label]), "--steps", str(args.steps), "--eval-every", str(args.eval_every),
                       "--seed", str(args.seed), "--batch", str(args.batch), "--no-progress", "--threads", "1",
                       "--files", str(args.files), "--csv", out_csv]
                rc, out, err = cluster.mpirun(cmd, timeout=args.timeout) if cluster is not None else \
                    mpirun_local(args.nodes, cmd, args.timeout)
                if rc != 0 or not os.path.exists(out_csv):
                    raise SystemExit(f"[tta] {label} failed (rc {rc}):\n{out[-2000:]}\n{err[-3000:]}")
                with open(out_csv) as fh:
                    run = list(csv.DictReader(fh))
                for r in run:
                    r.update(label=label, link=args.rate, nodes=args.nodes)
                rows += run
                write_rows(rows, args.out)
                print(f"[tta] {label} lr {lrs[label]}: final val loss {float(run[-1]['val_loss']):.4f}, "
                      f"{float(run[-1]['train_seconds']):.0f} s of training", file=sys.stderr, flush=True)
                summary.append((label, lrs[label], run))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = tta_table(summary, args)
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as fh:
        fh.write(table + "\n")
    print(table)
    if not args.no_plot:
        print(f"wrote {plot_tta(summary, os.path.splitext(args.out)[0] + '.png', args)}")
    print(f"wrote {args.out} and {md}")
    return 0


def tta_table(summary, args):
    target = float(summary[0][2][-1]["val_loss"])
    base = time_to(summary[0][2], target)
    lines = [
        f"Command: `python3 benchmarks/cluster.py tta {' '.join(sys.argv[2:])}` ({args.nodes} nodes, link "
        f"{args.rate} per node, {args.steps} steps, {args.batch} sequences per rank, seed {args.seed}; target: dense "
        f"LAMB's final validation loss {target:.4f}; time = training steps only, evaluations every "
        f"{args.eval_every} steps excluded).",
        "",
        "| method | lr | steps to target | training s to target | vs dense LAMB | MB per rank to target | "
        "final val loss | median step ms | total training s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, lr, run in summary:
        last = run[-1]
        hit = time_to(run, target)
        tail = f"{float(last['val_loss']):.4f} | {float(last['step_ms_median']):.0f} | {float(last['train_seconds']):.0f} |"
        if hit is None:
            lines.append(f"| {label} | {lr} | not reached | - | - | - | {tail}")
        else:
            step, sec, b = hit
            lines.append(f"| {label} | {lr} | {step} | {sec:.0f} | {sec / base[1]:.2f}x | {b / 1e6:.1f} | {tail}")
    return "\n".join(lines)


def plot_tta(summary, path, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = float(summary[0][2][-1]["val_loss"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, lr, run in summary:
        ax.plot([float(r["train_seconds"]) for r in run], [float(r["val_loss"]) for r in run], marker=".",
                label=f"{label} (lr {lr})")
    ax.axhline(target, color="k", ls="--", lw=0.8, label="target: dense LAMB's final loss")
    ax.set_xlabel("training time, s (evaluations excluded)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_ylim(top=min(ax.get_ylim()[1], target + 1.0))
    ax.set_title(f"train_lm.py on {args.nodes} emulated nodes, {args.rate} per node (netns + tbf, TCP)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_parser(sub, net_opts):
    p = sub.add_parser("tta", help="time to dense LAMB's final loss per method on a slow link")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="50mbit", help="per-node link rate, or 'local' (plain mpirun, no emulation)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="labels of benchmarks/convergence.py; must include dense LAMB")
    p.add_argument("--lrs", default=None, help='"label=lr,..." (default: --lr-from)')
    p.add_argument("--lr-from", default=os.path.join(ROOT, "benchmarks", "results", "convergence_onebit"),
                   help="a convergence benchmark's output folder: each method's best lr at --seed")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="sequences per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--files", type=int, default=200, help="stdlib modules in the corpus (train_lm.py's default)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", default="results/cluster_tta.csv")
    p.add_argument("--no-plot", action="store_true")
    net_opts(p)
    return p
