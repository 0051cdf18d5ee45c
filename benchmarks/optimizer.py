"""Optimizer step: SLAMB's time and peak memory next to torch.optim.AdamW on the same parameters.

    python3 benchmarks/optimizer.py                              # 8 x Linear(1024, 1024), 8.4M: time and memory
    python3 benchmarks/optimizer.py --width 2048 --what memory   # 8 x Linear(2048, 2048), 33.6M: memory
    python3 benchmarks/optimizer.py --device cuda                # on a GPU: against AdamW(fused=True)

Arms (each on the same parameters and gradients, one thread on the CPU):

* ``adamw-foreach``: ``torch.optim.AdamW(foreach=True)`` (the baseline of the ratios);
* ``adamw``: ``torch.optim.AdamW(foreach=False)``, torch's default on the CPU;
* ``adamw-fused``: ``torch.optim.AdamW(fused=True)`` (the baseline on a GPU);
* ``slamb-core``: :class:`slamb_comm.methods.slamb.SlambRule` on NumPy (CuPy on a GPU) views of the
  same tensors, one process, cyclic mask, k = 0.1, the default float32 payload;
* ``slamb-adapter``: ``slamb_comm.adapters.torch.SLAMB`` (the torch optimizer), same options;
* ``slamb-core-fp16``: ``slamb-core`` with the float16 payload (on the CPU NumPy converts
  float16 in software, about 3 ns per element each way, so this arm shows that cost);
* ``slamb-core-p2``, ``onebit-core-p2`` (memory only, not in the default arms): the SLAMB
  rule and the 1-bit LAMB rule (:class:`slamb_comm.methods.onebit_lamb.OneBitLambRule`, ``freeze_step=1``:
  one dense step, then the 1-bit exchange) on 2 MPI ranks (``scripts/mpirun.sh 2``), where
  the exchanges really run; rank 0's peak is reported.

**Time**: the arms step in turn, ``--reps`` times; each arm's median step time is reported,
and its ratio to the baseline: the median, over the repetitions, of the arm's time over the
baseline's in the same repetition (with the 25th and 75th percentiles).

**Memory**: each arm runs in a fresh subprocess that builds the model, its gradients and
the libraries' warm state, then resets the kernel's peak-RSS mark (``/proc/self/clear_refs``),
builds the optimizer, resets the mark again and takes ``--steps`` steps; the peak RSS of the
steps above the baseline (taken before the optimizer was built), divided by the number of
parameters, is the optimizer's peak memory per parameter: its state plus every temporary of a
step (``value``). The peak while the optimizer is built is its own column (``build_peak``): a
one-time transient, such as ``SLAMB``'s flat buffer on a GPU, into which the parameters move (for
a moment both copies exist: 4 bytes per parameter, none after), and the memory held after the
steps is ``kept``. The subprocess runs with a fixed glibc mmap threshold (64 KiB), so that freed
and reused heap memory cannot hide an allocation from the peak. On a GPU: the same three from
``torch.cuda``'s allocator statistics (``max_memory_allocated``, reset after the build) above the
baseline, plus the bytes CuPy's pool holds (``total_bytes()``: what it took from the device, its
high-water mark, since it caches what is freed; ``used_bytes()`` for ``kept``).

Writes ``--out`` (CSV) and prints a table.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ARMS_CPU = ["adamw-foreach", "adamw", "slamb-core", "slamb-adapter", "slamb-core-fp16"]
ARMS_P2 = ["slamb-core-p2", "onebit-core-p2"]  # memory only, on 2 MPI ranks
ARMS_GPU = ["adamw-fused", "adamw-foreach", "slamb-core", "slamb-adapter", "slamb-core-fp16"]
SLAMB_OPTS = dict(ratio=0.1, value_dtype="float32", beta3=0.9, sync_interval=100)
BUCKET_BYTES = [32 << 20]  # the core's Communicator(bucket_bytes=): the periodic sync's scratch


def _threads_one():
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[k] = "1"


def build_model(layers, width, device, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(layers):
        w = torch.randn(width, width, generator=g) / width**0.5
        b = torch.zeros(width)
        for t in (w, b):
            p = torch.nn.Parameter(t.to(device))
            p.grad = (torch.randn(t.shape, generator=g) * 1e-2).to(device)
            params.append(p)
    return params


def build_arm(arm, params):
    """A zero-argument step function for ``arm`` over ``params``."""
    import torch

    if arm.startswith("adamw"):
        kw = {"adamw-foreach": dict(foreach=True), "adamw": dict(foreach=False), "adamw-fused": dict(fused=True)}[arm]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)
        return opt.step
    if arm == "slamb-adapter":
        from slamb_comm.adapters.torch import SLAMB

        opt = SLAMB(params, lr=1e-3, weight_decay=0.01, **SLAMB_OPTS)
        return opt.step
    if arm in ("slamb-core", "slamb-core-fp16", "slamb-core-p2", "onebit-core-p2"):
        import slamb_comm as sc
        from slamb_comm.methods.onebit_lamb import OneBitLambRule
        from slamb_comm.methods.slamb import SlambRule

        x = [sc.arrays.as_array(p.detach()) for p in params]
        g = [sc.arrays.as_array(p.grad) for p in params]
        transport = None
        if arm.endswith("-p2"):
            from mpi4py import MPI

            transport = sc.MPITransport(MPI.COMM_WORLD)
        if arm == "onebit-core-p2":
            rule = OneBitLambRule(sc.Communicator(transport, x), lr=1e-3, weight_decay=0.01, freeze_step=1)
            return lambda: rule.step(x, g)
        vdt = "float16" if arm.endswith("fp16") else SLAMB_OPTS["value_dtype"]
        comm = sc.Communicator(transport, x, ratio=SLAMB_OPTS["ratio"], value_dtype=vdt, seed=1,
                               bucket_bytes=BUCKET_BYTES[0])
        rule = SlambRule(comm, lr=1e-3, weight_decay=0.01, beta3=SLAMB_OPTS["beta3"],
                     sync_interval=SLAMB_OPTS["sync_interval"])
        return lambda: rule.step(x, g)
    raise ValueError(f"unknown arm {arm!r}")


def _sync(device):
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_arms(arms, layers, width, reps, device):
    """Interleaved step times (ms) of every arm on one shared set of parameters."""
    params = build_model(layers, width, device)
    steps = {a: build_arm(a, params) for a in arms}
    for a in arms:  # warm-up: state allocated, caches filled
        for _ in range(2):
            steps[a]()
    _sync(device)
    times = {a: [] for a in arms}
    for _ in range(reps):
        for a in arms:
            t0 = time.perf_counter()
            steps[a]()
            _sync(device)
            times[a].append((time.perf_counter() - t0) * 1e3)
    return times


def _rss_kb(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def memory_of(arm, layers, width, steps, device):
    """Bytes above the baseline (before the optimizer is built) while ``arm`` is built
    (``build_peak``), at the peak of its ``steps`` steps (``peak_bytes``: state and temporaries)
    and after them (``kept_bytes``); run in a fresh process by :func:`main`."""
    import torch  # noqa: F401  (imported before the baseline, so its modules are not counted)

    params = build_model(layers, width, device)
    n = sum(p.numel() for p in params)
    # Warm every library code path on a tiny model first: torch's first optimizer imports
    # ~50 MB of modules, a fixed cost that is not the optimizer's memory per parameter.
    tiny = build_model(1, 8, device, seed=1)
    for a in (ARMS_GPU if device == "cuda" else ARMS_CPU) + ([arm] if arm in ARMS_P2 else []):
        step = build_arm(a, tiny)
        step()
        step()
    del tiny, step
    mark = _cuda_marks() if device == "cuda" else _rss_marks()
    base = mark("reset")
    step = build_arm(arm, params)
    build = mark("peak") - base
    mark("reset")
    for _ in range(steps):
        step()
    peak, kept = mark("peak") - base, mark("now") - base
    return {"arm": arm, "params": n, "peak_bytes": peak, "bytes_per_param": peak / n,
            "build_peak_bytes_per_param": build / n, "kept_bytes_per_param": kept / n}


def _rss_marks():
    """``mark(what)``: the process's resident bytes now (``"now"``, ``"reset"``: and restart the
    peak mark from here) or at their peak since the last reset (``"peak"``)."""
    def mark(what):
        if what == "reset":
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # the peak-RSS mark restarts from here
        return _rss_kb("VmHWM" if what == "peak" else "VmRSS") * 1024

    return mark


def _cuda_marks():
    """As :func:`_rss_marks` on the GPU: torch's allocated bytes (their peak since the reset) plus
    the bytes CuPy's pool holds: at a peak, all it took from the device (it keeps what is freed),
    else those in use."""
    import cupy
    import torch

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()

    def mark(what):
        torch.cuda.synchronize()
        if what == "reset":
            torch.cuda.reset_peak_memory_stats()
        if what == "peak":
            return torch.cuda.max_memory_allocated() + pool.total_bytes()
        return torch.cuda.memory_allocated() + pool.used_bytes()

    return mark


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--what", choices=["time", "memory", "both"], default="both")
    ap.add_argument("--reps", type=int, default=20, help="interleaved timed steps per arm")
    ap.add_argument("--steps", type=int, default=3, help="steps per arm in the memory runs")
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default=None, help="CSV file (default: print only)")
    ap.add_argument("--bucket-bytes", type=int, default=32 << 20,
                    help="the core arms' Communicator(bucket_bytes=): the periodic sync's bucket (32 MiB)")
    ap.add_argument("--_memory-of", dest="memory_of", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    BUCKET_BYTES[0] = args.bucket_bytes
    if args.device == "cpu":
        _threads_one()
    import torch

    torch.set_num_threads(1) if args.device == "cpu" else None
    if args.memory_of:
        out = memory_of(args.memory_of, args.layers, args.width, args.steps, args.device)
        if args.memory_of not in ARMS_P2 or int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
            print(json.dumps(out))
        return
    arms = args.arms.split(",") if args.arms else (ARMS_GPU if args.device == "cuda" else ARMS_CPU)
    base_arm = "adamw-fused" if args.device == "cuda" else "adamw-foreach"
    rows = []
    if args.what in ("memory", "both"):
        mem = {}
        for arm in arms:
            cmd = [sys.executable, os.path.abspath(__file__), "--_memory-of", arm, "--layers", str(args.layers),
                   "--width", str(args.width), "--steps", str(args.steps), "--device", args.device,
                   "--bucket-bytes", str(args.bucket_bytes)]
            if arm in ARMS_P2:
                cmd = ["bash", os.path.join(os.path.dirname(HERE), "scripts", "mpirun.sh"), "2", "600"] + cmd
            # A fixed mmap threshold: every block of 64 KiB or more is mapped when allocated and
            # unmapped when freed, so the peak RSS is the peak of live memory (glibc's default
            # raises the threshold as blocks are freed and then serves new ones from freed heap
            # memory that already counts as resident, which hides allocations from the peak).
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
            mem[arm] = json.loads(out)
        for arm in arms:
            r = mem[arm]
            rows.append({"kind": "memory", "arm": arm, "device": args.device, "params": r["params"],
                         "value": r["bytes_per_param"], "unit": "bytes/param",
                         "ratio": r["bytes_per_param"] / mem[base_arm]["bytes_per_param"] if base_arm in mem else "",
                         "build_peak": r["build_peak_bytes_per_param"], "kept": r["kept_bytes_per_param"]})
            if "adamw" in mem:
                rows[-1]["ratio_to_adamw_default"] = r["bytes_per_param"] / mem["adamw"]["bytes_per_param"]
    if args.what in ("time", "both") and [a for a in arms if a not in ARMS_P2]:
        arms = [a for a in arms if a not in ARMS_P2]  # the 2-rank arms are measured for memory only
        times = time_arms(arms, args.layers, args.width, args.reps, args.device)
        import statistics

        med = {a: statistics.median(v) for a, v in times.items()}
        n = args.layers * (args.width * args.width + args.width)
        for arm in arms:
            # the ratio: median over repetitions of this arm's time over the baseline's in the same
            # repetition (a slow stretch of the machine hits both alike)
            per_rep = sorted(a / b for a, b in zip(times[arm], times[base_arm])) if base_arm in times else []
            q = (lambda f: per_rep[min(len(per_rep) - 1, int(f * len(per_rep)))]) if per_rep else None
            rows.append({"kind": "time", "arm": arm, "device": args.device, "params": n, "value": med[arm],
                         "unit": "ms/step", "ratio": statistics.median(per_rep) if per_rep else "",
                         "ratio_p25": q(0.25) if q else "", "ratio_p75": q(0.75) if q else "",
                         "spread": f"{min(times[arm]):.1f}-{max(times[arm]):.1f}"})
    print(f"{'kind':7s} {'arm':16s} {'params':>10s} {'value':>9s} {'unit':12s} ratio to {base_arm}")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] != "" else ""
        if r.get("ratio_p25", "") != "":
            ratio += f"  [p25 {r['ratio_p25']:.2f}, p75 {r['ratio_p75']:.2f}]"
        if r["kind"] == "memory":
            ratio += f"  (build peak {r['build_peak']:.2f}, kept {r['kept']:.2f})"
        print(f"{r['kind']:7s} {r['arm']:16s} {r['params']:10d} {r['value']:9.2f} {r['unit']:12s} {ratio}")
    if args.out:
        from csvout import write_rows

        write_rows(rows, args.out)


if __name__ == "__main__":
    main()
