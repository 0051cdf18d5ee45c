"""The synthetic step-time benchmark on the emulated cluster (``cluster.py loop`` / ``bench`` / ``report``).

``loop`` (run under mpirun) is a synthetic training loop on a flat fp32 buffer: per step a
fixed compute cost (single-threaded ``--matmuls`` matmuls of ``--matmul-dim``), then the
exchange:

- ``dense``      -- ``Communicator.sync`` of the gradient (fused fp32 allreduce-mean);
- ``dense_hvd``  -- ``hvd.allreduce`` (Average, fp32) of the gradient as a torch tensor;
- ``slamb``      -- ``Communicator.masked_allreduce`` of the momentum (ratio 0.1, fp16
  payload, cyclic mask) plus the periodic parameter sync (``Communicator.sync``) every H
  steps, its measured time amortised over H;

and with ``--optimizer``: ``dense`` then runs a NumPy LAMB update on the mean gradient
and ``slamb`` runs ``slamb_comm.methods.slamb.SlambRule.step`` (moments, masked allreduce, trust
ratios, update, sync), so a step is compute + optimizer + communication.

``bench`` runs the loop with each method for every node count and link rate (CSV, PNG and
a markdown table); ``report`` redraws the table and plot from bench CSV(s).
"""

import json
import math
import os
import statistics
import sys
import time

from csvout import write_rows
from netns import HERE, Cluster, mpirun_local, rate_bps

LOOP = [sys.executable, os.path.join(HERE, "cluster.py"), "loop"]  # the loop's command line (under mpirun)


