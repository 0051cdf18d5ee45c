# mpirun -np 4 python benchmarks/osu.py --out results/osu.csv
# (as root on a 2-core machine: bash scripts/mpirun.sh 4 900 python3 benchmarks/osu.py)
"""OSU-style latency/bandwidth benchmark: dense allreduces against slamb_comm's sparse exchanges.

Methods (``--methods``, all in one run, so every ratio is against the dense baseline of
the same run, same ranks, same size):

* ``mpi``       -- dense allreduce, raw mpi4py ``Allreduce(IN_PLACE, SUM)`` on a float32
  buffer (float16 payload: a user-defined MPI sum op, as in :class:`slamb_comm.MPITransport`;
  MPI has no half type);
* ``hvd``       -- dense ``hvd.allreduce(op=Average)`` of a float32 torch tensor;
* ``hvd_fp16``  -- the same with ``compression=hvd.Compression.fp16`` (payload float16);
* ``masked``    -- ``Communicator.masked_allreduce`` with the shared cyclic mask (ratio k);
* ``topk``      -- ``Communicator.sparse_allgather`` (exact top-k + error feedback, ratio k).

Horovod is pinned identically for both of its arms: ``HOROVOD_FUSION_THRESHOLD``,
``HOROVOD_CYCLE_TIME`` and ``HOROVOD_AUTOTUNE=0`` are set before ``hvd.init()`` (from
``--hvd-fusion-threshold`` / ``--hvd-cycle-time``) and written into every CSV row.

Per (size, method, ratio, payload dtype), after ``--warmup`` untimed iterations, each
timed iteration starts after a barrier and measures the wall time of the whole call on
every rank; the iteration's latency is the maximum over ranks (a collective is done when
its slowest rank is). Reported: median, 25th/75th percentile, min and max of that latency;
iterations run until ``--iters`` or until ``--max-seconds`` of timed work (at least
``--min-iters``).

Columns:

* ``payload_bytes``: what one rank hands to the collective (docs/algorithm.md section 4;
  the core's arms include their 1-element status word / 8-byte header);
* ``wire_bytes``: ``2 (P-1)/P * payload`` for allreduce, ``(P-1) * payload`` for allgather;
* ``algbw_GBps`` = dense fp32 bytes of the buffer (4 N) / median latency -- the useful
  data rate, comparable across methods; ``busbw_GBps`` = wire bytes / median latency;
* ``encode_s``/``decode_s``/``comm_s``: medians of ``Communicator.stats.last`` (core arms only);
  ``encode_in_GBps`` = 4 N / encode_s (bytes of the dense input the encoder scans),
  ``encode_out_GBps`` = payload / encode_s, ``decode_GBps`` = bytes decoded / decode_s
  (payload for the masked allreduce, P * payload for the allgather);
  ``copy_GBps``: a plain ``np.copyto`` of the 4 N-byte buffer on rank 0, for reference;
* ``*_vs_dense``: against the ``mpi`` float32 arm of the same size in the same run.

Rank 0 writes the CSV, PNG plots (latency vs size per method and ratio; payload and
time ratios) and prints a markdown summary table.
"""

import argparse
import csv
import math
import os
import statistics
import sys
import time

import numpy as np
from csvout import write_rows

import slamb_comm as sc

MPI = None  # mpi4py.MPI, imported by main() only when measuring (--report needs no MPI)

ALL_METHODS = ("mpi", "hvd", "hvd_fp16", "masked", "topk")


def pct(vals, q):
    """Linear-interpolated percentile of a list (q in [0, 100])."""
    return float(np.percentile(np.asarray(vals, dtype=np.float64), q))


class Runner:
    """Times one callable collectively: barrier, call, max over ranks of each iteration's wall time."""

    def __init__(self, world, args):
        self.world = world
        self.args = args

    def run(self, fn, after=None):
        a = self.args
        lat, lasts = [], []
        for i in range(a.warmup):
            fn(i + 1)
        spent = 0.0
        i = a.warmup
        while True:
            self.world.Barrier()
            t0 = time.perf_counter()
            fn(i + 1)
            dt = time.perf_counter() - t0
            i += 1
            dt = self.world.allreduce(dt, op=MPI.MAX)
            lat.append(dt)
            if after is not None:
                lasts.append(after())
            spent += dt
            n = len(lat)
            go_on = n < a.min_iters or (n < a.iters and spent < a.max_seconds)
            if not self.world.bcast(go_on, root=0):
                break
        return lat, lasts


