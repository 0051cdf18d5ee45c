# python3 benchmarks/model.py --osu results/osu_p4.csv --cluster results/cluster.csv --out results/model.csv
"""Analytic step-time model: dense LAMB, a 1-bit-LAMB-like exchange and SLAMB from 8 to 1,024 workers.

Per collective (Rabenseifner / recursive halving-doubling, the large-message algorithm of
MPI and NCCL's tree-ish regimes):

* allreduce of ``b`` bytes on ``P`` workers: ``2 log2(P) alpha + 2 (P-1)/P * b / (eta B)``;
* allgather of ``b`` bytes per worker:      ``log2(P) alpha + (P-1) * b / (eta B)``;

with ``B`` the per-worker link bandwidth (10 or 100 Gbit/s), ``eta`` the fraction of the
line rate a bulk allreduce achieves, and ``alpha`` the per-stage latency. Encode/decode is
a cost per byte moved through memory: ``bytes / (enc_eff * mem_bw)``, where ``enc_eff`` is
the measured encode(+decode) throughput as a fraction of a plain memory copy on this
machine, and ``mem_bw`` the device's memory bandwidth (A100: 1,555 GB/s).

Per step and worker (no overlap of compute and communication -- a conservative bound):

* dense LAMB: compute + allreduce of ``4 N`` bytes (fp32 gradients);
* 1-bit-LAMB-like: compute + allreduce of ``4 N / 4.6`` bytes (the published volume
  reduction of 1-bit LAMB's compression stage; its dense warm-up stage is not modelled)
  + encode/decode streaming the whole ``4 N``-byte buffer twice at ``--onebit-enc-eff``
  (default 0.5, assumed: sequential access) of the memory bandwidth;
* SLAMB (k = 0.1, H = 100, fp16 payload): compute + allreduce of ``2 k N`` bytes + encode
  /decode of the ``k N`` sent elements (gather + scatter: ``k N (4 + 4 + 2)`` bytes) + the
  periodic fp32 parameter sync ``allreduce(4 N) / H``.

Scaling efficiency = compute / step time (weak scaling: a fixed per-worker batch, so
perfect scaling keeps the step time at the compute time).

Compute per step per worker (assumption, stated on the plot): ``6 * params * tokens``
FLOPs on an A100 at ``--mfu`` (default 40%) of its 312 TFLOP/s fp16 peak, for the LAMB
papers' BERT phase-1 global batch of 65,536 sequences x 128 tokens split over the P workers
(strong scaling, gradient accumulation where needed; one exchange per step). At 1,024
workers that is 64 sequences each: 0.13 s for BERT-Large (340M), 1.10 s for BERT-XL (2.8B);
at 8 workers 128x that. ``--per-worker-batch`` switches to weak scaling.

Calibration (``--osu``, ``--cluster``; falls back to stated defaults when absent):

* ``eta``: from the emulated-cluster CSV, the dense allreduce's ideal wire time at the
  emulated link rate divided by its measured communication time (median over the dense
  rows at the slowest emulated rate, where the link and not this 2-core CPU is the limit);
* ``enc_eff``: from the OSU CSV, the masked-allreduce fp16 k=0.1 rows at the largest
  size: bytes moved by encode + decode (``k N (4 + 4 + 2)``) / (encode_s + decode_s),
  divided by the measured copy bandwidth (``copy_GBps``, counted as read + write bytes);
* ``alpha``: not calibrated here (this machine's small-message latency is shared-memory
  polling under heavy oversubscription, milliseconds, not a network's); default 10 us per
  stage, a typical value for an RDMA/RoCE fabric (``--alpha-us``).
"""

import argparse
import csv
import math
import os
import statistics

from csvout import write_rows

MODELS = {"BERT-Large": 340e6, "BERT-XL": 2.8e9}
WORKERS = [8, 16, 32, 64, 128, 256, 512, 1024]
LINKS_GBIT = [10, 100]


