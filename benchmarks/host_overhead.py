# python3 benchmarks/host_overhead.py --out benchmarks/results/host_overhead.csv   (no GPU needed, ~2 minutes)
# python3 benchmarks/host_overhead.py --calls                                     (the call counts only, ~20 s)
"""The host's work per optimizer step on the GPU path, and how it grows with the number of tensors.

A GPU step's kernels do not depend on the number of tensors (benchmarks/launches.py), but the
Python around them may: ``SLAMB.step`` checks every parameter (shape, dtype, a changed or
replaced ``.grad``), reads the gradients' addresses and points the torch state at the core's
buffers. This times that host work
without a GPU: ``SLAMB(fused=True)`` runs its GPU code path on the strict CuPy double
(tests/support/strict_cupy.py, the parameters shared with torch), and the time spent inside the kernels,
which the double executes on the CPU, is measured and taken out (``slamb_comm.device.kernels.launch``
timed around each call). The baseline is ``torch.optim.AdamW(fused=True)`` on the same CPU
tensors, whose own host work (its lists of tensors, one ``_fused_adamw_`` call) is also per tensor.

Tensors of ``--elements`` float32 elements each (256: the kernels' share is small), at 10, 100
and 1,000 tensors, gradients written in place and new tensors every step (below); per arm the
median of ``--steps`` steps after 12 warm-up steps, arms interleaved, ``--repeats`` times (median
and range over repeats). Reported: milliseconds per step and microseconds per added tensor (the
slope from 100 to 1,000 tensors; its range: the slopes of the repeats). Then the call counts.

``--calls`` counts only, no timing (a count does not depend on the machine's load): cProfile's
``ncalls`` (Python functions, and builtin and C methods called from Python; what C code calls
itself, as ``map`` does, is not counted) per step at 100 and 1,000 tensors, for both arms and two
ways of handing in gradients: written in place (as ``backward()`` accumulates into ``.grad``) and
new tensors every step (``zero_grad()``'s default ``set_to_none=True`` before ``backward()``).
Reported: calls per step, calls per added tensor (the slope) in all and by where the called code
lives (``adapters/``, ``slamb_comm/``, the strict double, torch, builtins), and the functions
whose count grows with the tensors.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:  # for tests.support.strict_cupy, the strict CuPy double
    sys.path.append(os.path.dirname(HERE))
from csvout import write_rows  # noqa: E402


def params(n, elements, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(elements, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(elements, generator=g) * 1e-3
    return ps


class KernelClock:
    """Seconds spent inside ``slamb_comm.device.kernels.launch`` (the double runs the kernels on the CPU)."""

    def __init__(self):
        import slamb_comm.device.kernels as k

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


def optimizer(name, ps):
    """Arm ``name``'s optimizer over ``ps``."""
    import torch

    from slamb_comm.adapters.torch import SLAMB

    if name == "adamw-fused":
        return torch.optim.AdamW(ps, lr=1e-3, fused=True)
    return SLAMB(ps, lr=1e-2, ratio=0.1, beta3=0.9, dense_threshold=0, fused=True)


GRADS = ("in place", "new")  # .grad written in place each step, or a new tensor each step


def next_gradients(ps, grads):
    """The next step's gradients: written in place (as ``backward()`` accumulates into ``.grad``),
    or new tensors (as after ``zero_grad()``'s default ``set_to_none=True``)."""
    for p in ps:
        if grads == "new":
            p.grad = p.grad * 0.999
        else:
            p.grad.mul_(0.999)


def arm(name, grads, n, elements, steps):
    """Median host seconds of one step of arm ``name`` at ``n`` tensors."""
    ps = params(n, elements, seed=n)
    opt = optimizer(name, ps)
    clock = KernelClock()
    try:
        times = []
        for t in range(12 + steps):
            next_gradients(ps, grads)
            clock.seconds = 0.0
            t0 = time.perf_counter()
            opt.step()
            if t >= 12:
                times.append(time.perf_counter() - t0 - clock.seconds)
    finally:
        clock.close()
    return statistics.median(times)


AREAS = ("adapters", "slamb_comm", "double", "torch", "builtins", "other")


def area(path):
    """Where the code of ``path`` lives: this repository's ``adapters/``, ``slamb_comm/`` or
    ``tests/`` (the strict double), torch, or elsewhere (numpy, the standard library); ``~``
    (cProfile's name for builtins and C methods): ``builtins``."""
    if path == "~":
        return "builtins"
    root = os.path.dirname(HERE) + os.sep
    if path.startswith(root):
        parts = path[len(root):].split(os.sep)  # adapters/ is installed as slamb_comm/adapters too
        if "adapters" in parts:
            return "adapters"
        return {"slamb_comm": "slamb_comm", "tests": "double"}.get(parts[0], "other")
    return "torch" if f"{os.sep}torch{os.sep}" in path else "other"


def label(key):
    """A function of a pstats key as ``path:line(name)`` (path from the repository, or from the
    installed package: ``torch/...``, ``numpy/...``), or a builtin's name."""
    path, line, name = key
    if path == "~":
        return name
    root = os.path.dirname(HERE) + os.sep
    short = path[len(root):] if path.startswith(root) else path.split(f"site-packages{os.sep}")[-1]
    return f"{short}:{line}({name})"