def make_layout(n):
    """A fused buffer of n elements cut into 2-D tensors of at most 2^20 elements, with the
    always-dense rule off (``dense_threshold=0``) so that the mask applies at every size."""
    cols = min(1024, n // 2)
    per = min(n, 2**20)
    shapes = [(per // cols, cols)] * (n // per)
    return sc.Layout(shapes, "float32", dense_threshold=0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,14,18,22",
                    help="log2 of element counts, comma-separated (the issue's full range: 10..26)")
    ap.add_argument("--ratios", default="1,0.1,0.01,0.001")
    ap.add_argument("--dtypes", default="float32,float16", help="payload dtypes")
    ap.add_argument("--methods", default=",".join(ALL_METHODS))
    ap.add_argument("--block", type=int, default=1,
                    help="masked: the cyclic mask's run length (1 = single elements, as in docs/algorithm.md)")
    ap.add_argument("--iters", type=int, default=30, help="at most this many timed iterations")
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=2.0, help="stop timing an arm after this much")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--topk-max-log2", type=int, default=24,
                    help="skip top-k above this size (its exact CPU selection takes seconds)")
    ap.add_argument("--hvd-fusion-threshold", type=int, default=64 * 2**20)
    ap.add_argument("--hvd-cycle-time", type=float, default=1.0, help="milliseconds")
    ap.add_argument("--out", default="results/osu.csv")
    ap.add_argument("--plot", default=None, help="PNG prefix (default: the CSV path without .csv)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--table-sizes", default=None, help="log2 sizes for the markdown table (default: the largest)")
    ap.add_argument("--report", default=None,
                    help="no measuring: merge these CSVs (comma-separated) into --out, plot, print the table")
    args = ap.parse_args(argv)
    table_sizes = [int(v) for v in args.table_sizes.split(",")] if args.table_sizes else None
    if args.report:
        results = []
        for path in args.report.split(","):
            with open(path) as fh:
                results += list(csv.DictReader(fh))
        write_rows(results, args.out)
        print(markdown_table(results, table_sizes))
        print(f"wrote {args.out}")
        if not args.no_plot:
            for path in plot(results, args.plot or os.path.splitext(args.out)[0]):
                print(f"wrote {path}")
        return
    global MPI
    from mpi4py import MPI

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {list(ALL_METHODS)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if any(d not in ("float32", "float16") for d in dtypes):
        ap.error("--dtypes: float32 and/or float16")
    ratios = [float(r) for r in args.ratios.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]

    world = MPI.COMM_WORLD
    P = world.size
    hvd = torch = None
    hvd_env = {"HOROVOD_FUSION_THRESHOLD": str(args.hvd_fusion_threshold),
               "HOROVOD_CYCLE_TIME": f"{args.hvd_cycle_time:g}", "HOROVOD_AUTOTUNE": "0"}
    if any(m.startswith("hvd") for m in methods):
        os.environ.update(hvd_env)  # before hvd.init(): identical for every Horovod arm
        import torch
        import horovod.torch as hvd

        torch.set_num_threads(1)
        hvd.init()
        assert hvd.size() == P, "Horovod and MPI disagree on the number of ranks"
    transport = sc.MPITransport()
    f16op = MPI.Op.Create(lambda i, o, dt: np.add(np.frombuffer(o, np.float16), np.frombuffer(i, np.float16),
                                                  out=np.frombuffer(o, np.float16)), commute=True)
    runner = Runner(world, args)
    rng = np.random.default_rng(1000 + world.rank)
    results = []

    def record(n, method, ratio, vd, lat, payload, wire, lasts=(), extra=None):
        row = {
            "ranks": P, "log2": int(round(math.log2(n))), "elements": n, "method": method, "ratio": ratio,
            "payload_dtype": vd, "mask_block": args.block if method == "masked" else "", "iters": len(lat),
            "lat_median_s": statistics.median(lat), "lat_p25_s": pct(lat, 25), "lat_p75_s": pct(lat, 75),
            "lat_min_s": min(lat), "lat_max_s": max(lat),
            "payload_bytes": payload, "wire_bytes": wire, "dense_bytes": 4 * n,
        }
        med = row["lat_median_s"]
        row["algbw_GBps"] = 4 * n / med / 1e9
        row["busbw_GBps"] = wire / med / 1e9
        enc = dec = com = float("nan")
        if lasts:
            enc = statistics.median(t.encode_s for t in lasts)
            dec = statistics.median(t.decode_s for t in lasts)
            com = statistics.median(t.comm_s for t in lasts)
        row.update({"encode_s": enc, "comm_s": com, "decode_s": dec})
        dec_bytes = payload * (P if method == "topk" else 1)
        row["encode_in_GBps"] = 4 * n / enc / 1e9 if enc > 0 else float("nan")
        row["encode_out_GBps"] = payload / enc / 1e9 if enc > 0 else float("nan")
        row["decode_GBps"] = dec_bytes / dec / 1e9 if dec > 0 else float("nan")
        row.update(extra or {})
        row.update({k.lower(): v for k, v in hvd_env.items()})
        results.append(row)
        return row

    for lg in sizes:
        n = 2**lg
        layout = make_layout(n)
        x0 = rng.standard_normal(n).astype(np.float32)
        # reference: a plain memory copy of the dense buffer
        dst = np.empty_like(x0)
        np.copyto(dst, x0)
        reps = max(3, min(50, 2**26 // n))
        t0 = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst, x0)
        copy_gbps = 4 * n * reps / (time.perf_counter() - t0) / 1e9
        extra = {"copy_GBps": copy_gbps}
        del dst
        size_rows = []

        # ---- dense MPI (raw mpi4py)
        if "mpi" in methods:
            for vd in dtypes:
                buf = x0.astype(vd)
                work = np.empty_like(buf)
                if vd == "float32":
                    spec, op = [work, MPI.FLOAT], MPI.SUM
                else:
                    spec, op = [work.view(np.uint16), MPI.UINT16_T], f16op

                def fn(i, buf=buf, work=work, spec=spec, op=op):
                    work[...] = buf  # fresh input each time (an allreduce in place would overflow)
                    world.Allreduce(MPI.IN_PLACE, spec, op=op)

                lat, _ = runner.run(fn)
                pay = n * np.dtype(vd).itemsize
                size_rows.append(record(n, "mpi", 1.0, vd, lat, pay, sc.wire.stats.allreduce_wire(pay, P), extra=extra))
                del buf, work

        # ---- dense Horovod, fp32 and fp16 compression
        for m in ("hvd", "hvd_fp16"):
            if m not in methods:
                continue
            t = torch.from_numpy(x0)
            comp = hvd.Compression.fp16 if m == "hvd_fp16" else hvd.Compression.none
            name = f"osu.{m}.{lg}"

            def fn(i, t=t, comp=comp, name=name):
                hvd.allreduce(t, op=hvd.Average, compression=comp, name=name)

            lat, _ = runner.run(fn)
            pay = n * (2 if m == "hvd_fp16" else 4)
            size_rows.append(record(n, m, 1.0, "float16" if m == "hvd_fp16" else "float32", lat, pay,
                                    sc.wire.stats.allreduce_wire(pay, P), extra=extra))

        # ---- the core's masked allreduce and top-k allgather
        for m in ("masked", "topk"):
            if m not in methods or (m == "topk" and lg > args.topk_max_log2):
                continue
            for ratio in ratios:
                for vd in dtypes:
                    comm = sc.Communicator(transport, layout, ratio=ratio, mask="cyclic", value_dtype=vd, seed=7,
                                           block=args.block if m == "masked" else 1)
                    x = x0.copy()
                    if m == "masked":
                        fn = (lambda i, comm=comm, x=x: comm.masked_allreduce(x, i))
                    else:
                        fn = (lambda i, comm=comm, x=x: comm.sparse_allgather(x))
                    lat, lasts = runner.run(fn, after=lambda comm=comm: comm.stats.last)
                    last = lasts[-1]
                    size_rows.append(record(n, m, ratio, vd, lat, last.payload_bytes, last.wire_bytes, lasts, extra))
                    del comm, x

        base = next((r for r in size_rows if r["method"] == "mpi" and r["payload_dtype"] == "float32"), None)
        for r in size_rows:
            r["payload_vs_dense"] = r["payload_bytes"] / (4 * n)
            r["time_vs_dense"] = r["lat_median_s"] / base["lat_median_s"] if base else float("nan")
        if world.rank == 0:
            write_rows(results, args.out)  # after every size: a partial run leaves its rows
            print(f"[osu] P={P} 2^{lg}: {len(size_rows)} arms done", file=sys.stderr, flush=True)

    if world.rank != 0:
        return
    print(markdown_table(results, table_sizes))
    print(f"wrote {args.out}")
    if not args.no_plot:
        prefix = args.plot or os.path.splitext(args.out)[0]
        for path in plot(results, prefix):
            print(f"wrote {path}")


def label(r):
    if r["method"] in ("mpi", "hvd", "hvd_fp16"):
        return {"mpi": "MPI allreduce", "hvd": "Horovod allreduce", "hvd_fp16": "Horovod fp16"}[r["method"]] + (
            " fp16" if r["method"] == "mpi" and r["payload_dtype"] == "float16" else "")
    runs = str(r.get("mask_block", "") or "1")
    kind = "masked allreduce" + (f" (runs of {runs})" if runs != "1" else "") if r["method"] == "masked" else "top-k allgather"
    return f"{kind} {'fp16' if r['payload_dtype'] == 'float16' else 'fp32'} k={float(r['ratio']):g}"


def fmt_ms(s):
    return f"{s * 1e3:.3g}"


def markdown_table(rows, sizes=None):
    """Summary per rank count at the given log2 sizes (default: the largest size)."""
    out = []
    for P, lg in [(P, lg) for P in sorted({int(r["ranks"]) for r in rows})
                  for lg in (sizes or [max(int(r["log2"]) for r in rows if int(r["ranks"]) == P)])]:
        sub = [r for r in rows if int(r["ranks"]) == P and int(r["log2"]) == lg]
        if not sub:
            continue
        out.append(f"\n{P} ranks, 2^{lg} elements ({4 * 2**lg / 2**20:g} MiB fp32); latency = median over "
                   f"iterations of the slowest rank, [p25, p75]\n")
        out.append("| method | payload / dense | wire bytes | latency ms [p25, p75] | time / dense | algbw GB/s "
                   "| encode GB/s in / out | decode GB/s |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in sub:
            enc = float(r["encode_in_GBps"])
            enc_out = float(r["encode_out_GBps"])
            dec = float(r["decode_GBps"])
            out.append(
                f"| {label(r)} | {float(r['payload_vs_dense']):.4f} | {float(r['wire_bytes']) / 1e6:.3f} MB | "
                f"{fmt_ms(float(r['lat_median_s']))} [{fmt_ms(float(r['lat_p25_s']))}, {fmt_ms(float(r['lat_p75_s']))}] | "
                f"{float(r['time_vs_dense']):.2f} | {float(r['algbw_GBps']):.3f} | "
                f"{'-' if math.isnan(enc) else f'{enc:.2f} / {enc_out:.3f}'} | {'-' if math.isnan(dec) else f'{dec:.2f}'} |")
    return "\n".join(out)


def plot(rows, prefix):
    """Latency vs size (one panel per ratio, one figure per rank count) and payload/time ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for P in sorted({int(r["ranks"]) for r in rows}):
        sub = [r for r in rows if int(r["ranks"]) == P]
        ratios = sorted({float(r["ratio"]) for r in sub if r["method"] in ("masked", "topk")}, reverse=True) or [1.0]
        fig, axes = plt.subplots(1, len(ratios), figsize=(4.2 * len(ratios), 3.8), sharey=True, squeeze=False)
        for ax, k in zip(axes[0], ratios):
            groups = {}
            for r in sub:
                if r["method"] in ("masked", "topk") and float(r["ratio"]) != k:
                    continue
                groups.setdefault(label(r), []).append(r)
            for name, g in groups.items():
                g.sort(key=lambda r: int(r["elements"]))
                dense = r_is_dense = g[0]["method"] in ("mpi", "hvd", "hvd_fp16")
                ax.plot([int(r["elements"]) for r in g], [float(r["lat_median_s"]) * 1e3 for r in g],
                        ("--" if r_is_dense else "-") + ("s" if "fp16" in name else "o"), ms=3, label=name,
                        alpha=0.7 if dense else 1.0)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"k = {k:g}")
            ax.set_xlabel("elements (fp32 buffer)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel("latency, median (ms)")
        fig.suptitle(f"slamb_comm OSU-style benchmark, {P} ranks (one 2-core host, shared memory)", fontsize=9)
        fig.tight_layout()
        path = f"{prefix}_latency_p{P}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)

    # payload / dense and time / dense at the largest size, per method, vs ratio
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for P in sorted({int(r["ranks"]) for r in rows}):
        sub = [r for r in rows if int(r["ranks"]) == P]
        for m in ("masked", "topk"):
            if not any(r["method"] == m for r in sub):
                continue
            lg = max(int(r["log2"]) for r in sub if r["method"] == m)  # each method at its largest size
            for vd in ("float32", "float16"):
                g = sorted((r for r in sub if r["method"] == m and r["payload_dtype"] == vd and int(r["log2"]) == lg),
                           key=lambda r: float(r["ratio"]))
                if not g:
                    continue
                name = f"{'masked' if m == 'masked' else 'top-k'} {vd[5:] and 'fp' + vd[5:]} P={P}"
                ks = [float(r["ratio"]) for r in g]
                a1.plot(ks, [float(r["payload_vs_dense"]) for r in g], "-o" if m == "masked" else "--s", ms=3,
                        label=name)
                a2.plot(ks, [float(r["time_vs_dense"]) for r in g], "-o" if m == "masked" else "--s", ms=3,
                        label=f"{name} (2^{lg})")
    for ax, yl in ((a1, "payload / dense fp32 payload"), (a2, "latency / dense MPI latency")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("ratio k")
        ax.set_ylabel(yl)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("bytes per rank handed to the collective, and time, relative to dense (same run)", fontsize=9)
    fig.tight_layout()
    path = f"{prefix}_ratios.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
    return paths


if __name__ == "__main__":
    main()
