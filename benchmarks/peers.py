# python3 benchmarks/peers.py --out benchmarks/results/peers      (each run: torchrun --standalone --nproc_per_node 4 ...)
"""SLAMB against what users pick instead: dense AdamW and LAMB, SAdamW, DiLoCo, DES-LOC, DeMo (issue 27).

One harness on torchrun/gloo, the task of ``examples/train_lm.py`` (the byte-level transformer
on the standard library's source, 470,784 parameters, 16 sequences of 64 bytes per rank, the
same seeds, per-rank batches and evaluation batches), ``--steps`` steps (600) at ``--ranks``
ranks (4), every method through slamb_comm's API:

* ``adamw``: DDP + ``torch.optim.AdamW`` (the users' baseline); ``lamb``: DDP + ``LAMB``;
* ``slamb``: ``DistributedOptimizer(SLAMB(ratio=0.1, float16, beta3=0.9, H=100))``, the main job's
  settings; ``sadamw``: the same exchange under AdamW's update; ``sadamw-k02``: at k = 0.02
  (under 2% of the dense payload);
* ``diloco``: ``DiLoCo(AdamW, H=50)``, outer Nesterov 0.7 / 0.9; ``desloc``: ``DesLoc(AdamW,
  H=50)`` (m every 150, v every 300 steps);
* ``demo``: ``DeMo`` (top-32 of 64 x 64 DCT blocks, all-gathered);
* ``sparseloco``: ``SparseLoCo(AdamW, H=5, topk=256)`` (top-256 of each 4096-element chunk of the
  error-fed pseudo-gradient, 2-bit values, all-gathered); ``sparseloco-shared``:
  ``SharedMaskSparseLoCo(AdamW, H=5, ratio=1/32)`` (the shared cyclic mask at the same payload,
  float16 values, one allreduce); ``sparseloco-sharedtopk``: ``SharedTopKSparseLoCo(AdamW, H=5,
  topk=128)`` (one rank's chunk-wise top-k offsets, taking turns, broadcast; every rank's float16
  values there in one allreduce; the same payload); docs/algorithm.md section 14; ``sparseloco@H@TOPK`` and
  ``sparseloco-shared@H@RATIO[@BETA]``, ``sparseloco-sharedtopk@H@TOPK`` for other settings, swept like their base;
* ``slamb@K@H``, ``sadamw@K@H``: the sparse exchange at ratio K and sync interval H, at the base
  method's best lr (0.01, 0.004), for settings at equal payload; ``sadamw@K@H@SEED``: with the
  cyclic mask of another seed (the adapters' default is 0, so every run at one k shares one mask).

Bytes are every optimizer's ``step_traffic()`` (payload handed to the collectives, per rank),
against the dense reference of a step (one float32 allreduce of every gradient,
docs/algorithm.md section 4); the dense methods' payload is that reference itself. Wire bytes
at P = 4, 64 and 1,024 come from the collectives' cost model: an allreduce's wire per rank is
``2 (P-1)/P`` of its payload, an all-gather's ``(P-1)`` times it (DeMo's grows with P).

The learning rate of each method is swept over its grid at seed 0; the best (lowest final
validation loss) then runs at the other seeds. Writes ``<out>/runs.csv`` (every evaluation of
every run), ``<out>/peers.md`` (the table) and ``<out>/peers.png`` (validation loss against
cumulative payload, mean over seeds). Runs already in ``<out>/runs/`` are reused. ``--parallel``
runs that many jobs at once (on a machine with cores for them). ``--batch`` sets the sequences per
rank and step (16, the example's; issue 45 ran 64 for LAMB's large batches): the CSV's ``batch``
column, and the run's tag when it is not 16 (so the 16-sequence runs keep their names); the
evaluation batches and the byte accounting (per step) do not change with it.
"""

import argparse
import csv
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from csvout import write_rows  # noqa: E402

