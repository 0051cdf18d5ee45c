# python3 benchmarks/gpu_step.py --out benchmarks/results/gpu_step.csv     (needs a CUDA GPU, CuPy and torch)
"""One optimizer step on a real GPU: kernels, copies and time, at 10, 100 and 1,000 tensors.

The strict CuPy double (tests/support/strict_cupy.py) counts the GPU path's device operations on the
CPU; this runs the same steps on a CUDA device and lets the device say what happened.
``torch.profiler`` (CUPTI) records every kernel launched in the process, CuPy's included, and
every memcpy: per step, the kernels, the host-to-device and the device-to-host copies, and with
``--kernels-out`` each kernel's device time per step. Time is the median of ``--reps`` steps,
each timed with CUDA events, arms interleaved. Memory: the device memory the optimizer holds
beyond the parameters and gradients, per parameter, kept between steps and at the peak of a step
(``torch.cuda`` allocator statistics; CuPy allocates through its own pool, so the core's arrays
are counted through ``cupy.get_default_memory_pool``).

Arms, on the same parameters (``--elements`` float32 elements cut into N equal tensors) and
gradients:

* ``adamw-fused``: ``torch.optim.AdamW(fused=True)``, the baseline of the ratios;
* ``slamb``: ``slamb_comm.adapters.torch.SLAMB`` with its default for CUDA parameters (flat
  buffers), ratio 0.1, cyclic mask, float32 payload, one process;
* ``slamb-fp16``: the same with the float16 payload.

``--fresh`` runs each (tensor count, arm) in a fresh process, one after another (the way a
large model is measured: nothing of another arm in the allocator or the caches); the ratio is
then of the medians, without the per-step quartiles. ``--no-profile`` skips ``torch.profiler``
(under Nsight Compute, which cannot share CUPTI with it). ``--device cpu`` (the default where
no GPU is visible) runs the same code on the CPU, for the smoke test: times by ``perf_counter``,
no device memory figures, no kernels.

Writes ``--out`` (CSV; each row names the device and the date) and prints a table.
"""

import argparse
import csv
import datetime
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from csvout import write_rows  # noqa: E402


def device_name(device):
    """The card's name (``torch.cuda.get_device_name``), or the CPU's."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def today():
    return datetime.date.today().isoformat()


def timed_ms(fn, device):
    """Milliseconds that ``fn()`` takes: CUDA events around what it queues on a GPU (waited for),
    ``perf_counter`` on the CPU."""
    import torch

    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(n, elements, device, seed=0):
    """``n`` float32 parameters of ``elements // n`` elements each, and their gradients, drawn on
    ``device`` (no host copy of a model of 512M parameters)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    per = elements // n
    rows = max(1, int(per ** 0.5))
    shape = (rows, per // rows)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g, device=device)) for _ in range(n)]
    grads = [torch.randn(shape, generator=g, device=device) * 1e-2 for _ in range(n)]
    return params, grads


def make(arm, params):
    import torch

    from slamb_comm.adapters.torch import SLAMB

    if arm == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=params[0].is_cuda)
    if arm not in ("slamb", "slamb-fp16"):
        raise SystemExit(f"unknown arm {arm!r}: choose from adamw-fused, slamb, slamb-fp16")
    vd = "float16" if arm == "slamb-fp16" else "float32"
    return SLAMB(params, lr=1e-3, ratio=0.1, value_dtype=vd, beta3=0.9, sync_interval=100, seed=0)


def used():
    """Device bytes in use by torch's allocator and CuPy's pool."""
    import torch

    try:
        import cupy

        pool = cupy.get_default_memory_pool().used_bytes()
    except ImportError:
        pool = 0
    return torch.cuda.memory_allocated() + pool


def step(opt, params, grads):
    for q, g in zip(params, grads):
        q.grad = g
    opt.step()


def memory(arm, params, grads, steps=3):
    """(optimizer, kept, peak): device bytes per parameter of ``arm``'s optimizer beyond params and
    grads, after ``steps`` steps (its warm-up: state, compiled kernels, tables); NaN on the CPU."""
    import torch

    if not params[0].is_cuda:
        opt = make(arm, params)
        for _ in range(steps):
            step(opt, params, grads)
        return opt, math.nan, math.nan
    torch.cuda.synchronize()
    base = used()
    opt = make(arm, params)
    torch.cuda.reset_peak_memory_stats()
    peak = 0
    for _ in range(steps):
        step(opt, params, grads)
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() + used())
    n = sum(q.numel() for q in params)
    return opt, (used() - base) / n, (peak - base) / n


def kind_of(name):
    """'htod', 'dtoh', 'memcpy', 'memset' or 'kernel', from a device event's name."""
    low = name.lower()
    if "memcpy htod" in low or "memcpy h2d" in low:
        return "htod"
    if "memcpy dtoh" in low or "memcpy d2h" in low:
        return "dtoh"
    if "memcpy" in low or "memset" in low:
        return "memcpy" if "memcpy" in low else "memset"
    return "kernel"


def tally(events, steps):
    """Per step, from ``(name, device microseconds)`` of the device events of ``steps`` steps:
    ``(kernels, htod, dtoh, table)``, ``table`` a row per name (kind, calls and device
    microseconds per step, share of the step's device time), longest first."""
    count, by_name = {"kernel": 0, "htod": 0, "dtoh": 0}, {}
    for name, us in events:
        kind = kind_of(name)
        if kind in count:
            count[kind] += 1
        calls, total = by_name.get(name, (0, 0.0))
        by_name[name] = (calls + 1, total + us)
    whole = sum(t for _, t in by_name.values()) or 1.0
    table = [{"kernel": name, "kind": kind_of(name), "calls_per_step": c / steps, "device_us_per_step": t / steps,
              "share": t / whole} for name, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])]
    return count["kernel"] / steps, count["htod"] / steps, count["dtoh"] / steps, table