def call_counts(name, grads, n, elements, steps):
    """cProfile's ncalls per step of arm ``name`` at ``n`` tensors, over ``steps`` steps after 12
    warm-up steps: (calls by function label, calls by area). A call counts in the area of the code
    called; a builtin's in its caller's (``adapters`` for a ``dict.get`` that the adapter makes),
    ``builtins`` where that is a builtin too. So a torch function called through a builtin
    (``Tensor.__hash__`` under a dict lookup) counts as ``torch``."""
    import cProfile
    import pstats

    ps = params(n, elements, seed=n)
    opt = optimizer(name, ps)
    prof = cProfile.Profile()
    for t in range(12 + steps):
        next_gradients(ps, grads)
        if t >= 12:
            prof.enable()
        opt.step()
        prof.disable()
    by_fn, by_area = {}, dict.fromkeys(AREAS, 0.0)
    for key, (_, nc, _, _, callers) in pstats.Stats(prof).stats.items():
        by_fn[label(key)] = by_fn.get(label(key), 0.0) + nc / steps
        if key[0] != "~" or not callers:
            by_area[area(key[0])] += nc / steps
            continue
        for caller, edge in callers.items():  # a builtin counts where it is called from
            by_area[area(caller[0])] += edge[1] / steps
    return by_fn, by_area


def count_calls(args):
    """The call counts' table (``--calls``): rows for the CSV."""
    counts, rows = (100, 1000), []
    print(f"cProfile calls per step (mean of {args.calls_steps} steps after 12), tensors of {args.elements} "
          "float32 elements:\n")
    print("| arm | gradients | 100 tensors | 1,000 tensors | per added tensor | " + " | ".join(AREAS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(AREAS))
    growing = {}
    for name in ("adamw-fused", "slamb"):
        for grads in GRADS:
            got = {n: call_counts(name, grads, n, args.elements, args.calls_steps) for n in counts}
            total = {n: sum(got[n][1].values()) for n in counts}
            slope = (total[1000] - total[100]) / 900
            per_area = {a: (got[1000][1][a] - got[100][1][a]) / 900 for a in AREAS}
            print(f"| {name} | {grads} | {total[100]:.0f} | {total[1000]:.0f} | {slope:.2f} | "
                  + " | ".join(f"{per_area[a]:.2f}" for a in AREAS) + " |")
            rows += [{"measure": "calls", "arm": name, "grads": grads, "tensors": n, "elements": args.elements,
                      "calls": total[n], "per_tensor_calls": slope, **{f"per_tensor_{a}": per_area[a] for a in AREAS}}
                     for n in counts]
            fns = set(got[100][0]) | set(got[1000][0])
            growing[name, grads] = sorted(((got[1000][0].get(f, 0) - got[100][0].get(f, 0)) / 900, f) for f in fns)
    print("\n(per added tensor: in all, then by the area of the code called; a builtin in its caller's)")
    for (name, grads), fns in growing.items():
        top = [(s, f) for s, f in reversed(fns) if s >= 0.05][:args.calls_top]
        print(f"\n{name}, gradients {grads}: calls per added tensor by function")
        for s, f in top or [(0.0, "(none grows with the tensors)")]:
            print(f"  {s:6.2f}  {f}")
    return rows


def time_steps(args):
    """The timing table: rows for the CSV."""
    arms, counts = [(a, g) for g in GRADS for a in ("adamw-fused", "slamb")], (10, 100, 1000)
    got = {(a, g, n): [] for a, g in arms for n in counts}
    for _ in range(args.repeats):
        for n in counts:
            for a, g in arms:  # interleaved
                got[a, g, n].append(arm(a, g, n, args.elements, args.steps))
    rows = []
    print(f"Host seconds per step outside the kernels, tensors of {args.elements} float32 elements; median "
          f"(range) over {args.repeats} repeats of the median of {args.steps} steps:\n")
    print("| arm | gradients | 10 tensors, ms | 100 tensors, ms | 1,000 tensors, ms | per added tensor, us |")
    print("|---|---|---|---|---|---|")
    for a, g in arms:
        runs = {n: got[a, g, n] for n in counts}
        med = {n: statistics.median(runs[n]) for n in counts}
        slope = (med[1000] - med[100]) / 900 * 1e6
        slopes = [(x1 - x0) / 900 * 1e6 for x0, x1 in zip(runs[100], runs[1000])]  # per repeat
        cells = [f"{med[n] * 1e3:.3f} ({min(runs[n]) * 1e3:.3f}-{max(runs[n]) * 1e3:.3f})" for n in counts]
        print(f"| {a} | {g} | " + " | ".join(cells) + f" | {slope:.1f} ({min(slopes):.1f}-{max(slopes):.1f}) |")
        rows += [{"measure": "host_s", "arm": a, "grads": g, "tensors": n, "elements": args.elements,
                  "median_s": med[n], "min_s": min(runs[n]), "max_s": max(runs[n]), "per_tensor_us": slope,
                  "per_tensor_us_min": min(slopes), "per_tensor_us_max": max(slopes)} for n in counts]
    for g in GRADS:
        ratio = {n: statistics.median(got["slamb", g, n]) / statistics.median(got["adamw-fused", g, n]) for n in counts}
        print(f"\nslamb / adamw-fused, gradients {g}: " + ", ".join(f"{n} tensors {r:.2f}" for n, r in ratio.items()))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", action="store_true", help="only count calls (cProfile), no timing")
    ap.add_argument("--calls-steps", type=int, default=10,
                    help="steps counted (10: one cycle of the mask at ratio 0.1)")
    ap.add_argument("--calls-top", type=int, default=12, help="functions listed per arm")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from tests.support import strict_cupy
    import torch

    torch.set_num_threads(1)
    with strict_cupy.install(), strict_cupy.torch_bridge():
        strict_cupy.Device.current = 0
        rows = [] if args.calls else time_steps(args)
        if not args.calls:
            print()
        rows += count_calls(args)
    if args.out:
        write_rows(rows, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