def read_csv(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as fh:
        return list(csv.DictReader(fh))


def calibrate(osu_paths, cluster_path, defaults):
    """Return (params dict, list of human-readable calibration notes)."""
    p = dict(defaults)
    notes = []
    rows = []
    for path in osu_paths:
        rows += read_csv(path)
    sel = [r for r in rows if r.get("method") == "masked" and r.get("payload_dtype") == "float16"
           and abs(float(r.get("ratio", 0)) - 0.1) < 1e-9 and r.get("encode_s") not in ("", "nan", None)]
    if sel:
        lg = max(int(r["log2"]) for r in sel)
        sel = [r for r in sel if int(r["log2"]) == lg]
        effs = []
        for r in sel:
            n = int(r["elements"])
            moved = 0.1 * n * (4 + 4 + 2)
            t = float(r["encode_s"]) + float(r["decode_s"])
            copy = float(r["copy_GBps"]) * 2e9  # read + write bytes per second
            effs.append(moved / t / copy)
        p["enc_eff"] = statistics.median(effs)
        notes.append(f"enc_eff = {p['enc_eff']:.3f}: masked allreduce fp16 k=0.1 at 2^{lg} elements "
                     f"(median over {len(sel)} run(s) in {', '.join(osu_paths)}), encode+decode bytes/s over copy bytes/s")
    else:
        notes.append(f"enc_eff = {p['enc_eff']} (default; no OSU CSV)")
    crow = [r for r in read_csv(cluster_path) if r.get("ok") == "1" and r.get("method") == "dense"
            and r.get("link") not in ("none", "local") and r.get("comm_s") not in ("", "nan", None)]
    if crow:  # the slowest emulated link only: there the link, not this 2-core CPU, is the bottleneck
        slow = min(_rate(r["link"]) for r in crow)
        crow = [r for r in crow if _rate(r["link"]) == slow]
        etas = []
        for r in crow:
            bps = _rate(r["link"])
            P = int(r["ranks"])
            wire = 2 * (P - 1) / P * 4 * int(r["elements"])
            etas.append(min(1.0, wire * 8 / bps / float(r["comm_s"])))
        p["eta"] = statistics.median(etas)
        notes.append(f"eta = {p['eta']:.2f}: dense allreduce over the emulated TCP cluster "
                     f"at {crow[0]['link']} (median of {len(crow)} run(s) in {cluster_path}): ideal wire time / measured")
    else:
        notes.append(f"eta = {p['eta']} (default; no cluster CSV)")
    notes.append(f"alpha = {p['alpha_us']} us per stage (assumed, not measured here)")
    return p, notes


def _rate(s):
    s = s.lower()
    for u, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s)


def allreduce(b, P, bw, p):
    return 2 * math.log2(P) * p["alpha_us"] * 1e-6 + 2 * (P - 1) / P * b / (p["eta"] * bw)


