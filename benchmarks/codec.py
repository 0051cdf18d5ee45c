# python3 benchmarks/codec.py --out results/codec.csv
"""Encode and decode speed of the codecs, one process, against plain baselines in the same run.

Two parts, each timed with cold caches (a 128 MiB buffer is read before every repetition,
so nothing of the data is left in the last-level cache), median and [p25, p75] over
``--repeats`` repetitions after one warm-up:

* **top-k selection** of the k largest magnitudes of n float32 values, exact:
  ``slamb_comm.wire.codecs.topk_indices`` against ``torch.topk(x.abs(), k)`` (if torch is
  installed), ``np.argpartition(|x|, n - k)`` (not sorted, not tie-stable) and the stable
  sort reference ``topk_indices_reference``. The fast one is checked equal to the reference
  on every input before it is timed. Reported: GB/s read (4 n / time) and the ratio to torch.
* **masked gather and scatter** of the cyclic mask's M_t (a ``ratio`` fraction of n float32,
  ``Selection.take`` into the payload and ``Selection.put`` back), for the element mask
  (``block=1``, docs/algorithm.md) and masks of whole runs of ``block`` elements
  (``Communicator(block=...)``), against ``np.copyto`` of the same number of contiguous
  bytes from a cold source: ``vs_copy`` = time / copy time (1.0 = as fast as a memcpy).
* **fp16** (``--parts fp16``, not in the default run): encode (float32 -> float16) and decode
  (float16 -> float32) of 2^``--fp16-log2`` values, for values that are float16-subnormal
  (|x| ~ 1e-6), normal (standard normal) and zero, by NumPy's cast (``np.copyto`` into a
  preallocated array: astype's conversion without its allocation), the same under
  ``np.errstate(all="ignore")``, ``slamb_comm.arrays.cast_into`` with torch hidden from
  ``sys.modules`` (its NumPy path) and with torch loaded (its torch path), and torch's
  ``Tensor.copy_`` (``--torch-threads`` threads, 1 by default like the rest). Every arm is
  checked bit for bit against NumPy's cast before it is timed; the arms and the two memcpy
  baselines (``np.copyto`` of the float32 and of the float16 array) are interleaved in every
  repetition. Reported: time / memcpy of the source bytes (the issue's figure: <= 4, i.e. at
  least 25% of a memcpy's speed) and time / memcpy of the destination bytes.

Writes a CSV, a PNG next to it (unless ``--no-plot``) and prints markdown tables.
"""

import argparse
import contextlib
import os
import sys
import time

import numpy as np

from csvout import write_rows
from slamb_comm.arrays import cast_into
from slamb_comm.wire.codecs import topk_indices, topk_indices_reference
from slamb_comm.wire.layout import Layout
from slamb_comm.wire.masks import CyclicMask

try:
    import torch
except ImportError:  # the core does not need torch; its column is then left out
    torch = None

_FLUSH = np.ones(32 * 2**20, np.float32)  # 128 MiB


def timed(fn, repeats):
    """Median, p25, p75 seconds of ``fn()`` with a cold cache before each call (one warm-up)."""
    fn()
    ts = []
    for _ in range(repeats):
        _FLUSH.sum()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return np.median(ts), np.percentile(ts, 25), np.percentile(ts, 75)


