# python3 benchmarks/host_overhead.py --out benchmarks/results/host_overhead.csv     (no GPU needed, ~1 minute)
"""The host's work per optimizer step on the GPU path, and how it grows with the number of tensors.

A GPU step's kernels do not depend on the number of tensors (benchmarks/launches.py), but the
Python around them may: ``SLAMB.step`` checks every parameter (shape, dtype, a changed or
replaced ``.grad``) and points the torch state at the core's buffers. This times that host work
without a GPU: ``SLAMB(fused=True)`` runs its GPU code path on the strict CuPy double
(tests/strict_cupy.py, the parameters shared with torch), and the time spent inside the kernels,
which the double executes on the CPU, is measured and taken out (``slamb_comm.kernels.launch``
timed around each call). The baseline is ``torch.optim.AdamW(fused=True)`` on the same CPU
tensors, whose own host work (its lists of tensors, one ``_fused_adamw_`` call) is also per tensor.

Tensors of ``--elements`` float32 elements each (256: the kernels' share is small), at 10, 100
and 1,000 tensors; per arm the median of ``--steps`` steps after 12 warm-up steps, arms
interleaved, ``--repeats`` times (median and range over repeats). Reported: milliseconds per step
and microseconds per added tensor (the slope from 100 to 1,000 tensors).
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from csvout import write_rows  # noqa: E402


def params(n, elements, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(elements, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(elements, generator=g) * 1e-3
    return ps


class KernelClock:
    """Seconds spent inside ``slamb_comm.kernels.launch`` (the double runs the kernels on the CPU)."""

    def __init__(self):
        import slamb_comm.kernels as k

        self.k, self.original, self.seconds = k, k.launch, 0.0

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        k.launch = timed

    def close(self):
        self.k.launch = self.original


def arm(name, n, elements, steps):
    """Median host seconds of one step of arm ``name`` at ``n`` tensors."""
    import torch

    from slamb_comm.adapters.torch import SLAMB

    ps = params(n, elements, seed=n)
    if name == "adamw-fused":
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    else:
        opt = SLAMB(ps, lr=1e-2, ratio=0.1, beta3=0.9, dense_threshold=0, fused=True)
    clock = KernelClock()
    try:
        times = []
        for t in range(12 + steps):
            for p in ps:
                p.grad.mul_(0.999)  # in place, as backward() accumulates into .grad
            clock.seconds = 0.0
            t0 = time.perf_counter()
            opt.step()
            if t >= 12:
                times.append(time.perf_counter() - t0 - clock.seconds)
    finally:
        clock.close()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import strict_cupy
    import torch

    torch.set_num_threads(1)
    arms, counts = ("adamw-fused", "slamb"), (10, 100, 1000)
    got = {(a, n): [] for a in arms for n in counts}
    with strict_cupy.install(), strict_cupy.torch_bridge():
        strict_cupy.Device.current = 0
        for _ in range(args.repeats):
            for n in counts:
                for a in arms:  # interleaved
                    got[a, n].append(arm(a, n, args.elements, args.steps))
    rows = []
    print(f"Host seconds per step outside the kernels, tensors of {args.elements} float32 elements; median "
          f"(range) over {args.repeats} repeats of the median of {args.steps} steps:\n")
    print("| arm | 10 tensors, ms | 100 tensors, ms | 1,000 tensors, ms | per added tensor, us |")
    print("|---|---|---|---|---|")
    for a in arms:
        med = {n: statistics.median(got[a, n]) for n in counts}
        slope = (med[1000] - med[100]) / 900 * 1e6
        cells = [f"{med[n] * 1e3:.3f} ({min(got[a, n]) * 1e3:.3f}-{max(got[a, n]) * 1e3:.3f})" for n in counts]
        print(f"| {a} | " + " | ".join(cells) + f" | {slope:.1f} |")
        rows += [{"arm": a, "tensors": n, "elements": args.elements, "median_s": med[n], "min_s": min(got[a, n]),
                  "max_s": max(got[a, n]), "per_tensor_us": slope} for n in counts]
    ratio = {n: statistics.median(got["slamb", n]) / statistics.median(got["adamw-fused", n]) for n in counts}
    print("\nslamb / adamw-fused: " + ", ".join(f"{n} tensors {r:.2f}" for n, r in ratio.items()))
    if args.out:
        write_rows(rows, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
