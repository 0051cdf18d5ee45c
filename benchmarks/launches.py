"""python3 benchmarks/launches.py --out benchmarks/results/launches.csv

What one step of slamb_comm's GPU path costs on the device, counted on the CPU by the strict
CuPy double (tests/support/strict_cupy.py): device operations (kernel launches), device-memory bytes read
and written, host-to-device copies, host reads, and device memory held beyond the parameters and
gradients (kept between steps and at the peak of the step).

    python3 benchmarks/launches.py --out benchmarks/results/launches.csv   # ~5 minutes on 2 cores
    python3 benchmarks/launches.py --scale 0.01 --what slamb                # quick: 65,536 elements

The double is installed as ``cupy``, so the core takes exactly the code paths it takes on a
GPU. Its docstring defines how each operation is charged: one launch per call of anything that
would launch a kernel (several where CuPy really runs several: CUB's sorts and scans,
``add.reduceat``), the bytes each operation reads and writes in device memory at its real cost,
and the transient buffers it allocates; the device kernels of ``slamb_comm/device/kernels.py`` run
(compiled for the host) as one launch each with the bytes they declare. Nothing is timed.

Layouts: 6,553,600 float32 elements (``--scale`` multiplies this) in 10 tensors of 655,360,
100 of 65,536, and 1,000 of 6,553 (the remainder, 600 elements, in the last one); 2-D shapes
(``(n / 1024, 1024)``, else ``(1, n)``). ``--dense-threshold`` (default 0) is the
communicator's: with the library's default, 9,000, every tensor of the 1,000-tensor layout
would be always dense (exchanged whole) and the three layouts would not do the same work.

Measured, each on the step after ``--warmup`` steps of the same kind (allocations and the
first step's one-time work are not counted):

* ``slamb``: one :meth:`slamb_comm.methods.slamb.SlambRule.step` (ratio 0.1, cyclic mask, lr 1e-3, weight
  decay 0.01, payload ``--dtypes``), with the default ``sync_interval`` (100: a step without
  the periodic parameter sync) and with ``sync_interval=1`` (every step a sync step), on one
  fused buffer (``fused``) and on one array per tensor (``list``); and on a fused buffer in the
  mask's first cycle (``first cycle``: the fourth step) and right after a ratio change
  (``ratio change``: 0.1 to 0.2 after 21 steps, the second step after it);
* ``topk``: one :meth:`Communicator.sparse_allgather` (top-k, ratio 0.01, error feedback);
* ``onebit``: one :meth:`Communicator.onebit_allreduce` (signs and scales);
* ``adapter``: one ``step()`` of the torch optimizer ``SLAMB`` (``--ranks`` 1 only) and of
  ``DistributedOptimizer(SLAMB)`` on a one-process gloo group, with ``fused=True`` (flat
  buffers, the default for CUDA parameters) and ``fused=False`` (tensor by tensor), gradients
  set in place each step. The parameters are CPU tensors, handed to the core as the double's
  arrays sharing their memory (``strict_cupy.torch_bridge``); the operations and bytes are the
  core's plus torch's (``strict_cupy.aten_counter``: each at most one kernel on a GPU, a
  ``_foreach_*`` call one). Memory counts the core's arrays only (torch's own allocations are
  the model's).

At ``--ranks`` 1 (:class:`slamb_comm.LocalTransport`) and 2. One rank does not average
anything: the periodic sync is skipped at P = 1, so a "sync step" is an ordinary step there.
Two ranks are emulated in one process by a twin transport: the other rank sends exactly what
this one does (every sum is twice this rank's values, exact; an allgather or all-to-all hands
back this rank's block twice), and every collective on device buffers counts one launch
(``collective.<name>``) reading and writing its buffer, as an NCCL call does.

Writes ``--out`` (CSV, ``benchmarks/csvout.py``: one row per measurement, with the operations
by name) and prints markdown tables: per step at 10 / 100 / 1,000 tensors the operations, the
bytes per parameter, the memory per parameter, copies and reads; and the dominant operations.
"""