def profile(opt, params, grads, steps):
    """Kernels, HtoD and DtoH copies per step and the per-kernel table (:func:`tally`), from
    CUPTI's trace of ``steps`` steps (nothing on the CPU: no device events)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    cuda = params[0].is_cuda
    with prof(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        for _ in range(steps):
            step(opt, params, grads)
        synchronize(params[0].device)
    dev = [(e.name, e.time_range.elapsed_us()) for e in p.events()
           if e.device_type == torch.autograd.DeviceType.CUDA]
    return tally(dev, steps)


def measure(n, arms, args, device):
    """Rows of the main CSV and of the kernel table for ``n`` tensors, arms interleaved."""
    import torch

    setups = {}
    for arm in arms:
        params, grads = build(n, args.elements, device)
        opt, kept, peak = memory(arm, params, grads)
        prof = profile(opt, params, grads, args.profile_steps) if args.profile else (math.nan,) * 3 + ([],)
        setups[arm] = (opt, params, grads, prof, kept, peak)
    times = {arm: [] for arm in arms}
    for _ in range(args.reps):  # interleaved
        for arm in arms:
            opt, params, grads = setups[arm][:3]
            for q, g in zip(params, grads):
                q.grad = g
            times[arm].append(timed_ms(opt.step, device))
    base = statistics.median(times[arms[0]])
    rows, kernel_rows, name = [], [], device_name(device)
    for arm in arms:
        (k, h, d, table), kept, peak = setups[arm][3:]
        med = statistics.median(times[arm])
        ratios = sorted(t / s for t, s in zip(times[arm], times[arms[0]]))
        rows.append({"tensors": n, "elements": args.elements, "arm": arm, "kernels_per_step": k,
                     "htod_per_step": h, "dtoh_per_step": d, "step_ms_median": med,
                     "vs_first_arm": med / base, "ratio_p25": ratios[len(ratios) // 4],
                     "ratio_p75": ratios[3 * len(ratios) // 4], "kept_bytes_per_param": kept,
                     "peak_bytes_per_param": peak, "reps": args.reps, "device": name,
                     "torch": torch.__version__, "date": today()})
        kernel_rows += [{"tensors": n, "elements": args.elements, "arm": arm, **r, "device": name, "date": today()}
                        for r in table]
        print(f"{n:5d} tensors  {arm:12s} kernels {k:8.1f}  HtoD {h:5.1f}  DtoH {d:5.1f}  "
              f"step {med:8.3f} ms  x{med / base:.2f} of {arms[0]}  memory {kept:.1f} kept, {peak:.1f} peak "
              "bytes/param", flush=True)
        for r in table[:args.top_kernels]:
            print(f"{'':20s}{r['device_us_per_step']:10.1f} us/step {r['share']:6.1%} {r['calls_per_step']:6.1f} x "
                  f"{r['kernel'][:90]}", flush=True)
    return rows, kernel_rows


def fresh(args, argv):
    """Each (tensor count, arm) in its own process; the ratios of their medians to the first arm's."""
    rows, kernel_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tensors.split(","):
            mine = []
            for arm in args.arms.split(","):
                out, kout = os.path.join(tmp, f"{n}-{arm}.csv"), os.path.join(tmp, f"{n}-{arm}-kernels.csv")
                cmd = [sys.executable, os.path.abspath(__file__), *argv, "--tensors", n, "--arms", arm,
                       "--out", out, "--kernels-out", kout, "--no-fresh"]
                subprocess.run(cmd, check=True)
                mine += read_rows(out)
                kernel_rows += read_rows(kout) if os.path.exists(kout) else []
            base = float(mine[0]["step_ms_median"])
            for r in mine:
                r.update(vs_first_arm=float(r["step_ms_median"]) / base, ratio_p25="", ratio_p75="",
                         fresh_process=1)
            rows += mine
    return rows, kernel_rows


def read_rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", default="10,100,1000")
    ap.add_argument("--elements", type=int, default=64 << 20, help="float32 elements in all (default 64M)")
    ap.add_argument("--arms", default="adamw-fused,slamb,slamb-fp16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where torch sees one)")
    ap.add_argument("--profile-steps", type=int, default=5, help="steps traced by torch.profiler per arm")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="no torch.profiler (under ncu)")
    ap.add_argument("--fresh", action="store_true", help="each (tensor count, arm) in a fresh process")
    ap.add_argument("--no-fresh", dest="fresh", action="store_false", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels-out", default=None, help="CSV of each kernel's device time per step, per arm")
    ap.add_argument("--top-kernels", type=int, default=0, help="print each arm's N longest kernels per step")
    return ap.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.fresh:
        keep = [a for a in argv if a != "--fresh"]
        rows, kernel_rows = fresh(args, keep)
    else:
        import torch

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("gpu_step.py --device cuda: torch sees no CUDA device (use --device cpu)")
        rows, kernel_rows = [], []
        for n in [int(x) for x in args.tensors.split(",")]:
            r, k = measure(n, args.arms.split(","), args, device)
            rows += r
            kernel_rows += k
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        write_rows(rows, args.out)
    if args.kernels_out:
        write_rows(kernel_rows, args.kernels_out)


if __name__ == "__main__":
    main()
