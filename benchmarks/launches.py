"""python3 benchmarks/launches.py --out benchmarks/results/launches.csv

Device operations (would-be kernel launches), host-to-device copies and host reads per step
of slamb_comm's GPU path, counted on the CPU by the strict CuPy double (tests/strict_cupy.py).

    python3 benchmarks/launches.py --out benchmarks/results/launches.csv   # ~2 minutes on 2 cores
    python3 benchmarks/launches.py --scale 0.01 --what slamb                # quick: 65,536 elements

The double is installed as ``cupy``, so the core takes exactly the code paths it takes on a
GPU, and every call the double counts is one that CuPy would launch (its docstring defines
what counts as a launch, as a host-to-device copy and as a host read, and what cannot be
seen: fusion, and the several kernels some single CuPy calls launch). Nothing here is timed.

Layouts: 6,553,600 float32 elements (``--scale`` multiplies this) in 10 tensors of 655,360,
100 of 65,536, and 1,000 of 6,553 (the remainder, 600 elements, in the last one); 2-D shapes
(``(n / 1024, 1024)``, else ``(1, n)``). ``--dense-threshold`` (default 0) is the
communicator's: with the library's default, 9,000, every tensor of the 1,000-tensor layout
would be always dense (exchanged whole) and the three layouts would not do the same work.

Measured, each on the step after ``--warmup`` steps of the same kind (allocations and the
first step's one-time work are not counted):

* ``slamb``: one :meth:`slamb_comm.slamb.Slamb.step` (ratio 0.1, cyclic mask, lr 1e-3, weight
  decay 0.01, payload ``--dtypes``), with the default ``sync_interval`` (100: a step without
  the periodic parameter sync) and with ``sync_interval=1`` (every step a sync step), on one
  fused buffer (``fused``: the whole-buffer step of ``slamb_comm/fused.py``, a device's default;
  its ``cupy.fuse``d functions count one launch each) and on one array per tensor (``list``:
  the tensor-by-tensor step);
* ``topk``: one :meth:`Communicator.sparse_allgather` (top-k, ratio 0.01, error feedback);
* ``onebit``: one :meth:`Communicator.onebit_allreduce` (signs and scales; on the double the
  signs are packed by the core's arithmetic fallback, as the double has no ``packbits``,
  where CuPy's ``packbits``/``unpackbits`` are one launch each).
* ``adapter``: one ``step()`` of the torch optimizer ``SLAMB`` (``--ranks`` 1 only) and of
  ``DistributedOptimizer(SLAMB)`` on a one-process gloo group, with ``fused=True`` (flat
  buffers, the default for CUDA parameters) and ``fused=False`` (tensor by tensor), gradients
  set by hand. The parameters are CPU tensors, handed to the core as the double's arrays
  sharing their memory (``strict_cupy.torch_bridge``); the count is the core's device operations
  plus torch's operations (``strict_cupy.aten_counter``: each at most one kernel on a GPU, a
  ``_foreach_*`` call one). The distributed step holds the end-of-backward agreement, the step's
  decision and the exchange; torch's host reads and copies are counted among its operations.

At ``--ranks`` 1 (:class:`slamb_comm.LocalTransport`) and 2. One rank does not average
anything: ``Slamb.apply`` skips the periodic sync at P = 1, so a "sync step" is an ordinary
step there. Two ranks are emulated in one process by a twin transport: the other rank sends
exactly what this one does (every sum is twice this rank's values, exact; an allgather or
all-to-all hands back this rank's block twice), and every collective on device buffers
counts one launch (``collective.<name>``), as an NCCL call does; it reads nothing back.

The counts do not depend on the sizes of the tensors, only on their number and on how each
cuts into the mask's groups (a tensor whose ends are not aligned to the groups of C = 10 units
has a head and a tail range, each a few operations more), so ``--scale`` changes them only
through that alignment; the output says when a scale other than 1 was used.

Writes ``--out`` (CSV, ``benchmarks/csvout.py``: one row per measurement, with the operations
by name) and prints markdown tables: the totals per step at 10 / 100 / 1,000 tensors with the
operations each added tensor costs, and the dominant operations per tensor.
"""

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the strict CuPy double
if ROOT not in sys.path:
    sys.path.append(ROOT)