ADAMW_GRID = (0.002, 0.004, 0.008)
LAMB_GRID = (0.005, 0.01, 0.02)
DEMO_GRID = (0.001, 0.002, 0.004)
METHODS = {  # name: (lr grid, collective)
    "adamw": (ADAMW_GRID, "allreduce"),
    "lamb": (LAMB_GRID, "allreduce"),
    "slamb": (LAMB_GRID, "allreduce"),
    "sadamw": (ADAMW_GRID, "allreduce"),
    "sadamw-k02": (ADAMW_GRID, "allreduce"),
    "diloco": (ADAMW_GRID, "allreduce"),
    "desloc": (ADAMW_GRID, "allreduce"),
    "demo": (DEMO_GRID, "allgather"),
    # SparseLoCo (issue 36): per-rank chunk-wise top-k of the error-fed pseudo-gradient, 2-bit
    # values, one all-gather per outer step; and the same outer step on the shared cyclic mask,
    # one float16 allreduce (docs/algorithm.md section 14); settings in _sparseloco. Variants:
    # sparseloco@H@TOPK, sparseloco-shared@H@RATIO[@BETA] (sync interval, top-k per chunk, density)
    "sparseloco": (ADAMW_GRID, "allgather"),
    "sparseloco-shared": (ADAMW_GRID, "allreduce"),
    # the shared top-k (section 14.7): the leader's chunk-wise top-k offsets broadcast (12 bits
    # each), every rank's float16 values there in one allreduce; sparseloco-sharedtopk@H@TOPK
    "sparseloco-sharedtopk": (ADAMW_GRID, "broadcast+allreduce"),
    # SAdamW with its second moment averaged over the ranks every 100 / 300 steps (DES-LOC's
    # argument), at SAdamW's best lr (not swept again): the measurement behind the default
    "sadamw-v100": ((0.004,), "allreduce"),
    "sadamw-v300": ((0.004,), "allreduce"),
}


# ---------------------------------------------------------------------------- one run (a torchrun worker)
def build(method, lr, model, named):
    """``(optimizer, ddp_model_or_None, traffic_fn)`` for ``method``: what a user writes."""
    import torch

    import slamb_comm.adapters.torch as st

    params = [p for _, p in named]
    if method in ("adamw", "lamb"):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.01) if method == "adamw" else \
            st.LAMB(ddp.parameters(), lr=lr, weight_decay=0.01)
        return opt, ddp, None
    if method.startswith("sparseloco"):
        return _sparseloco(method, lr, params)
    k, H = (0.02 if method == "sadamw-k02" else 0.1), 100
    seed = 0  # the adapters' default mask seed
    if "@" in method:  # a variant: slamb@K@H or sadamw@K@H, and @SEED for another cyclic mask (issue 36)
        k, H, *rest = method.split("@")[1:]
        k, H, seed = float(k), int(H), int(rest[0]) if rest else 0
    if method.startswith("slamb"):
        base = st.SLAMB(params, lr=lr, weight_decay=0.01, ratio=k, value_dtype="float16", beta3=0.9,
                        sync_interval=H, seed=seed)
    elif method.startswith("sadamw"):
        base = st.SAdamW(params, lr=lr, weight_decay=0.01, ratio=k, value_dtype="float16", beta3=0.9,
                         sync_interval=H, seed=seed)
    if method.startswith("slamb") or method.startswith("sadamw"):
        opt = st.DistributedOptimizer(base, named_parameters=named)
        if "-v" not in method:
            return opt, None, opt.step_traffic
        every = int(method.split("-v")[1])
        return opt, None, _averaging_v(opt, every)
    if method == "diloco":
        opt = st.DiLoCo(torch.optim.AdamW(params, lr=lr, weight_decay=0.01), sync_interval=50)
        return opt, None, opt.step_traffic
    if method == "desloc":
        opt = st.DesLoc(torch.optim.AdamW(params, lr=lr, weight_decay=0.01), sync_interval=50)
        return opt, None, opt.step_traffic
    if method == "demo":
        opt = st.DeMo(params, lr=lr, weight_decay=0.01, chunk=64, topk=32)
        return opt, None, opt.step_traffic
    raise SystemExit(f"unknown method {method!r}; known: {list(METHODS)}")


#: The bare arms' settings: SparseLoCo at H = 5 with the top 256 of each 4096-element chunk (6.25%),
#: the best of those tried at 600 steps (benchmarks/RESULTS.md, issue 36: at the paper's H = 15 and
#: 1.56%, 40 outer steps leave most entries unsent), and the shared mask at the same payload (1/32)
SPARSELOCO_H, SPARSELOCO_TOPK, SHARED_RATIO = 5, 256, 1 / 32