# ====================================================================== the synthetic loop (under mpirun)
def loop_main(args):
    import numpy as np
    from mpi4py import MPI

    import slamb_comm as sc

    world = MPI.COMM_WORLD
    P = world.size
    n = 2**args.log2
    cols = 1024
    per = min(n, 2**20)
    layout = sc.Layout([(per // cols, cols)] * (n // per), "float32")
    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal(n).astype(np.float32) * 0.1
    grads = [rng.standard_normal(n).astype(np.float32) * 0.01 for _ in range(2)]
    a = rng.standard_normal((args.matmul_dim, args.matmul_dim)).astype(np.float32)
    transport = sc.MPITransport()
    hvd = torch = None
    if args.method == "dense_hvd":
        os.environ.update({"HOROVOD_FUSION_THRESHOLD": str(64 * 2**20), "HOROVOD_CYCLE_TIME": "1",
                           "HOROVOD_AUTOTUNE": "0"})
        import torch
        import horovod.torch as hvd

        torch.set_num_threads(1)
        hvd.init()
    if args.method == "slamb":
        comm = sc.Communicator(transport, layout, ratio=args.ratio, mask="cyclic", value_dtype=args.value_dtype, seed=3)
    else:
        comm = sc.Communicator(transport, layout, ratio=1.0, seed=3)
    opt = None
    if args.optimizer and args.method == "slamb":
        from slamb_comm.methods.slamb import SlambRule

        opt = SlambRule(comm, lr=0.01, weight_decay=0.01, beta3=0.9, sync_interval=args.sync_interval)
    lamb = _Lamb(layout, np) if args.optimizer and args.method != "slamb" else None
    gbuf = np.empty(n, np.float32)
    m = grads[0].copy()
    parts = []  # Traffic of the timed exchanges (encode / comm / decode split)

    def nic():
        try:  # inside an emulated node this is the node's own link; elsewhere not meaningful
            with open("/sys/class/net/eth0/statistics/tx_bytes") as fh:
                return int(fh.read())
        except OSError:
            return 0

    def compute():
        for _ in range(args.matmuls):
            a @ a

    step_t, comp_t, sync_t = [], [], []
    total = args.warmup + args.steps
    for t in range(1, total + 1):
        g = grads[t % 2]
        if t == args.warmup + 1:
            tx0 = nic()
        world.Barrier()
        t0 = time.perf_counter()
        compute()
        t1 = time.perf_counter()
        synced = 0.0
        if args.method == "slamb":
            if opt is not None:
                before = comm.stats.by_kind.get("sync")
                opt.step(x, g)
                after = comm.stats.by_kind.get("sync")
                if after is not None and (before is None or after.calls > before.calls):
                    synced = (after.comm_s + after.encode_s + after.decode_s) - (
                        0 if before is None else before.comm_s + before.encode_s + before.decode_s)
            else:  # the exchange alone: SLAMB's momentum masked allreduce (m's values do not matter)
                comm.masked_allreduce(m, t)
                parts.append(comm.stats.last)
                if (t - 1) % args.sync_interval == 0:
                    ts = time.perf_counter()
                    comm.sync(x)
                    synced = time.perf_counter() - ts
        elif args.method == "dense":
            gbuf[...] = g
            comm.sync(gbuf)
            parts.append(comm.stats.last)
            if lamb is not None:
                lamb.step(x, gbuf)
        else:  # dense_hvd
            tg = torch.from_numpy(gbuf)
            gbuf[...] = g
            hvd.allreduce_(tg, op=hvd.Average, name="grad")
            if lamb is not None:
                lamb.step(x, gbuf)
        t2 = time.perf_counter()
        if t > args.warmup:
            step_t.append(t2 - t0 - synced)  # the sync step's sync is amortised below instead
            comp_t.append(t1 - t0)
        if synced:
            sync_t.append(synced)
    tx = nic() - tx0
    fields3 = ("encode_s", "comm_s", "decode_s")
    if opt is not None:
        tot = comm.stats.by_kind["masked_allreduce"]
        split = [getattr(tot, f) / tot.calls for f in fields3]
    elif parts:
        split = [statistics.median(getattr(p, f) for p in parts[-len(step_t):]) for f in fields3]
    else:
        split = [float("nan")] * 3
    split_all = world.gather(split, root=0)
    tx_all = world.gather(tx, root=0)
    # slowest rank per step
    step_all = world.gather(step_t, root=0)
    comp_all = world.gather(comp_t, root=0)
    sync_all = world.gather(sync_t, root=0)
    if world.rank != 0:
        return
    steps = [max(v) for v in zip(*step_all)]
    comps = [max(v) for v in zip(*comp_all)]
    med = statistics.median(steps)
    sync_s = max(statistics.median(s) for s in sync_all) if sync_all and all(sync_all) else 0.0
    amort = med + (sync_s / args.sync_interval if args.method == "slamb" else 0.0)
    k = comm.stats.by_kind
    ex = k.get("masked_allreduce") if args.method == "slamb" else k.get("sync")
    if args.method == "dense_hvd":
        payload = 4 * n
    else:
        payload = ex.payload_bytes / ex.calls if ex else 0
    if args.method == "slamb":
        payload += 4 * (n + 1) / args.sync_interval  # the periodic sync, amortised
    res = {
        "method": args.method, "optimizer": int(bool(args.optimizer)), "ranks": P, "elements": n,
        "ratio": args.ratio if args.method == "slamb" else 1.0,
        "value_dtype": args.value_dtype if args.method == "slamb" else "float32",
        "sync_interval": args.sync_interval, "steps": len(steps),
        "step_median_s": med, "step_p25_s": float(np.percentile(steps, 25)), "step_p75_s": float(np.percentile(steps, 75)),
        "sync_s": sync_s, "step_amortised_s": amort, "compute_median_s": statistics.median(comps),
        "payload_bytes_per_step": payload, "dense_payload_bytes": 4 * n,
        "wire_bytes_per_step": payload * 2 * (P - 1) / P,
        "encode_s": max(v[0] for v in split_all), "comm_s": max(v[1] for v in split_all),
        "decode_s": max(v[2] for v in split_all),
        "nic_tx_bytes_per_node_per_step": statistics.mean(tx_all) / len(steps) if os.environ.get("SLAMBX_NODE") else float("nan"),
    }
    print("RESULT " + json.dumps(res), flush=True)


class _Lamb:
    """Plain LAMB (bias-corrected Adam direction, per-tensor trust ratio) on a fused buffer."""

    def __init__(self, layout, np):
        self.np = np
        n = layout.total
        self.m = np.zeros(n, np.float32)
        self.v = np.zeros(n, np.float32)
        self.t = 0
        self.starts = np.asarray(layout.offsets)
        self.sizes = np.asarray(layout.sizes)

    def step(self, x, g, lr=0.01, b1=0.9, b2=0.999, eps=1e-6, wd=0.01):
        np = self.np
        self.t += 1
        self.m *= b1
        self.m += (1 - b1) * g
        self.v *= b2
        self.v += (1 - b2) * g * g
        u = self.m / (1 - b1**self.t)
        d = np.sqrt(self.v / (1 - b2**self.t))
        d += eps
        u /= d
        u += wd * x
        xn = np.sqrt(np.add.reduceat(x * x, self.starts))
        un = np.sqrt(np.add.reduceat(u * u, self.starts))
        phi = np.where((xn > 0) & (un > 0), np.clip(xn / np.where(un > 0, un, 1), 0.01, 1000), 1.0)
        u *= np.repeat((lr * phi).astype(np.float32), self.sizes)
        x -= u


# ====================================================================== bench (root)
def parse_result(out):
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


def bench_main(args):
    nodes_list = [int(v) for v in args.nodes.split(",")]
    rates = [r.strip() for r in args.rates.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    rows = []
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    base_loop = ["--log2", str(args.log2), "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--matmuls", str(args.matmuls), "--matmul-dim", str(args.matmul_dim),
                 "--sync-interval", str(args.sync_interval)] + (["--optimizer"] if args.optimizer else [])
    for nodes in nodes_list:
        for rate in rates:
            if rate == "local":
                for m in methods:
                    rc, out, err = mpirun_local(nodes, [*LOOP, *base_loop, "--method", m], args.timeout)
                    _collect(rows, nodes, rate, m, rc, out, err)
                continue
            with Cluster(nodes, rate=rate, delay=args.delay, prefix=args.prefix, subnet=args.subnet) as cl:
                for m in methods:
                    rc, out, err = cl.mpirun([*LOOP, *base_loop, "--method", m], timeout=args.timeout)
                    _collect(rows, nodes, rate, m, rc, out, err)
            write_rows(rows, args.out)
    write_rows(rows, args.out)
    print(cluster_table(rows))
    print(f"wrote {args.out}")
    if not args.no_plot:
        print(f"wrote {plot_cluster(rows, os.path.splitext(args.out)[0] + '.png')}")
    return 0 if all(r.get("ok") for r in rows) else 1


def _collect(rows, nodes, rate, method, rc, out, err):
    res = parse_result(out)
    if rc != 0 or res is None:
        print(f"[bench] {nodes} nodes {rate} {method}: FAILED rc={rc}\n{out[-2000:]}\n{err[-3000:]}", file=sys.stderr)
        rows.append({"nodes": nodes, "link": rate, "method": method, "ok": 0})
        return
    res.update({"nodes": nodes, "link": rate, "ok": 1})
    rows.append(res)
    print(f"[bench] {nodes} nodes, link {rate}, {method}: step {res['step_amortised_s'] * 1e3:.1f} ms "
          f"(compute {res['compute_median_s'] * 1e3:.1f} ms)", file=sys.stderr, flush=True)


def cluster_table(rows):
    out = ["| nodes | link per node | method | step ms, median [p25, p75] | compute ms | payload / step | "
           "NIC tx / node / step | exchange encode / comm / decode ms | step / dense |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not int(r.get("ok", 0)):
            out.append(f"| {r['nodes']} | {r['link']} | {r['method']} | FAILED | | | | | |")
            continue
        dense = next((d for d in rows if int(d.get("ok", 0)) and d["nodes"] == r["nodes"] and d["link"] == r["link"]
                      and d["method"] == "dense" and int(d["optimizer"]) == int(r["optimizer"])), None)
        rel = float(r["step_amortised_s"]) / float(dense["step_amortised_s"]) if dense else float("nan")
        tx = float(r.get("nic_tx_bytes_per_node_per_step", "nan") or "nan")
        am = float(r["step_amortised_s"]) - float(r["step_median_s"])  # the sync's share, slamb only
        out.append(
            f"| {r['nodes']} | {r['link']} | {r['method']}{' + optimizer' if int(r['optimizer']) else ''} | "
            f"{float(r['step_amortised_s']) * 1e3:.0f} [{(float(r['step_p25_s']) + am) * 1e3:.0f}, "
            f"{(float(r['step_p75_s']) + am) * 1e3:.0f}] | {float(r['compute_median_s']) * 1e3:.0f} | "
            f"{float(r['payload_bytes_per_step']) / 1e6:.2f} MB | "
            f"{'-' if math.isnan(tx) else f'{tx / 1e6:.2f} MB'} | {_ms3(r)} | {rel:.2f} |")
    return "\n".join(out)


def _ms3(r):
    v = [float(r.get(k, "nan") or "nan") for k in ("encode_s", "comm_s", "decode_s")]
    return "-" if any(math.isnan(x) for x in v) else " / ".join(f"{x * 1e3:.0f}" for x in v)


def plot_cluster(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if int(r.get("ok", 0))]
    def link_order(link):
        return {"none": 1e30, "local": 1e31}.get(link) or rate_bps(link)

    groups = sorted({(int(r["nodes"]), r["link"]) for r in ok}, key=lambda g: (g[0], link_order(g[1])))
    methods = sorted({r["method"] for r in ok}, key=lambda m: ["dense", "dense_hvd", "slamb"].index(m)
                     if m in ("dense", "dense_hvd", "slamb") else 9)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 4.3))
    w = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs, ys, cs = [], [], []
        for i, g in enumerate(groups):
            r = next((r for r in ok if (int(r["nodes"]), r["link"]) == g and r["method"] == m), None)
            if r:
                xs.append(i + (j - (len(methods) - 1) / 2) * w)
                ys.append(float(r["step_amortised_s"]) * 1e3)
                cs.append(float(r["compute_median_s"]) * 1e3)
        ax.bar(xs, ys, w, label=m)
        ax.bar(xs, cs, w, fill=False, hatch="//", edgecolor="k", lw=0.5)
        if m != "dense":
            for xv, yv, g in zip(xs, ys, [g for g in groups if any(
                    (int(r["nodes"]), r["link"]) == g and r["method"] == m for r in ok)]):
                d = next((r for r in ok if (int(r["nodes"]), r["link"]) == g and r["method"] == "dense"), None)
                if d:
                    ax.text(xv, yv, f"{yv / (float(d['step_amortised_s']) * 1e3):.2f}x", ha="center",
                            va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{n} nodes\n{l}" for n, l in groups], fontsize=8)
    ax.set_ylabel("step time, ms (median of slowest rank)\nlabels: step / dense step")
    n = int(ok[0]["elements"]) if ok else 0
    opt = ok and int(ok[0].get("optimizer", 0))
    what = ("dense = fused fp32 allreduce + NumPy LAMB; slamb = SlambRule.step (k=0.1 fp16, sync every H)" if opt else
            "dense = fused fp32 allreduce; slamb = masked allreduce k=0.1 fp16 + sync/H")
    ax.set_title(f"emulated cluster (netns + tc tbf per node link, TCP), {n / 2**20:g}M fp32 elements\n"
                 f"{what}\nhatched = compute; 'none' = netns without rate limit; 'local' = plain mpirun, shared memory",
                 fontsize=7)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