def step_times(params, P, link_gbit, p):
    """Per-step seconds for each method: dict method -> (total, compute, comm, encode)."""
    bw = link_gbit * 1e9 / 8
    n = params
    tokens = p["tokens"] if p["per_worker"] else p["global_tokens"] / P
    comp = 6 * params * tokens / (p["mfu"] * p["peak_flops"])
    enc_bw = p["enc_eff"] * p["mem_bw"]
    out = {}
    c = allreduce(4 * n, P, bw, p)
    out["dense LAMB"] = (comp + c, comp, c, 0.0)
    c = allreduce(4 * n / 4.6, P, bw, p)
    e = 2 * 4 * n / (p["onebit_enc_eff"] * p["mem_bw"])  # stream the buffer to compress, write it back decompressed
    out["1-bit-LAMB-like"] = (comp + c + e, comp, c, e)
    k, H = p["ratio"], p["H"]
    c = allreduce(2 * k * n, P, bw, p) + allreduce(4 * n, P, bw, p) / H
    e = k * n * (4 + 4 + 2) / enc_bw
    out["SLAMB"] = (comp + c + e, comp, c, e)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--osu", default="results/osu_p4.csv,results/osu_p2.csv", help="OSU CSV(s), comma-separated")
    ap.add_argument("--cluster", default="results/cluster.csv")
    ap.add_argument("--out", default="results/model.csv")
    ap.add_argument("--png", default=None, help="default: --out with .png")
    ap.add_argument("--alpha-us", type=float, default=10.0)
    ap.add_argument("--eta", type=float, default=0.8, help="default if no cluster CSV")
    ap.add_argument("--enc-eff", type=float, default=0.3, help="default if no OSU CSV")
    ap.add_argument("--onebit-enc-eff", type=float, default=0.5,
                    help="1-bit compression streams the buffer (no random access): fraction of copy bandwidth, assumed")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--global-batch", type=int, default=65536, help="sequences per step, all workers together")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--per-worker-batch", type=int, default=0,
                    help="if > 0: weak scaling, this many sequences per worker per step instead of a fixed global batch")
    args = ap.parse_args(argv)
    defaults = {"alpha_us": args.alpha_us, "eta": args.eta, "enc_eff": args.enc_eff, "mfu": args.mfu,
                "peak_flops": 312e12, "mem_bw": 1555e9, "ratio": 0.1, "H": 100, "onebit_enc_eff": args.onebit_enc_eff,
                "per_worker": args.per_worker_batch > 0, "tokens": args.per_worker_batch * args.seq_len,
                "global_tokens": args.global_batch * args.seq_len}
    osu = [s for s in args.osu.split(",") if s and os.path.exists(s)]
    p, notes = calibrate(osu, args.cluster, defaults)

    rows = []
    for model, n in MODELS.items():
        for link in LINKS_GBIT:
            for P in WORKERS:
                for meth, (tot, comp, comm, enc) in step_times(n, P, link, p).items():
                    rows.append({"model": model, "params": n, "link_gbit": link, "workers": P, "method": meth,
                                 "step_s": tot, "compute_s": comp, "comm_s": comm, "encode_s": enc,
                                 "efficiency": comp / tot})
    write_rows(rows, args.out)
    batch = (f"{args.per_worker_batch} x {args.seq_len} tokens per worker (weak scaling)" if p["per_worker"] else
             f"global batch {args.global_batch} x {args.seq_len} tokens split over P workers (strong scaling)")
    assumptions = [
        f"compute/step = 6 x params x tokens / ({p['mfu']:.0%} of 312 TFLOP/s, A100), {batch}; no comm/compute overlap",
        f"allreduce = 2 log2(P) alpha + 2(P-1)/P bytes/(eta B); alpha = {p['alpha_us']:g} us, eta = {p['eta']:.2f}",
        f"SLAMB encode+decode = 10 kN bytes / ({p['enc_eff']:.3f} x 1555 GB/s), k=0.1, fp16 values + fp32 sync every "
        f"H=100; 1-bit: 4N/4.6 bytes, encode+decode 8N bytes / ({p['onebit_enc_eff']} x 1555 GB/s); dense: fp32 grads",
    ]
    print("Assumptions and calibration:")
    for line in assumptions + notes:
        print(f"- {line}")
    print()
    print("| model | link | workers | dense LAMB step (eff.) | 1-bit-LAMB-like step (eff.) | SLAMB step (eff.) |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        for link in LINKS_GBIT:
            for P in (8, 64, 1024):
                cells = []
                for meth in ("dense LAMB", "1-bit-LAMB-like", "SLAMB"):
                    r = next(r for r in rows if r["model"] == model and r["link_gbit"] == link
                             and r["workers"] == P and r["method"] == meth)
                    cells.append(f"{r['step_s'] * 1e3:.0f} ms ({r['efficiency']:.0%})")
                print(f"| {model} | {link} Gbit/s | {P} | " + " | ".join(cells) + " |")
    print(f"\nwrote {args.out}")
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    plot(rows, png, assumptions + notes)
    print(f"wrote {png}")


def plot(rows, path, notes):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(15, 4.6), sharey=True)
    i = 0
    for model in MODELS:
        for link in LINKS_GBIT:
            ax = axes[i]
            i += 1
            for meth, style in (("dense LAMB", "k--o"), ("1-bit-LAMB-like", "-s"), ("SLAMB", "-^")):
                g = [r for r in rows if r["model"] == model and r["link_gbit"] == link and r["method"] == meth]
                ax.plot([r["workers"] for r in g], [r["efficiency"] for r in g], style, ms=4, label=meth)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{model}, {link} Gbit/s per worker", fontsize=9)
            ax.set_xlabel("workers")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (compute / step)")
    axes[0].legend(fontsize=8)
    fig.suptitle("analytic model (not a measurement): " + notes[0], fontsize=9)
    fig.text(0.01, 0.01, "\n".join(notes[1:]), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.16, 1, 0.95))
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