import strict_cupy  # noqa: E402
from csvout import write_rows  # noqa: E402

TOTAL = 6_553_600
TENSORS = (10, 100, 1000)
# issue 21's figures, counted on the code at d561354 (device operations per step)
ISSUE = {("slamb", "step"): {10: 995, 100: 15185}, ("topk", "exchange"): {10: 212, 100: 2012}}


def shapes_of(tensors, total):
    """``tensors`` 2-D shapes of ``total // tensors`` elements, the remainder in the last."""
    n = total // tensors
    sizes = [n] * tensors
    sizes[-1] += total - n * tensors
    return [(s // 1024, 1024) if s % 1024 == 0 else (1, s) for s in sizes]


def _raw(buf):
    return buf._a if isinstance(buf, strict_cupy.ndarray) else buf  # the double's host memory


def _collective(name, buf):
    if isinstance(buf, strict_cupy.ndarray):
        strict_cupy.launches[f"collective.{name}"] += 1  # one NCCL call: one launch


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


def counted(fn):
    with strict_cupy.counting() as c:
        fn()
    return c


def run_slamb(data, vdt, ranks, H, warmup, dense_threshold, form="fused"):
    """``form``: 'fused' (one fused buffer: the whole-buffer step, slamb_comm/fused.py) or 'list'
    (one array per tensor: the tensor-by-tensor step)."""
    import slamb_comm as sc
    from slamb_comm.slamb import Slamb

    cp = sys.modules["cupy"]
    dev = (lambda s=1.0: cp.asarray(data.flat * np.float32(s))) if form == "fused" else data.device
    x = dev()
    lay = sc.Layout(data.shapes, dense_threshold=dense_threshold)
    comm = sc.Communicator(transport(ranks), lay, ratio=0.1, mask="cyclic", value_dtype=vdt, seed=1)
    opt = Slamb(comm, lr=1e-3, weight_decay=0.01, sync_interval=H)
    for t in range(max(warmup, 21) if form == "fused" else warmup):
        opt.step(x, dev(0.5 + t))
    g = dev(0.25)
    return counted(lambda: opt.step(x, g))


def run_topk(data, vdt, ranks, warmup, dense_threshold):
    import slamb_comm as sc

    comm = sc.Communicator(transport(ranks), data.device(), ratio=0.01, value_dtype=vdt, seed=1,
                           dense_threshold=dense_threshold)
    for t in range(warmup):
        comm.sparse_allgather(data.device(0.5 + t))
    g = data.device(0.25)
    return counted(lambda: comm.sparse_allgather(g))


def run_onebit(data, vdt, ranks, warmup, dense_threshold):
    import slamb_comm as sc

    comm = sc.Communicator(transport(ranks), data.device(), ratio=0.1, value_dtype=vdt, seed=1,
                           dense_threshold=dense_threshold)
    for t in range(warmup):
        comm.onebit_allreduce(data.device(0.5 + t))
    g = data.device(0.25)
    return counted(lambda: comm.onebit_allreduce(g))


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
    for t in range(max(warmup, 21) + 1):
        for p in ps:
            p.grad = torch.full_like(p, 1e-3 * (t + 1))
        aten = strict_cupy.aten_counter()
        with strict_cupy.counting() as c, aten:
            opt.step()
    c.launches += aten.n
    c.by_op.update({f"torch.{k}": v for k, v in aten.by_op.items()})
    return c


def _fmt_ops(counter, per=1, top=8):
    return "; ".join(f"{k} {v / per:.3g}" for k, v in counter.most_common(top))


def measure(args):
    rows = []
    total = round(TOTAL * args.scale)
    for tensors in args.tensors:
        shapes = shapes_of(tensors, total)
        data = Data(shapes)
        jobs = []
        for vdt in args.dtypes:
            for ranks in args.ranks:
                opts = dict(data=data, vdt=vdt, ranks=ranks, warmup=args.warmup, dense_threshold=args.dense_threshold)
                for form in args.forms if "slamb" in args.what else ():
                    jobs.append(("slamb", vdt, ranks, f"step, {form}", run_slamb, dict(opts, H=100, form=form)))
                    jobs.append(("slamb", vdt, ranks, f"sync step, {form}", run_slamb, dict(opts, H=1, form=form)))
                if "topk" in args.what:
                    jobs.append(("topk", vdt, ranks, "exchange", run_topk, opts))
                if "onebit" in args.what:
                    jobs.append(("onebit", vdt, ranks, "exchange", run_onebit, opts))
                for form in args.forms if "adapter" in args.what and ranks == 1 else ():
                    jobs.append(("adapter", vdt, ranks, f"SLAMB.step, {form}", run_adapter, dict(opts, form=form)))
                    jobs.append(("adapter", vdt, ranks, f"DistributedOptimizer.step, {form}", run_adapter,
                                 dict(opts, form=form, distributed=True)))
        for what, vdt, ranks, kind, job, kw in jobs:
            c = job(**kw)
            rows.append({
                "what": what, "payload": vdt, "ranks": ranks, "step": kind, "tensors": tensors,
                "elements": total, "scale": args.scale, "dense_threshold": args.dense_threshold,
                "measured_call": (max(args.warmup, 21) if kw.get("form") == "fused" or what == "adapter"
                                  else args.warmup) + 1,
                "launches": c.launches, "h2d": c.h2d, "host_reads": c.syncs,
                "launches_per_tensor": round(c.launches / tensors, 2), "h2d_per_tensor": round(c.h2d / tensors, 3),
                "ops": _fmt_ops(c.by_op, top=100), "h2d_kinds": _fmt_ops(c.by_h2d), "read_kinds": _fmt_ops(c.by_sync),
                "_by_op": c.by_op,
            })
            print(f"  {what} {vdt} P={ranks} {kind}, {tensors} tensors: {c.launches} launches, {c.h2d} h2d, "
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
                   f"not 6,553,600; the counts do not depend on the sizes, except through each tensor's "
                   f"alignment to the mask's groups.**\n")
    out.append(f"Per step, {round(TOTAL * args.scale):,} float32 elements in {head} tensors "
               f"(dense_threshold {args.dense_threshold}); the call after {args.warmup} warm-up call(s) "
               f"(SLAMB on a fused buffer: after {max(args.warmup, 21)}, past the mask's first cycle).\n")
    out.append(f"| exchange | payload | P | step | device operations ({head}) | per added tensor | "
               f"host-to-device copies ({head}) | host reads ({head}) |")
    out.append("|---|---|---|---|---|---|---|---|")
    for (what, vdt, ranks, kind), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["tensors"])
        la = " / ".join(f"{r['launches']:,}" for r in rs)
        hd = " / ".join(f"{r['h2d']:,}" for r in rs)
        rd = " / ".join(f"{r['host_reads']:,}" for r in rs)
        sl = _slope([(r["tensors"], r["launches"]) for r in rs])
        name = {"slamb": "Slamb.step", "topk": "sparse_allgather", "onebit": "onebit_allreduce",
                "adapter": "torch adapter"}[what]
        out.append(f"| {name} | {vdt} | {ranks} | {kind} | {la} | {sl:.1f} | {hd} | {rd} |")
    out.append("")
    issue = "; ".join(f"{w} {k}: " + " / ".join(f"{v:,}" for v in d.values()) + " at "
                      + " / ".join(f"{t:,}" for t in d) + " tensors" for (w, k), d in ISSUE.items())
    out.append(f"Issue 21's count on d561354 (device operations): {issue}.\n")
    big = tens[-1]
    out.append(f"Dominant operations per tensor at {big:,} tensors (count / tensors; the double's names: "
               f"`iadd` is `a += b`, `setitem(copy)` a slice assignment, `getitem(gather)` `a[idx]`, ...):\n")
    out.append("| exchange | payload | P | step | operations per tensor |")
    out.append("|---|---|---|---|---|")
    for (what, vdt, ranks, kind), rs in groups.items():
        r = max(rs, key=lambda r: r["tensors"])
        name = {"slamb": "Slamb.step", "topk": "sparse_allgather", "onebit": "onebit_allreduce",
                "adapter": "torch adapter"}[what]
        out.append(f"| {name} | {vdt} | {ranks} | {kind} | {_fmt_ops(r['_by_op'], per=r['tensors'], top=10)} |")
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
                    help="calls before the counted one (at least 21 for SLAMB on a fused buffer: past the "
                         "mask's first cycle and one more, whose freshness rows are copied once)")
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
