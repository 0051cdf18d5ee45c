# python3 benchmarks/gpu_step.py --out benchmarks/results/gpu_step.csv     (needs a CUDA GPU, CuPy and torch)
"""One optimizer step on a real GPU: kernels, copies and time, at 10, 100 and 1,000 tensors.

The strict CuPy double (tests/strict_cupy.py) counts the GPU path's device operations on the
CPU; this runs the same steps on a CUDA device and lets the device say what happened.
``torch.profiler`` (CUPTI) records every kernel launched in the process, CuPy's included, and
every memcpy: per step, the kernels, the host-to-device and the device-to-host copies. Time is
the median of ``--reps`` steps, each timed with CUDA events, arms interleaved. Memory: the
device memory the optimizer holds beyond the parameters and gradients, per parameter, kept
between steps and at the peak of a step (``torch.cuda`` allocator statistics; CuPy allocates
through its own pool, so the core's arrays are counted through ``cupy.get_default_memory_pool``).

Arms, on the same parameters (``--elements`` float32 elements cut into N equal tensors) and
gradients:

* ``adamw-fused``: ``torch.optim.AdamW(fused=True)``, the baseline of the ratios;
* ``slamb``: ``slamb_comm.adapters.torch.SLAMB`` with its default for CUDA parameters (flat
  buffers), ratio 0.1, cyclic mask, float32 payload, one process;
* ``slamb-fp16``: the same with the float16 payload.

Writes ``--out`` (CSV) and prints a table.
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from csvout import write_rows  # noqa: E402


def build(n, elements, device, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    per = elements // n
    rows = max(1, int(per ** 0.5))
    shape = (rows, per // rows)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for _ in range(n)]
    grads = [torch.randn(shape, generator=g).to(device) * 1e-2 for _ in range(n)]
    return params, grads


def make(arm, params):
    import torch

    from slamb_comm.adapters.torch import SLAMB

    if arm == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
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


def memory(arm, params, grads, steps=3):
    """(kept, peak) device bytes per parameter of ``arm``'s optimizer beyond params and grads."""
    import torch

    torch.cuda.synchronize()
    base = used()
    opt = make(arm, params)
    torch.cuda.reset_peak_memory_stats()
    peak = 0
    for _ in range(steps):
        for q, g in zip(params, grads):
            q.grad = g
        opt.step()
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() + used())
    n = sum(q.numel() for q in params)
    return opt, (used() - base) / n, (peak - base) / n


def profile(opt, params, grads, steps):
    """Kernels, HtoD and DtoH copies per step, from CUPTI's trace of ``steps`` steps."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            for q, g in zip(params, grads):
                q.grad = g
            opt.step()
        torch.cuda.synchronize()
    kernels = htod = dtoh = 0
    for e in p.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "memcpy htod" in name or "memcpy h2d" in name:
            htod += 1
        elif "memcpy dtoh" in name or "memcpy d2h" in name:
            dtoh += 1
        elif "memcpy" in name or "memset" in name:
            continue
        else:
            kernels += 1
    return kernels / steps, htod / steps, dtoh / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", default="10,100,1000")
    ap.add_argument("--elements", type=int, default=64 << 20, help="float32 elements in all (default 64M)")
    ap.add_argument("--arms", default="adamw-fused,slamb,slamb-fp16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_step.py needs a CUDA device")
    arms = args.arms.split(",")
    rows = []
    for n in [int(x) for x in args.tensors.split(",")]:
        setups = {}
        for arm in arms:
            params, grads = build(n, args.elements, "cuda")
            opt, kept, peak = memory(arm, params, grads)  # and the warm-up: state, compiled kernels, tables
            setups[arm] = (opt, params, grads, profile(opt, params, grads, 5), kept, peak)
        times = {arm: [] for arm in arms}
        for _ in range(args.reps):  # interleaved
            for arm in arms:
                opt, params, grads = setups[arm][:3]
                for q, g in zip(params, grads):
                    q.grad = g
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                opt.step()
                b.record()
                b.synchronize()
                times[arm].append(a.elapsed_time(b))
        base = statistics.median(times[arms[0]])
        for arm in arms:
            (k, h, d), kept, peak = setups[arm][3:]
            med = statistics.median(times[arm])
            ratios = sorted(t / s for t, s in zip(times[arm], times[arms[0]]))
            rows.append({"tensors": n, "elements": args.elements, "arm": arm, "kernels_per_step": k,
                         "htod_per_step": h, "dtoh_per_step": d, "step_ms_median": med,
                         "vs_first_arm": med / base, "ratio_p25": ratios[len(ratios) // 4],
                         "ratio_p75": ratios[3 * len(ratios) // 4], "kept_bytes_per_param": kept,
                         "peak_bytes_per_param": peak,
                         "device": torch.cuda.get_device_name(), "torch": torch.__version__})
            print(f"{n:5d} tensors  {arm:12s} kernels {k:8.1f}  HtoD {h:5.1f}  DtoH {d:5.1f}  "
                  f"step {med:8.3f} ms  x{med / base:.2f} of {arms[0]}  memory {kept:.1f} kept, {peak:.1f} peak "
                  "bytes/param", flush=True)
        del setups
        torch.cuda.empty_cache()
    if args.out:
        write_rows(rows, args.out)


if __name__ == "__main__":
    main()