def _sparseloco(method, lr, params):
    """SparseLoCo (``sparseloco[@H@TOPK]``) or its shared-mask variant (``sparseloco-shared[@H@RATIO[@BETA]]``)
    around AdamW: ``(optimizer, None, traffic_fn)``."""
    import torch

    from slamb_comm.adapters.torch import SharedMaskSparseLoCo, SharedTopKSparseLoCo, SparseLoCo

    base, *rest = method.split("@")
    inner = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    H = int(rest[0]) if rest else SPARSELOCO_H
    if base == "sparseloco":
        opt = SparseLoCo(inner, sync_interval=H, topk=int(rest[1]) if len(rest) > 1 else SPARSELOCO_TOPK)
    elif base == "sparseloco-sharedtopk":
        opt = SharedTopKSparseLoCo(inner, sync_interval=H, topk=int(rest[1]) if len(rest) > 1 else SPARSELOCO_TOPK // 2)
    elif base == "sparseloco-shared":
        opt = SharedMaskSparseLoCo(inner, sync_interval=H, ratio=float(rest[1]) if len(rest) > 1 else SHARED_RATIO,
                                   beta=float(rest[2]) if len(rest) > 2 else 0.95)
    else:
        raise SystemExit(f"unknown method {method!r}; known: {list(METHODS)}")
    return opt, None, opt.step_traffic


def _averaging_v(opt, every):
    """A measurement, not a library feature: after every ``every``-th step, replace each
    parameter's second moment (SLAMB's state ``exp_avg_sq``, a live view of its v) by its mean
    over the ranks, one float32 allreduce, and count its payload; returns the traffic function."""
    import torch.distributed as dist

    steps = [0]

    def traffic():
        t = opt.step_traffic()
        steps[0] += 1
        if steps[0] % every == 0 and dist.get_world_size() > 1:
            vs = [opt.state[p]["exp_avg_sq"] for g in opt.param_groups for p in g["params"]]
            for v in vs:
                dist.all_reduce(v)
                v /= dist.get_world_size()
            t.payload_bytes += sum(v.numel() * v.element_size() for v in vs)
        return t
    return traffic


def worker(args):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import common
    from slamb_comm.adapters.torch import init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo")
    me, P = dist.get_rank(), dist.get_world_size()
    train_data, val_data = common.stdlib_corpus(200)
    torch.manual_seed(args.seed)
    model = common.tiny_transformer()
    for p in model.parameters():  # the same start on every rank
        dist.broadcast(p.data, 0)
    val = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in common.lm_eval_batches(val_data, 16, 64, 8)]
    named = list(model.named_parameters())
    N = sum(p.numel() for _, p in named)
    opt, ddp, traffic = build(args.method, args.lr, model, named)
    net = ddp if ddp is not None else model

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate():
        avg = [p.detach().clone() for p in model.parameters()]
        for a in avg:  # the mean of the replicas (local-update methods differ between averages)
            dist.all_reduce(a)
            a /= P
        saved = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, a in zip(model.parameters(), avg):
                p.copy_(a)
            loss = float(np.mean([loss_fn(model(x), y).item() for x, y in val]))
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
        return loss

    rows, payload, t0 = [], 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        rng = np.random.default_rng([args.seed, me, step])
        x, y = common.lm_batch(train_data, args.batch, 64, rng)
        opt.zero_grad()
        loss = loss_fn(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        payload += 4 * N if traffic is None else traffic().payload_bytes
        if step % args.eval_every == 0 or step == args.steps:
            v = evaluate()
            if me == 0:
                rows.append({"method": args.method, "lr": args.lr, "seed": args.seed, "ranks": P, "batch": args.batch,
                             "step": step,
                             "val_loss": v, "payload_bytes": payload, "dense_bytes": 4 * N * step,
                             "payload_vs_dense": payload / (4 * N * step), "params": N,
                             "seconds": time.perf_counter() - t0})
                print(f"{args.method} lr {args.lr} seed {args.seed} step {step} val {v:.4f} "
                      f"payload {payload / (4 * N * step):.2%}", flush=True)
    if me == 0:
        write_rows(rows, args.csv)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver
def tag(method, lr, seed, batch=16):
    """A run's file name; the batch is in it only when it is not the example's 16 (the earlier runs' names)."""
    name = f"{method}_{lr}_seed{seed}" + (f"_batch{batch}" if batch != 16 else "")
    return "".join(c if c.isalnum() else "_" for c in name)


def launch(method, lr, seed, args):
    path = os.path.join(args.out, "runs", tag(method, lr, seed, args.batch) + ".csv")
    if os.path.exists(path) and not args.rerun:
        return None, path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    cmd = ["timeout", str(args.timeout), sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(args.ranks), os.path.abspath(__file__), "--worker", "--method", method,
           "--lr", str(lr), "--seed", str(seed), "--steps", str(args.steps), "--eval-every", str(args.eval_every),
           "--batch", str(args.batch), "--csv", path]
    log = open(path + ".log", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env), path


def reuse(files, out):
    """Split earlier ``runs.csv`` files (comma-separated) into ``<out>/runs/<tag>.csv``: the runs
    they hold count as done (a run already there is kept), so one table can gather them."""
    for f in filter(None, (files or "").split(",")):
        by_tag = {}
        for r in csv.DictReader(open(f)):
            if not r.get("batch"):  # rows written before --batch: the example's 16, in the column after ranks
                r = dict(kv for k, v in r.items() for kv in ([(k, v), ("batch", "16")] if k == "ranks" else [(k, v)]))
            by_tag.setdefault(tag(r["method"], float(r["lr"]), int(r["seed"]), int(r["batch"])), []).append(r)
        for t, rows in by_tag.items():
            path = os.path.join(out, "runs", t + ".csv")
            if not os.path.exists(path):
                write_rows(rows, path)


def run_all(jobs, args):
    """Run ``(method, lr, seed)`` jobs, ``--parallel`` at a time; returns their CSV paths."""
    pending, running, paths = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < args.parallel:
            job = pending.pop(0)
            proc, path = launch(*job, args)
            paths[job] = path
            if proc is not None:
                running.append((job, proc, time.time()))
        for item in list(running):
            job, proc, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                if proc.returncode != 0:
                    tail = open(paths[job] + ".log").read()[-3000:]
                    raise SystemExit(f"{job} failed (rc {proc.returncode}):\n{tail}")
                print(f"[peers] {job}: {time.time() - t0:.0f} s", flush=True)
        time.sleep(0.5)
    return paths


def read(path):
    return [dict(r, val_loss=float(r["val_loss"]), step=int(r["step"]), payload_bytes=float(r["payload_bytes"]),
                 dense_bytes=float(r["dense_bytes"])) for r in csv.DictReader(open(path))]


def wire(method, payload_per_step, P):
    if METHODS[method][1] == "allgather":
        return (P - 1) * payload_per_step
    if METHODS[method][1] == "broadcast+allreduce":  # 12 of every 28 bits are offsets, sent once on each link
        return payload_per_step * (12 / 28 + 16 / 28 * 2.0 * (P - 1) / P)
    return 2.0 * (P - 1) / P * payload_per_step


def report(runs, args):
    """The table: per method its best lr, mean final loss over seeds, bytes and bytes to targets."""
    seeds = [int(s) for s in args.seeds.split(",")]
    mean_final, curves = {}, {}
    for m, per_lr in runs.items():
        lr = min(per_lr, key=lambda lr: per_lr[lr][seeds[0]][-1]["val_loss"])
        finals = [per_lr[lr][s][-1]["val_loss"] for s in seeds if s in per_lr[lr]]
        rows0 = per_lr[lr][seeds[0]]
        curve = [(rows0[i]["step"], rows0[i]["payload_bytes"],
                  sum(per_lr[lr][s][i]["val_loss"] for s in seeds if s in per_lr[lr]) / len(finals))
                 for i in range(len(rows0))]
        mean_final[m], curves[m] = (lr, finals), curve
    targets = {t: sum(mean_final[t][1]) / len(mean_final[t][1]) for t in ("adamw", "lamb") if t in mean_final}
    N = int(next(iter(next(iter(runs.values())).values()))[seeds[0]][-1]["params"])
    dense_step = 4 * N
    batch = f" --batch {args.batch}" if args.batch != 16 else ""
    lines = [f"`python3 benchmarks/peers.py --ranks {args.ranks} --steps {args.steps}{batch} --seeds {args.seeds}`: "
             f"the byte-level LM of examples/train_lm.py, {N:,} parameters, {args.ranks} ranks, {args.steps} steps "
             f"of {args.batch} sequences per rank; "
             f"final validation loss, mean over seeds {args.seeds} (min-max), at each method's best lr of its grid "
             f"at seed {seeds[0]}. Payload: bytes handed to the collectives per rank, against one float32 allreduce "
             "of every gradient per step; wire at P from the collectives' cost model.", "",
             "| method | lr | val loss | vs dense AdamW | payload | wire P=4 | wire P=64 | wire P=1024 | "
             "MB to AdamW's loss | MB to LAMB's loss |", "|---" * 10 + "|"]
    for m, (lr, finals) in mean_final.items():
        mean = sum(finals) / len(finals)
        curve = curves[m]
        steps = curve[-1][0]
        per_step = curve[-1][1] / steps
        ratio = per_step / dense_step
        wires = [wire(m, per_step, P) / (2.0 * (P - 1) / P * dense_step) for P in (4, 64, 1024)]
        reach = []
        for t in ("adamw", "lamb"):
            hit = next((b for _, b, v in curve if t in targets and v <= targets[t]), None)
            reach.append("never" if hit is None else f"{hit / 1e6:,.0f}")
        vs = f"{(mean / targets['adamw'] - 1):+.1%}" if "adamw" in targets else ""
        lines.append(f"| {m} | {lr} | {mean:.4f} ({min(finals):.4f}-{max(finals):.4f}) | {vs} | {ratio:.2%} | "
                     + " | ".join(f"{w:.2%}" for w in wires) + f" | {reach[0]} | {reach[1]} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "peers.md"), "w") as fh:
        fh.write(text)
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for m, curve in curves.items():
            ax.plot([b / 1e6 for _, b, _ in curve], [v for _, _, v in curve], marker=".", label=m)
        for t, v in targets.items():
            ax.axhline(v, ls=":", color="grey")
        ax.set_xscale("log")
        ax.set_xlabel("MB handed to the collectives per rank (cumulative)")
        ax.set_ylabel("validation loss (nats/byte), mean over seeds")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "peers.png"), dpi=120)
    except ImportError:
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--csv", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "peers"))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1,2", help="the lr sweep runs at the first; the best lr at all")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=16, help="sequences of 64 bytes per rank and step (the example's 16)")
    ap.add_argument("--parallel", type=int, default=1, help="jobs at once")
    ap.add_argument("--timeout", type=int, default=1800, help="outer timeout of each run, seconds")
    ap.add_argument("--grid-size", type=int, default=3, help="the first K points of each method's lr grid")
    ap.add_argument("--lr-grid", default=None,
                    help="lrs that replace the grids: '0.002,0.004' for every method, or per method "
                         "'adamw=0.004;sparseloco=0.004,0.008' (the others keep theirs)")
    ap.add_argument("--phase", choices=["sweep", "all"], default="all", help="sweep: seed 0's lr sweep only")
    ap.add_argument("--rerun", action="store_true")
    ap.add_argument("--reuse", default=None, help="earlier runs.csv files (comma-separated) whose runs count as done")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:  # variants of the sparse exchange: ratio K, sync interval H, at the base's best lr
        base, _, rest = m.partition("@")
        if rest and base in ("slamb", "sadamw") and len(rest.split("@")) in (2, 3):
            METHODS[m] = ((0.01,) if base == "slamb" else (0.004,), "allreduce")
        elif rest and base in ("sparseloco", "sparseloco-shared", "sparseloco-sharedtopk"):  # swept like their base
            METHODS[m] = METHODS[base]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    reuse(args.reuse, args.out)
    grid = {m: METHODS[m][0][:args.grid_size] for m in methods}
    for part in (args.lr_grid or "").split(";"):
        name, _, lrs = part.rpartition("=")
        if name.strip() and name.strip() not in methods:
            raise SystemExit(f"--lr-grid names {name.strip()!r}, which is not in --methods {methods}")
        if lrs.strip():
            for m in ([name.strip()] if name else methods):
                grid[m] = tuple(float(v) for v in lrs.split(","))
    if all(len(g) == 1 for g in grid.values()) and args.phase == "all":  # nothing to sweep: every seed at once
        run_all([(m, grid[m][0], s) for m in methods for s in seeds], args)
    paths = run_all([(m, lr, seeds[0]) for m in methods for lr in grid[m]], args)
    runs = {m: {lr: {seeds[0]: read(paths[(m, lr, seeds[0])])} for lr in grid[m]} for m in methods}
    if args.phase == "sweep":
        return None
    best = {m: min(runs[m], key=lambda lr: runs[m][lr][seeds[0]][-1]["val_loss"]) for m in methods}
    paths = run_all([(m, best[m], s) for m in methods for s in seeds[1:]], args)
    for (m, lr, s), path in paths.items():
        runs[m][lr][s] = read(path)
    all_rows = [dict(r) for m in runs for lr in runs[m] for s in runs[m][lr] for r in runs[m][lr][s]]
    write_rows(all_rows, os.path.join(args.out, "runs.csv"))
    report(runs, args)


if __name__ == "__main__":
    main()
