"""bash scripts/mpirun.sh 2 1800 python3 benchmarks/scale.py --out benchmarks/results/scale.csv

Scale check: SLAMB steps of a BERT-Large-shaped parameter set through the Horovod adapter.

    bash scripts/mpirun.sh 2 1800 python3 benchmarks/scale.py --out benchmarks/results/scale.csv
    bash scripts/mpirun.sh 2 300 python3 benchmarks/scale.py --layers 1      # smoke: ~45M parameters

Why: the paper trains BERT-XL (2.8B parameters); SLAMB keeps per parameter a momentum m and
a second moment v (8 bytes) next to the model and its gradients, so the question at scale is
whether the optimizer's state and every temporary of a step fit next to the model, and
whether the bytes of a step are what the algorithm promises. Here one BERT-Large
(``bert-large-uncased``: 24 layers, hidden 1024, intermediate 4096, vocab 30522, 512
positions, 2 token types; 335,141,888 parameters with the pooler) is the largest model
a 2-core, 24 GiB machine holds twice (2 ranks x params + grads + m + v ~ 2 x 5.4 GB).

What it does: every rank builds the same parameters (HuggingFace ``named_parameters`` names
and shapes, float32, CPU, fixed seed; no model forward), under ``hvd.init()`` wraps
``SLAMB(lr=1e-3, ratio=0.1, value_dtype='float16', sync_interval=100, beta3=0.9)`` in
``slamb_comm.adapters.horovod.DistributedOptimizer`` and takes ``--steps`` steps (default 2:
step 1 includes SLAMB's periodic parameter sync, step 2 does not). The gradients come from
autograd, so the adapter's gradient hooks launch the momentum exchange during backward as in
training: the loss is ``sum_i c_i (|p_i|^2 + sum p_i)`` through a small autograd function
whose backward makes one tensor per parameter, its gradient ``c_i (2 p_i + 1)`` (no other
full-size tensor is kept alive); ``c_i`` depends on the rank and the step.

What it reports (rank 0 prints; the figures of both ranks are gathered):

* per step: forward+backward time (the hooks encode and launch the exchange), ``opt.step()``
  time (wait for the exchange, the update, the periodic sync), each the maximum over ranks;
  the bytes handed to the collectives from ``opt.step_traffic()`` (which drains every
  communicator's per-step statistics, the periodic sync included), broken down by kind
  (``comm.stats.by_kind`` of each communicator, differenced around the step), and, as an
  independent check that no byte escapes the statistics, the bytes this script saw handed to
  Horovod's collectives (``allreduce_async_``, ``allreduce_``, ``allgather``, ``broadcast_``,
  counted by wrappers around ``horovod.torch``'s functions during the step);
* "payload / dense fp32": the step's payload against one dense float32 allreduce of all
  parameters (4 N bytes). ``Traffic.ratio`` is printed too; on a sync step its denominator
  holds the dense size twice (the momentum exchange's and the sync's), so it reads lower;
* the steady state over one cycle of H steps from the measured steps:
  ``(bytes of a sync step + (H - 1) bytes of a non-sync step) / H`` as a fraction of dense
  fp32 (about 1 / 16.5 = 0.06 expected at k = 0.1, fp16 payload, H = 100);
* memory per rank: RSS once the parameters exist (the baseline, before the optimizer is
  built), peak RSS (VmHWM) while building them, and from the optimizer's construction on
  (the kernel's peak mark is reset through ``/proc/self/clear_refs`` before the optimizer
  is built and before each step, so each step's peak is its own), and the optimizer's peak
  above the baseline per parameter: gradients (4 bytes) + m and v (8) + temporaries;
  ``MemTotal`` / ``MemAvailable`` of the machine at the start;
* whether the parameters are identical on every rank after each step (they must be after a
  sync step; after the others they drift, by design).

``--out FILE`` writes the per-step rows, the cycle row and the per-rank memory rows as CSV
(``benchmarks/csvout.py``). ``--layers N`` shrinks the encoder for a quick run.
"""

import argparse
import os
import re
import sys
import time

for _k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_k, "1")  # one thread per rank: 2 ranks on 2 cores

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import horovod.torch as hvd  # noqa: E402
from csvout import write_rows  # noqa: E402

import slamb_comm  # noqa: E402
from slamb_comm.adapters import horovod as sh  # noqa: E402

MB = 1e6
GIB = 1024**3