def bench_topk(n, ratio, repeats, rng):
    x = rng.standard_normal(n).astype(np.float32)
    k = max(1, int(round(ratio * n)))
    if not np.array_equal(topk_indices(x, k), topk_indices_reference(x, k)):
        raise AssertionError(f"topk_indices differs from the reference at n={n}, k={k}")
    arms = {"fast": lambda: topk_indices(x, k),
            "argpartition": lambda: np.argpartition(np.abs(x), n - k)[n - k:],
            "sort_reference": lambda: topk_indices_reference(x, k)}
    if torch is not None:
        tx = torch.from_numpy(x)
        arms["torch.topk"] = lambda: torch.topk(tx.abs(), k, sorted=False)
    rows = []
    for name, fn in arms.items():
        med, p25, p75 = timed(fn, repeats if name != "sort_reference" else max(1, repeats // 5))
        rows.append({"part": "topk", "method": name, "elements": n, "ratio": ratio, "block": "",
                     "seconds": med, "p25": p25, "p75": p75, "GBps": 4 * n / med / 1e9})
    base = next((r["seconds"] for r in rows if r["method"] == "torch.topk"), None)
    for r in rows:
        r["vs_baseline"] = r["seconds"] / base if base else ""
    return rows


def bench_gather(n, ratio, blocks, repeats, rng):
    x = rng.standard_normal(n).astype(np.float32)
    lay = Layout([(n // 1024, 1024)], "float32", dense_threshold=0)
    rows = []
    for block in blocks:
        sel = CyclicMask(lay, ratio, seed=1, block=block).select(1)
        m = sel.size
        out, vals = np.empty(m, np.float32), rng.standard_normal(m).astype(np.float32)
        off = (n - m) // 2
        dst = np.empty(m, np.float32)
        copy, _, _ = timed(lambda: np.copyto(dst, x[off : off + m]), repeats)
        for op, fn in (("gather", lambda: sel.take(x, out=out)), ("scatter", lambda: sel.put(x, vals))):
            med, p25, p75 = timed(fn, repeats)
            rows.append({"part": "mask", "method": op, "elements": n, "ratio": ratio, "block": block,
                         "seconds": med, "p25": p25, "p75": p75, "GBps": 4 * m / med / 1e9,
                         "vs_baseline": med / copy, "copy_seconds": copy})
    return rows


@contextlib.contextmanager
def torch_hidden():
    """As if torch were not loaded: ``cast_into`` looks it up in ``sys.modules`` on every call."""
    saved = sys.modules.get("torch")
    sys.modules["torch"] = None
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved


def _numpy_cast(out, x):
    np.copyto(out, x, casting="unsafe")


def _numpy_cast_quiet(out, x):
    with np.errstate(all="ignore"):
        np.copyto(out, x, casting="unsafe")


def _cast_no_torch(out, x):
    with torch_hidden():
        cast_into(out, x)


def bench_fp16(lg, repeats, rng, torch_threads):
    """Encode and decode of 2^lg values, three value ranges, every arm interleaved with the two
    memcpy baselines in each repetition (cold caches before every call)."""
    n = 2**lg
    values = {"subnormal": 1e-6 * rng.standard_normal(n), "normal": rng.standard_normal(n), "zero": np.zeros(n)}
    f32, f16 = np.empty(n, np.float32), np.empty(n, np.float16)
    arms = {"numpy astype": _numpy_cast, "numpy astype, errstate(all=ignore)": _numpy_cast_quiet,
            "cast_into, no torch": _cast_no_torch}
    if torch is not None:
        arms["cast_into, torch loaded"] = cast_into
        arms["torch copy_"] = lambda out, x: torch.from_numpy(out).copy_(torch.from_numpy(x))
    slow = {"numpy astype", "numpy astype, errstate(all=ignore)"}  # seconds per call for subnormals
    jobs = {}  # (op, values, method) -> (out, x)
    for vname, v in values.items():
        x32 = v.astype(np.float32)
        with np.errstate(all="ignore"):
            x16 = x32.astype(np.float16)
        for op, (out, src, want) in {"encode": (f16, x32, x16), "decode": (f32, x16, x16.astype(np.float32))}.items():
            for method, fn in arms.items():
                out.fill(7)
                fn(out, src)
                if not np.array_equal(out.view(np.uint8), want.view(np.uint8)):
                    raise AssertionError(f"{method} {op} of {vname} values differs from NumPy's cast")
                jobs[(op, vname, method)] = (fn, out, src)
    base = {"memcpy float32": (f32, np.ones(n, np.float32)), "memcpy float16": (f16, np.ones(n, np.float16))}
    times = {k: [] for k in list(base) + list(jobs)}
    threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(torch_threads)
    try:
        for _ in range(1 + repeats):  # the first round is the warm-up
            for k, (dst, src) in base.items():
                _FLUSH.sum()
                t0 = time.perf_counter()
                np.copyto(dst, src)
                times[k].append(time.perf_counter() - t0)
            for k, (fn, out, src) in jobs.items():
                if k[2] in slow and k[1] == "subnormal" and len(times[k]) >= 1 + max(2, repeats // 5):
                    continue
                _FLUSH.sum()
                t0 = time.perf_counter()
                fn(out, src)
                times[k].append(time.perf_counter() - t0)
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    stat = {k: (np.median(t[1:]), np.percentile(t[1:], 25), np.percentile(t[1:], 75)) for k, t in times.items()}
    m32, m16 = stat["memcpy float32"][0], stat["memcpy float16"][0]
    rows = []
    for k, mem in (("memcpy float32", m32), ("memcpy float16", m16)):
        med, p25, p75 = stat[k]
        rows.append({"part": "fp16", "method": k, "elements": n, "ratio": "", "block": "", "seconds": med,
                     "p25": p25, "p75": p75, "GBps": n * (4 if "32" in k else 2) / med / 1e9, "op": "copy",
                     "values": "", "repeats": len(times[k]) - 1, "torch_threads": torch_threads})
    for op, vname, method in jobs:
        med, p25, p75 = stat[(op, vname, method)]
        src_copy, dst_copy = (m32, m16) if op == "encode" else (m16, m32)
        rows.append({"part": "fp16", "method": method, "elements": n, "ratio": "", "block": "", "seconds": med,
                     "p25": p25, "p75": p75, "GBps": n * (4 if op == "encode" else 2) / med / 1e9, "op": op,
                     "values": vname, "repeats": len(times[(op, vname, method)]) - 1,
                     "torch_threads": torch_threads if "torch" in method else "",
                     "vs_baseline": med / src_copy, "vs_dst_copy": med / dst_copy, "copy_seconds": src_copy})
    return rows


def markdown(rows):
    lines = []
    topk = [r for r in rows if r["part"] == "topk"]
    if topk:
        lines += ["| n | k / n | method | ms [p25, p75] | GB/s read | time / torch.topk |", "|---|---|---|---|---|---|"]
        for r in topk:
            rel = f"{r['vs_baseline']:.3f}" if r["vs_baseline"] != "" else "-"
            lines.append(f"| 2^{int(np.log2(r['elements']))} | {r['ratio']:g} | {r['method']} | "
                         f"{1e3 * r['seconds']:.2f} [{1e3 * r['p25']:.2f}, {1e3 * r['p75']:.2f}] | "
                         f"{r['GBps']:.2f} | {rel} |")
        lines.append("")
    mask = [r for r in rows if r["part"] == "mask"]
    if mask:
        lines += ["| n | k | block | memcpy ms | gather ms | gather / memcpy | scatter ms | scatter / memcpy |",
                  "|---|---|---|---|---|---|---|---|"]
        for g in (r for r in mask if r["method"] == "gather"):
            s = next(r for r in mask if r["method"] == "scatter" and r["elements"] == g["elements"]
                     and r["ratio"] == g["ratio"] and r["block"] == g["block"])
            lines.append(f"| 2^{int(np.log2(g['elements']))} | {g['ratio']:g} | {g['block']} | "
                         f"{1e3 * g['copy_seconds']:.3f} | {1e3 * g['seconds']:.3f} | {g['vs_baseline']:.2f} | "
                         f"{1e3 * s['seconds']:.3f} | {s['vs_baseline']:.2f} |")
        lines.append("")
    fp16 = [r for r in rows if r["part"] == "fp16"]
    if fp16:
        copies = [r for r in fp16 if r["op"] == "copy"]
        lines.append("memcpy (np.copyto, cold source): " + "; ".join(
            f"{r['method']} {1e3 * r['seconds']:.2f} ms [{1e3 * r['p25']:.2f}, {1e3 * r['p75']:.2f}]" for r in copies)
            + f"; n = 2^{int(np.log2(fp16[0]['elements']))}")
        lines += ["", ("| op | values | method | ms [p25, p75] | time / memcpy of source | time / memcpy of destination "
                       "| >= 25% of memcpy (source) |"), "|---|---|---|---|---|---|---|"]
        for r in (r for r in fp16 if r["op"] != "copy"):
            lines.append(f"| {r['op']} | {r['values']} | {r['method']} | {1e3 * r['seconds']:.2f} "
                         f"[{1e3 * r['p25']:.2f}, {1e3 * r['p75']:.2f}] | {r['vs_baseline']:.2f} | "
                         f"{r['vs_dst_copy']:.2f} | {'yes' if r['vs_baseline'] <= 4 else 'no'} |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp16 = [r for r in rows if r["part"] == "fp16" and r["op"] != "copy"]
    if fp16:
        fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4))
        keys = sorted({(r["op"], r["values"]) for r in fp16})
        methods = list(dict.fromkeys(r["method"] for r in fp16))
        w = 0.8 / len(methods)
        for j, method in enumerate(methods):
            ys = [next((r["vs_baseline"] for r in fp16 if (r["op"], r["values"], r["method"]) == (*k, method)), np.nan)
                  for k in keys]
            c.bar(np.arange(len(keys)) + j * w, ys, w, label=method)
        c.axhline(4.0, color="grey", ls="--", lw=1)
        c.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, [f"{op}\n{v}" for op, v in keys], fontsize=7)
        c.set(yscale="log", ylabel="time / memcpy of the source bytes", title="fp16 casts (dashed: 25% of memcpy)")
        c.legend(fontsize=6)
    else:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    topk = [r for r in rows if r["part"] == "topk"]
    for (method, ratio) in sorted({(r["method"], r["ratio"]) for r in topk}):
        rs = sorted((r for r in topk if r["method"] == method and r["ratio"] == ratio), key=lambda r: r["elements"])
        a.plot([r["elements"] for r in rs], [r["GBps"] for r in rs], marker="o", label=f"{method} k/n={ratio:g}")
    a.set(xscale="log", yscale="log", xlabel="elements", ylabel="GB/s read", title="exact top-k selection")
    a.legend(fontsize=6) if topk else a.set_visible(False)
    mask = [r for r in rows if r["part"] == "mask"]
    for (op, ratio, n) in sorted({(r["method"], r["ratio"], r["elements"]) for r in mask}):
        rs = sorted((r for r in mask if (r["method"], r["ratio"], r["elements"]) == (op, ratio, n)),
                    key=lambda r: r["block"])
        b.plot([r["block"] for r in rs], [r["vs_baseline"] for r in rs], marker="o",
               label=f"{op} k={ratio:g} n=2^{int(np.log2(n))}")
    b.axhline(2.0, color="grey", ls="--", lw=1)
    b.set(xscale="log", yscale="log", xlabel="mask run length (block)", ylabel="time / memcpy of the same bytes",
          title="masked gather / scatter")
    b.legend(fontsize=6) if mask else b.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="20,22,24", help="log2 element counts")
    ap.add_argument("--ratios", default="0.1,0.01,0.001")
    ap.add_argument("--blocks", default="1,16,64,256,1024", help="cyclic mask run lengths")
    ap.add_argument("--parts", default="topk,mask", help="any of topk, mask, fp16")
    ap.add_argument("--fp16-log2", type=int, default=24, help="log2 of the values cast in the fp16 part")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch's threads in the fp16 part")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="results/codec.csv")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    parts = args.parts.split(",")
    blocks = [int(b) for b in args.blocks.split(",")]
    rows = []
    for lg in (int(s) for s in args.sizes.split(",")):
        for ratio in (float(r) for r in args.ratios.split(",")):
            if "topk" in parts:
                rows += bench_topk(2**lg, ratio, args.repeats, rng)
            if "mask" in parts:
                rows += bench_gather(2**lg, ratio, blocks, args.repeats, rng)
    if "fp16" in parts:
        rows += bench_fp16(args.fp16_log2, args.repeats, rng, args.torch_threads)
    write_rows(rows, args.out)
    print(markdown(rows))
    if not args.no_plot:
        png = os.path.splitext(args.out)[0] + ".png"
        plot(rows, png)
        print(f"wrote {args.out} and {png}")
    else:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