import argparse
import gc
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if ROOT not in sys.path:  # for tests.support.strict_cupy, the strict CuPy double
    sys.path.append(ROOT)

from tests.support import strict_cupy  # noqa: E402
from csvout import write_rows  # noqa: E402

TOTAL = 6_553_600
TENSORS = (10, 100, 1000)
# AdamW(fused=True)'s step reads p, g, m, v and writes p, m, v: 28 bytes per float32 parameter
ADAMW_BYTES = 28


def shapes_of(tensors, total):
    """``tensors`` 2-D shapes of ``total // tensors`` elements, the remainder in the last."""
    n = total // tensors
    sizes = [n] * tensors
    sizes[-1] += total - n * tensors
    return [(s // 1024, 1024) if s % 1024 == 0 else (1, s) for s in sizes]


def _raw(buf):
    return buf._a if isinstance(buf, strict_cupy.ndarray) else buf  # the double's host memory


def _collective(name, buf):
    if isinstance(buf, strict_cupy.ndarray):  # one NCCL call: one launch, reading and writing its buffer
        strict_cupy.launches[f"collective.{name}"] += 1
        strict_cupy.bytes_read[f"collective.{name}"] += buf.nbytes
        strict_cupy.bytes_written[f"collective.{name}"] += buf.nbytes


class TwinTransport:
    """Rank 0 of 2, whose twin sends exactly what this rank sends (see the module docstring)."""

    rank = 0
    size = 2
    name = "twin"

    def allreduce(self, buf):
        _collective("allreduce", buf)
        b = _raw(buf)
        b *= b.dtype.type(2)

    def allgather(self, sendbuf, recvbuf):
        _collective("allgather", recvbuf)
        s, r, n = _raw(sendbuf), _raw(recvbuf), sendbuf.size
        r[:n] = s
        r[n : 2 * n] = s

    def alltoall(self, sendbuf, recvbuf):
        _collective("alltoall", recvbuf)
        s, r, n = _raw(sendbuf), _raw(recvbuf), sendbuf.size // 2
        r[:n] = s[:n]  # rank r's block 0 is this rank's block 0, for both r
        r[n:] = s[:n]

    def broadcast(self, buf, root=0):
        _collective("broadcast", buf)

    def barrier(self):
        pass


def transport(ranks):
    import slamb_comm as sc

    return sc.LocalTransport() if ranks == 1 else TwinTransport()


class Data:
    """Host values for one layout, put on the device (outside the counted blocks) as needed."""

    def __init__(self, shapes, seed=0):
        self.shapes = shapes
        total = sum(int(np.prod(s)) for s in shapes)
        self.flat = (np.random.default_rng(seed).standard_normal(total) * 0.1).astype(np.float32)

    def device(self, scale=1.0):
        cp = sys.modules["cupy"]
        out, o = [], 0
        for s in self.shapes:
            n = int(np.prod(s))
            out.append(cp.asarray((self.flat[o : o + n] * np.float32(scale)).reshape(s)))
            o += n
        return out


class Cost:
    """One measured call: the double's counts (``c``) and the memory held beyond the inputs."""

    def __init__(self, c, n, base):
        self.c, self.n = c, n
        self.kept = (strict_cupy.memory() - base) / n
        self.peak = (strict_cupy.peak() - base) / n


def counted(fn, n, base):
    gc.collect()  # an object of an earlier job must not be freed inside the measurement
    strict_cupy.reset_peak()
    with strict_cupy.counting() as c:
        fn()
    return Cost(c, n, base)


def run_slamb(data, vdt, ranks, H, warmup, dense_threshold, form="fused", when="settled"):
    """``form``: 'fused' (one fused buffer) or 'list' (one array per tensor); ``when``: 'settled'
    (after the mask's first cycle), 'first cycle' (the fourth step), 'ratio change' (the second
    step after a change of the ratio from 0.1 to 0.2)."""
    import slamb_comm as sc
    from slamb_comm.methods.slamb import SlambRule

    cp = sys.modules["cupy"]
    gc.collect()
    x, g = cp.asarray(data.flat), cp.asarray(data.flat * np.float32(0.25))
    lay = sc.Layout(data.shapes, dense_threshold=dense_threshold)
    xs, gs = (x, g) if form == "fused" else (lay.views(x), lay.views(g))
    base = strict_cupy.memory()
    comm = sc.Communicator(transport(ranks), lay, ratio=0.1, mask="cyclic", value_dtype=vdt, seed=1)
    opt = SlambRule(comm, lr=1e-3, weight_decay=0.01, sync_interval=H)
    for t in range({"settled": max(warmup, 21), "first cycle": 3, "ratio change": 21}[when]):
        opt.step(xs, gs)
    if when == "ratio change":
        opt.set_ratio(0.2)
        opt.step(xs, gs)
    return counted(lambda: opt.step(xs, gs), lay.total, base)


def run_topk(data, vdt, ranks, warmup, dense_threshold):
    import slamb_comm as sc

    gc.collect()
    gs = [data.device(0.5 + t) for t in range(warmup)] + [data.device(0.25)]
    base = strict_cupy.memory()
    comm = sc.Communicator(transport(ranks), gs[0], ratio=0.01, value_dtype=vdt, seed=1,
                           dense_threshold=dense_threshold)
    for g in gs[:-1]:
        comm.sparse_allgather(g)
    return counted(lambda: comm.sparse_allgather(gs[-1]), comm.layout.total, base)


def run_onebit(data, vdt, ranks, warmup, dense_threshold):
    import slamb_comm as sc

    gc.collect()
    gs = [data.device(0.5 + t) for t in range(warmup)] + [data.device(0.25)]
    base = strict_cupy.memory()
    comm = sc.Communicator(transport(ranks), gs[0], ratio=0.1, value_dtype=vdt, seed=1,
                           dense_threshold=dense_threshold)
    for g in gs[:-1]:
        comm.onebit_allreduce(g)
    return counted(lambda: comm.onebit_allreduce(gs[-1]), comm.layout.total, base)


def run_adapter(data, vdt, ranks, warmup, dense_threshold, form="fused", distributed=False):
    import torch

    from slamb_comm.adapters.torch import SLAMB, DistributedOptimizer

    ps = [torch.nn.Parameter(torch.from_numpy(a)) for a in np.split(data.flat, np.cumsum(
        [int(np.prod(s)) for s in data.shapes])[:-1])]
    for p, s in zip(ps, data.shapes):
        p.data = p.data.reshape(s)
    opt = SLAMB(ps, lr=1e-3, weight_decay=0.01, ratio=0.1, value_dtype=vdt, dense_threshold=dense_threshold,
                fused=form == "fused")
    if distributed:
        opt = DistributedOptimizer(opt, named_parameters=[(f"p{i}", p) for i, p in enumerate(ps)])
    gc.collect()
    base = strict_cupy.memory()
    for t in range(max(warmup, 21) + 1):
        for p in ps:
            if p.grad is None:
                p.grad = torch.full_like(p, 1e-3 * (t + 1))
            else:  # in place, as backward() accumulates into .grad (their addresses stay)
                p.grad.fill_(1e-3 * (t + 1))
        aten = strict_cupy.aten_counter()
        strict_cupy.reset_peak()
        with strict_cupy.counting() as c, aten:
            opt.step()
    c.launches += aten.n
    c.bytes += aten.read + aten.written
    c.by_op.update({f"torch.{k}": v for k, v in aten.by_op.items()})
    c.by_op_bytes.update({f"torch.{k}": v for k, v in aten.by_op_bytes.items()})
    return Cost(c, data.flat.size, base)


def _fmt_ops(counter, per=1, top=8):
    return "; ".join(f"{k} {v / per:.3g}" for k, v in counter.most_common(top))


NAMES = {"slamb": "SlambRule.step", "topk": "sparse_allgather", "onebit": "onebit_allreduce", "adapter": "torch adapter"}


def jobs_of(args, data):
    """The measurements of one layout: (what, payload, ranks, step, function, keywords)."""
    jobs = []
    for vdt in args.dtypes:
        for ranks in args.ranks:
            opts = dict(data=data, vdt=vdt, ranks=ranks, warmup=args.warmup, dense_threshold=args.dense_threshold)
            if "slamb" in args.what:
                for form in args.forms:
                    jobs.append(("slamb", vdt, ranks, f"step, {form}", run_slamb, dict(opts, H=100, form=form)))
                    jobs.append(("slamb", vdt, ranks, f"sync step, {form}", run_slamb, dict(opts, H=1, form=form)))
                for when in ("first cycle", "ratio change"):
                    jobs.append(("slamb", vdt, ranks, f"step, fused, {when}", run_slamb, dict(opts, H=100, when=when)))
            if "topk" in args.what:
                jobs.append(("topk", vdt, ranks, "exchange", run_topk, opts))
            if "onebit" in args.what:
                jobs.append(("onebit", vdt, ranks, "exchange", run_onebit, opts))
            for form in args.forms if "adapter" in args.what and ranks == 1 else ():
                jobs.append(("adapter", vdt, ranks, f"SLAMB.step, {form}", run_adapter, dict(opts, form=form)))
                jobs.append(("adapter", vdt, ranks, f"DistributedOptimizer.step, {form}", run_adapter,
                             dict(opts, form=form, distributed=True)))
    return jobs


def measure(args):
    rows = []
    total = round(TOTAL * args.scale)
    for tensors in args.tensors:
        data = Data(shapes_of(tensors, total))
        for what, vdt, ranks, kind, job, kw in jobs_of(args, data):
            cost = job(**kw)
            c = cost.c
            rows.append({
                "what": what, "payload": vdt, "ranks": ranks, "step": kind, "tensors": tensors,
                "elements": total, "scale": args.scale, "dense_threshold": args.dense_threshold,
                "launches": c.launches, "bytes_per_param": round(c.bytes / cost.n, 2),
                "kept_bytes_per_param": round(cost.kept, 2), "peak_bytes_per_param": round(cost.peak, 2),
                "h2d": c.h2d, "host_reads": c.syncs, "launches_per_tensor": round(c.launches / tensors, 2),
                "ops": _fmt_ops(c.by_op, top=100), "bytes_by_op": _fmt_ops(c.by_op_bytes, per=cost.n, top=100),
                "h2d_kinds": _fmt_ops(c.by_h2d), "read_kinds": _fmt_ops(c.by_sync), "_by_op": c.by_op,
            })
            print(f"  {what} {vdt} P={ranks} {kind}, {tensors} tensors: {c.launches} launches, "
                  f"{c.bytes / cost.n:.1f} B/param, memory {cost.kept:.1f} kept / {cost.peak:.1f} peak, {c.h2d} h2d, "
                  f"{c.syncs} host reads", file=sys.stderr, flush=True)
    return rows


def _slope(pts):
    """Operations per added tensor, between the smallest and the largest layout."""
    (t0, v0), (t1, v1) = pts[0], pts[-1]
    return (v1 - v0) / (t1 - t0) if t1 > t0 else float("nan")


def markdown(rows, args):
    groups = {}
    for r in rows:
        groups.setdefault((r["what"], r["payload"], r["ranks"], r["step"]), []).append(r)
    tens = sorted({r["tensors"] for r in rows})
    head = " / ".join(f"{t:,}" for t in tens)
    out = []
    if args.scale != 1.0:
        out.append(f"**Scaled run: {round(TOTAL * args.scale):,} elements in all (--scale {args.scale:g}), "
                   f"not 6,553,600.**\n")
    out.append(f"Per step, {round(TOTAL * args.scale):,} float32 elements in {head} tensors "
               f"(dense_threshold {args.dense_threshold}). Bytes are device-memory bytes read + written per "
               f"parameter (AdamW(fused=True): {ADAMW_BYTES}); memory is device bytes per parameter held beyond "
               "the parameters and gradients, kept after the step and at its peak.\n")
    out.append(f"| exchange | payload | P | step | device operations ({head}) | per added tensor | bytes / param "
               f"({head}) | memory kept, peak ({head}) | host-to-device copies | host reads |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for (what, vdt, ranks, kind), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["tensors"])
        la = " / ".join(f"{r['launches']:,}" for r in rs)
        by = " / ".join(f"{r['bytes_per_param']:.1f}" for r in rs)
        me = " / ".join(f"{r['kept_bytes_per_param']:.1f}, {r['peak_bytes_per_param']:.1f}" for r in rs)
        hd = " / ".join(f"{r['h2d']:,}" for r in rs)
        rd = " / ".join(f"{r['host_reads']:,}" for r in rs)
        sl = _slope([(r["tensors"], r["launches"]) for r in rs])
        out.append(f"| {NAMES[what]} | {vdt} | {ranks} | {kind} | {la} | {sl:.1f} | {by} | {me} | {hd} | {rd} |")
    out.append("")
    big = tens[-1]
    out.append(f"Device operations per step at {big:,} tensors (the double's names: `iadd` is `a += b`, "
               "`setitem(copy)` a slice assignment, `getitem(gather)` `a[idx]`, `kernel(...)` a device kernel):\n")
    out.append("| exchange | payload | P | step | operations |")
    out.append("|---|---|---|---|---|")
    for (what, vdt, ranks, kind), rs in groups.items():
        r = max(rs, key=lambda r: r["tensors"])
        out.append(f"| {NAMES[what]} | {vdt} | {ranks} | {kind} | {_fmt_ops(r['_by_op'], top=10)} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", default=",".join(map(str, TENSORS)), help="layouts: numbers of tensors")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the 6,553,600 elements by this")
    ap.add_argument("--what", default="slamb,topk,onebit", help="any of slamb, topk, onebit, adapter")
    ap.add_argument("--dtypes", default="float32,float16", help="payload dtypes")
    ap.add_argument("--ranks", default="1,2", help="1 (LocalTransport) and/or 2 (the twin transport)")
    ap.add_argument("--forms", default="fused,list",
                    help="SLAMB's input: fused (one buffer, the whole-buffer step) and/or list (per tensor)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="calls before the counted one (SLAMB's settled steps: at least 21, past the mask's "
                         "first cycle)")
    ap.add_argument("--dense-threshold", type=int, default=0, help="the communicator's dense_threshold")
    ap.add_argument("--out", default=None, help="CSV file (default: print only)")
    args = ap.parse_args(argv)
    args.tensors = [int(t) for t in args.tensors.split(",")]
    args.what = args.what.split(",")
    args.forms = args.forms.split(",")
    args.dtypes = args.dtypes.split(",")
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if any(r not in (1, 2) for r in args.ranks):
        ap.error("--ranks: 1 and/or 2")
    if args.warmup < 1:
        ap.error("--warmup: at least 1 (the first call allocates the state)")
    with strict_cupy.install():
        strict_cupy.Device.current = 0
        if "adapter" not in args.what:
            rows = measure(args)
        else:
            import tempfile

            import torch.distributed as dist

            with tempfile.TemporaryDirectory() as tmp, strict_cupy.torch_bridge():
                dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
                try:
                    rows = measure(args)
                finally:
                    dist.destroy_process_group()
    print(markdown(rows, args))
    if args.out:
        write_rows([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows], args.out)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