# bert-large-uncased (HuggingFace BertConfig)
HIDDEN, INTER, VOCAB, POSITIONS, TYPES = 1024, 4096, 30522, 512, 2
SLAMB_KW = dict(lr=1e-3, ratio=0.1, value_dtype="float16", sync_interval=100, beta3=0.9)


# ---------------------------------------------------------------------------- parameters
def bert_large_shapes(layers=24):
    """``(name, shape)`` of ``BertModel(bert-large-uncased).named_parameters()``, in its order."""
    h, i = HIDDEN, INTER
    out = [
        ("embeddings.word_embeddings.weight", (VOCAB, h)),
        ("embeddings.position_embeddings.weight", (POSITIONS, h)),
        ("embeddings.token_type_embeddings.weight", (TYPES, h)),
        ("embeddings.LayerNorm.weight", (h,)),
        ("embeddings.LayerNorm.bias", (h,)),
    ]
    for n in range(layers):
        pre = f"encoder.layer.{n}."
        for which in ("query", "key", "value"):
            out += [(f"{pre}attention.self.{which}.weight", (h, h)), (f"{pre}attention.self.{which}.bias", (h,))]
        out += [
            (f"{pre}attention.output.dense.weight", (h, h)),
            (f"{pre}attention.output.dense.bias", (h,)),
            (f"{pre}attention.output.LayerNorm.weight", (h,)),
            (f"{pre}attention.output.LayerNorm.bias", (h,)),
            (f"{pre}intermediate.dense.weight", (i, h)),
            (f"{pre}intermediate.dense.bias", (i,)),
            (f"{pre}output.dense.weight", (h, i)),
            (f"{pre}output.dense.bias", (h,)),
            (f"{pre}output.LayerNorm.weight", (h,)),
            (f"{pre}output.LayerNorm.bias", (h,)),
        ]
    out += [("pooler.dense.weight", (h, h)), ("pooler.dense.bias", (h,))]
    return out


def build_params(layers, seed=0):
    """BERT's initialisation: weights N(0, 0.02), LayerNorm weights 1, biases 0; identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    named = []
    for name, shape in bert_large_shapes(layers):
        t = torch.empty(shape, dtype=torch.float32)
        if name.endswith("LayerNorm.weight"):
            t.fill_(1.0)
        elif name.endswith("bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=g)
        named.append((name, torch.nn.Parameter(t)))
    return named


class _Quadratic(torch.autograd.Function):
    """``c (|p|^2 + sum p)``; backward makes exactly one full-size tensor, the gradient
    ``c (2 p + 1)`` (nonzero everywhere, biases at 0 included). Saves only ``p`` itself."""

    @staticmethod
    def forward(ctx, p, c):
        ctx.c = c
        ctx.save_for_backward(p)
        flat = p.detach().reshape(-1)
        return (torch.dot(flat, flat) + flat.sum()) * c

    @staticmethod
    def backward(ctx, grad):
        (p,) = ctx.saved_tensors
        return p.mul(2.0 * ctx.c).add_(ctx.c).mul_(grad), None


def loss_of(named, rank, step):
    n = len(named)
    terms = [_Quadratic.apply(p, (1.0 + 0.25 * rank) * (1.0 + 0.5 * i / n) * (1.0 + 0.1 * step))
             for i, (_, p) in enumerate(named)]
    return torch.stack(terms).sum()


# ---------------------------------------------------------------------------- memory
def _status_kb(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _meminfo_kb(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/meminfo").read()).group(1))


def _rss_after_trim():
    """VmRSS after glibc's ``malloc_trim(0)`` (freed heap memory given back), or -1 without glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return -1
    return _status_kb("VmRSS") * 1024


def _loadavg():
    """The 1-minute load average (other jobs on the machine make the times noisy; bytes are exact)."""
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _reset_peak():
    """Restart the kernel's peak-RSS mark (VmHWM) from the current RSS; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------- what reaches Horovod
class Tap:
    """Counts the bytes this process hands to horovod.torch's collectives while ``on``.

    The adapter calls them as ``hvd.<fn>`` (``import horovod.torch as hvd``), so wrapping the
    module's attributes sees every call; nothing else changes."""

    FNS = ("allreduce_async_", "allreduce_", "allreduce", "allgather", "broadcast_", "broadcast")

    def __init__(self):
        self.on = False
        self.calls = 0
        self.bytes = 0
        self.by_fn = {}
        for fn in self.FNS:
            if hasattr(hvd, fn):
                setattr(hvd, fn, self._wrap(fn, getattr(hvd, fn)))

    def _wrap(self, fn, f):
        def wrapped(tensor, *a, **kw):
            if self.on:
                b = tensor.numel() * tensor.element_size()
                self.calls += 1
                self.bytes += b
                c, s = self.by_fn.get(fn, (0, 0))
                self.by_fn[fn] = (c + 1, s + b)
            return f(tensor, *a, **kw)

        wrapped.__wrapped__ = f
        return wrapped

    def start(self):
        self.calls, self.bytes, self.by_fn, self.on = 0, 0, {}, True

    def stop(self):
        self.on = False
        return self.calls, self.bytes, dict(self.by_fn)


