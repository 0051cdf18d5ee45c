# mpirun -np 4 python benchmarks/exchange.py --out results/exchange.csv
# (as root on a 2-core machine: bash scripts/mpirun.sh 4 600 python3 benchmarks/exchange.py)
"""Bytes and time of each exchange of the core against the dense allreduce, in one run.

For each buffer size and ratio: the dense baseline (``Communicator.sync``, a fused
allreduce-mean in fp32), the masked allreduce with the shared cyclic mask, and the top-k
allgather with error feedback, with fp32 and fp16 payloads. Reported per exchange: the
payload and estimated wire bytes (ALGORITHM.md section 4), their ratio to the dense
exchange of the same run, and the median and spread of encode / communicate / decode
times over the timed iterations (after warm-up). Rank 0 writes a CSV and prints a
markdown table.
"""

import argparse
import csv
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import slamb_comm as sc


def bench(comm, method, x, iters, warmup):
    rows = []
    for i in range(warmup + iters):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        if method == "dense":
            comm.sync(x)
        elif method == "masked":
            comm.masked_allreduce(x, i + 1)
        else:
            comm.sparse_allgather(x)
        wall = time.perf_counter() - t0
        if i >= warmup:
            rows.append((wall, comm.stats.last))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,20,22", help="log2 of element counts, comma-separated")
    ap.add_argument("--ratios", default="0.1,0.01")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="results/exchange.csv")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    transport = sc.MPITransport()
    rng = np.random.default_rng(world.rank)
    results = []
    for lg in (int(s) for s in args.sizes.split(",")):
        n = 2**lg
        rows_per_tensor = 1024
        shapes = [(n // rows_per_tensor, rows_per_tensor)] if n >= 2 * rows_per_tensor else [(n // 2, 2)]
        x = rng.standard_normal(n).astype(np.float32)
        arms = [("dense", 1.0, "float32")]
        for r in (float(v) for v in args.ratios.split(",")):
            for vd in ("float32", "float16"):
                arms += [("masked", r, vd), ("topk", r, vd)]
        dense_payload = dense_time = None
        for method, ratio, vd in arms:
            comm = sc.Communicator(transport, sc.Layout(shapes, "float32"), ratio=ratio, value_dtype=vd, seed=1)
            rows = bench(comm, method, x.copy(), args.iters, args.warmup)
            walls = [w for w, _ in rows]
            last = rows[-1][1]
            med = statistics.median(walls)
            if method == "dense":
                dense_payload, dense_time = last.payload_bytes, med
            results.append({
                "ranks": world.size, "elements": n, "method": method, "ratio": ratio, "value_dtype": vd,
                "payload_bytes": last.payload_bytes, "wire_bytes": last.wire_bytes,
                "payload_vs_dense": last.payload_bytes / dense_payload,
                "time_median_s": med, "time_min_s": min(walls), "time_max_s": max(walls),
                "time_vs_dense": med / dense_time,
                "encode_median_s": statistics.median(t.encode_s for _, t in rows),
                "comm_median_s": statistics.median(t.comm_s for _, t in rows),
                "decode_median_s": statistics.median(t.decode_s for _, t in rows),
            })
    if world.rank == 0:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(results[0]))
            w.writeheader()
            w.writerows(results)
        print("| ranks | elements | method | ratio | payload | payload / dense | time / dense |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            label = r["method"] if r["method"] == "dense" else f"{r['method']} {r['value_dtype']}"
            print(f"| {r['ranks']} | 2^{int(np.log2(r['elements']))} | {label} | {r['ratio']} | "
                  f"{r['payload_bytes'] / 1e6:.3f} MB | {r['payload_vs_dense']:.3f} | {r['time_vs_dense']:.2f} |")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