def _kind_diff(before, after):
    """Per kind: ``after - before`` (Traffic totals) where anything changed."""
    out = {}
    for kind, t in after.items():
        b = before.get(kind, slamb_comm.Traffic())
        d = t - b
        if d.calls:
            out[kind] = d
    return out


# ---------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24, help="encoder layers (24: BERT-Large; 1: a quick smoke run)")
    ap.add_argument("--steps", type=int, default=2, help="SLAMB steps (step 1 includes the periodic sync)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="CSV file (default: print only)")
    args = ap.parse_args()
    if args.steps < 1 or args.layers < 0:
        ap.error("need --steps >= 1 and --layers >= 0")

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    say = print if rank == 0 else (lambda *a, **k: None)
    H = SLAMB_KW["sync_interval"]

    mem_total, mem_avail = _meminfo_kb("MemTotal") * 1024, _meminfo_kb("MemAvailable") * 1024
    say(f"# scale check: BERT-Large shapes, {args.layers} layers, {size} ranks, {args.steps} steps")
    load_start = _loadavg()
    say(f"machine: MemTotal {mem_total / GIB:.2f} GiB, MemAvailable {mem_avail / GIB:.2f} GiB at start, "
        f"{os.cpu_count()} CPUs, load average {load_start:.2f} at start; torch {torch.__version__}, "
        "1 thread per rank")

    t0 = time.perf_counter()
    named = build_params(args.layers, args.seed)
    build_s = time.perf_counter() - t0
    n = sum(p.numel() for _, p in named)
    n_big = sum(p.numel() for _, p in named if p.dim() > 1 and p.numel() > 9000)
    dense_fp32 = 4 * n
    peak_build = _status_kb("VmHWM") * 1024
    base = _status_kb("VmRSS") * 1024
    say(f"parameters: {n:,} in {len(named)} tensors ({n_big:,} in sparsely exchanged 2-D tensors, "
        f"{n - n_big:,} always exchanged whole); {dense_fp32 / MB:,.1f} MB fp32; built in {build_s:.1f} s")
    say(f"SLAMB options: {SLAMB_KW}; H = {H}")

    tap = Tap()
    can_reset = _reset_peak()  # from here on VmHWM is the optimizer's run
    t0 = time.perf_counter()
    opt = sh.DistributedOptimizer(sh.SLAMB([p for _, p in named], **SLAMB_KW), named_parameters=named)
    opt_build_s = time.perf_counter() - t0
    comms = opt.communicators
    say(f"optimizer built in {opt_build_s:.1f} s: {len(comms)} communicator(s), "
        f"layouts of {[c.layout.total for c in comms]} elements")
    rss_after_build = _status_kb("VmRSS") * 1024
    peak_build_opt = _status_kb("VmHWM") * 1024

    steps = []
    for s in range(1, args.steps + 1):
        t = s  # the optimizer's step count after this step (the state starts at step 0)
        sync = (t - 1) % H == 0 and size > 1
        before = [dict(c.stats.by_kind) for c in comms]
        if can_reset:
            _reset_peak()
        tap.start()
        t0 = time.perf_counter()
        loss = loss_of(named, rank, s)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        calls, tapped, by_fn = tap.stop()
        traffic = opt.step_traffic()
        kinds = {}
        for c, b in zip(comms, before):
            for kind, d in _kind_diff(b, c.stats.by_kind).items():
                kinds[kind] = kinds.get(kind, slamb_comm.Traffic()) + d
        opt.zero_grad()
        del loss
        peak = _status_kb("VmHWM") * 1024
        check = sum(float(p.detach().sum(dtype=torch.float64)) for _, p in named)
        mine = dict(fwd_bwd_s=t1 - t0, step_s=t2 - t1, peak=peak, rss=_status_kb("VmRSS") * 1024,
                    check=check, tapped=tapped, calls=calls, payload=traffic.payload_bytes)
        every = hvd.allgather_object(mine)
        steps.append(dict(step=t, sync=sync, traffic=traffic, kinds=kinds, by_fn=by_fn, ranks=every))
        say(f"step {t} done: fwd+bwd {max(r['fwd_bwd_s'] for r in every):.2f} s, "
            f"opt.step {max(r['step_s'] for r in every):.2f} s, payload {traffic.payload_bytes / MB:.2f} MB")

    mem = dict(rank=rank, base=base, peak_build=peak_build, rss_after_build=rss_after_build,
               peak_opt_build=peak_build_opt,
               peak_run=max([peak_build_opt] + [st["ranks"][rank]["peak"] for st in steps]),
               rss_end=_status_kb("VmRSS") * 1024, rss_end_trimmed=_rss_after_trim(), can_reset=can_reset)
    mems = hvd.allgather_object(mem)
    if rank == 0:
        report(args, n, len(named), dense_fp32, mem_total, mem_avail, steps, mems, size, H, can_reset,
               (load_start, _loadavg()))
    hvd.shutdown()


def _yes(b):
    return "yes" if b else "no"


def report(args, n, tensors, dense_fp32, mem_total, mem_avail, steps, mems, size, H, can_reset, load):
    rows = []
    dense_wire = slamb_comm.wire.stats.allreduce_wire(dense_fp32, size)
    print()
    print("## Bytes by kind per step (rank 0; payload = bytes handed to the collective)")
    print()
    print("| step | kind | calls | payload MB | wire MB | dense of that kind MB | payload / dense fp32 | "
          "encode s | comm s | decode s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for st in steps:
        for kind, d in sorted(st["kinds"].items()):
            print(f"| {st['step']} | {kind} | {d.calls} | {d.payload_bytes / MB:,.3f} | {d.wire_bytes / MB:,.3f} | "
                  f"{d.dense_payload_bytes / MB:,.3f} | {d.payload_bytes / dense_fp32:.4f} | {d.encode_s:.2f} | "
                  f"{d.comm_s:.2f} | {d.decode_s:.2f} |")
    print("\n(masked_allreduce: encode = the gradient hooks' local moments on M_t and launches, summed over "
          "tensors; comm = waiting for the exchanges in step(); sync: comm = its allreduces, decode = the rest)")
    print()
    print("## Horovod calls seen during each step (rank 0; independent of the statistics)")
    print()
    for st in steps:
        fns = ", ".join(f"{fn}: {c} calls, {b / MB:,.3f} MB" for fn, (c, b) in sorted(st["by_fn"].items()))
        r0 = st["ranks"][0]
        diff = r0["tapped"] - st["traffic"].payload_bytes
        print(f"- step {st['step']}: {fns}; total {r0['tapped'] / MB:,.3f} MB vs step_traffic "
              f"{st['traffic'].payload_bytes / MB:,.3f} MB (difference {diff:+,} bytes)")

    print()
    print("## Memory per rank")
    print()
    print("| rank | RSS before optimizer GB | peak RSS building params GB | peak RSS from optimizer on GB | "
          "optimizer peak above baseline GB | bytes / param | RSS at end GB | RSS at end after malloc_trim GB | "
          "per-step peaks GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in mems:
        above = m["peak_run"] - m["base"]
        per_step = ", ".join(f"{st['ranks'][m['rank']]['peak'] / 1e9:.2f}" for st in steps)
        print(f"| {m['rank']} | {m['base'] / 1e9:.2f} | {m['peak_build'] / 1e9:.2f} | {m['peak_run'] / 1e9:.2f} | "
              f"{above / 1e9:.2f} | {above / n:.2f} | {m['rss_end'] / 1e9:.2f} | {m['rss_end_trimmed'] / 1e9:.2f} | "
              f"{per_step} |")
        rows.append(dict(row="memory", layers=args.layers, params=n, ranks=size, rank=m["rank"],
                         rss_base_bytes=m["base"], peak_build_bytes=m["peak_build"],
                         peak_run_bytes=m["peak_run"], opt_peak_above_base_bytes=above,
                         opt_bytes_per_param=above / n, rss_end_bytes=m["rss_end"],
                         rss_end_trimmed_bytes=m["rss_end_trimmed"],
                         mem_total_bytes=mem_total, mem_available_start_bytes=mem_avail))
    print(f"\n(params {4 * n / 1e9:.2f} GB; expected above the baseline: gradients 4 + m, v 8 = 12 bytes/param "
          f"= {12 * n / 1e9:.2f} GB, plus a step's temporaries. RSS at end is after zero_grad(): glibc may keep "
          f"the freed gradients' memory until malloc_trim"
          + ("" if can_reset else "; /proc/self/clear_refs refused: peaks include the parameter build") + ")")

    print()
    print("## Steps")
    print()
    print("| step | param sync | fwd+bwd s | opt.step s | payload MB | wire MB | dense fp32 MB | "
          "payload / dense fp32 | Traffic.ratio | calls | bytes seen by Horovod MB | identical params on all ranks |"
          " peak RSS GB per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for st in steps:
        tr, rr = st["traffic"], st["ranks"]
        same = max(r["check"] for r in rr) == min(r["check"] for r in rr)
        fb, sp = max(r["fwd_bwd_s"] for r in rr), max(r["step_s"] for r in rr)
        frac = tr.payload_bytes / dense_fp32
        peaks = " / ".join(f"{r['peak'] / 1e9:.2f}" for r in rr)
        print(f"| {st['step']} | {_yes(st['sync'])} | {fb:.2f} | {sp:.2f} | {tr.payload_bytes / MB:,.3f} | "
              f"{tr.wire_bytes / MB:,.3f} | {dense_fp32 / MB:,.3f} | {frac:.4f} | {tr.ratio:.4f} | {tr.calls} | "
              f"{rr[0]['tapped'] / MB:,.3f} | {_yes(same)} | {peaks} |")
        row = dict(row="step", layers=args.layers, params=n, tensors=tensors, ranks=size, step=st["step"],
                   sync=int(st["sync"]), fwd_bwd_s=fb, step_s=sp, payload_bytes=tr.payload_bytes,
                   wire_bytes=tr.wire_bytes, dense_fp32_bytes=dense_fp32, payload_vs_dense_fp32=frac,
                   wire_vs_dense_fp32=tr.wire_bytes / dense_wire if dense_wire else 0.0,
                   traffic_dense_payload_bytes=tr.dense_payload_bytes, traffic_ratio=tr.ratio, calls=tr.calls,
                   horovod_bytes=rr[0]["tapped"], horovod_calls=rr[0]["calls"], identical_params=int(same),
                   load_start=load[0], load_end=load[1])
        for kind, d in sorted(st["kinds"].items()):
            row[f"{kind}_payload_bytes"] = d.payload_bytes
            row[f"{kind}_encode_s"], row[f"{kind}_comm_s"], row[f"{kind}_decode_s"] = d.encode_s, d.comm_s, d.decode_s
        for r, rk in enumerate(rr):
            row[f"peak_rss_rank{r}_bytes"] = rk["peak"]
        rows.append(row)

    syncs = [st["traffic"] for st in steps if st["sync"]]
    others = [st["traffic"] for st in steps if not st["sync"]]
    if syncs and others:
        bs = sum(t.payload_bytes for t in syncs) / len(syncs)
        bo = sum(t.payload_bytes for t in others) / len(others)
        ws = sum(t.wire_bytes for t in syncs) / len(syncs)
        wo = sum(t.wire_bytes for t in others) / len(others)
        avg, wavg = (bs + (H - 1) * bo) / H, (ws + (H - 1) * wo) / H
        print()
        print(f"Steady state over one cycle of H = {H} steps: ({bs / MB:,.3f} + {H - 1} x {bo / MB:,.3f}) / {H} = "
              f"{avg / MB:,.3f} MB per step = {avg / dense_fp32:.4f} of a dense fp32 allreduce "
              f"(1 / {dense_fp32 / avg:.1f}); wire {wavg / MB:,.3f} MB = {wavg / dense_wire:.4f} of dense")
        rows.append(dict(row="cycle", layers=args.layers, params=n, ranks=size, sync_interval=H,
                         payload_bytes=avg, wire_bytes=wavg, dense_fp32_bytes=dense_fp32,
                         payload_vs_dense_fp32=avg / dense_fp32, wire_vs_dense_fp32=wavg / dense_wire))
    print(f"\nload average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at the end, on {os.cpu_count()} CPUs "
          "(times are wall times under that load; byte counts are exact)")
    if args.out:
        write_rows(rows, args.out)
        print(f"\nwrote {args.out}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
