"""What one rank of benchmarks/hsdp.py pays: the bytes of its collectives per process group, the
memory its optimizer keeps, and the markdown tables of the three measurements."""

import ctypes
import inspect
import statistics

# the collectives whose send tensor is counted, and the argument that holds it
_SEND = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather": "tensor", "all_gather_into_tensor": "input_tensor",
         "reduce_scatter_tensor": "input", "all_to_all_single": "input", "all_gather_single": "input_tensor",
         "reduce_scatter_single": "input"}


class CollectiveMeter:
    """Wraps ``torch.distributed``'s collectives (the module attributes FSDP2, HybridSLAMB and its
    transport call) and adds the bytes of each call's send tensor to the group it ran on, by
    name (``groups``: name -> sorted global ranks; others count as ``other``)."""

    def __init__(self, groups):
        import torch.distributed as dist

        self.dist, self.names = dist, {tuple(sorted(r)): n for n, r in groups.items()}
        self.bytes, self.calls, self._orig, self._kind = {}, {}, {}, {}

    def _group_name(self, group):
        key = id(group)
        if key not in self._kind:
            ranks = tuple(range(self.dist.get_world_size())) if group is None else \
                tuple(sorted(self.dist.get_process_group_ranks(group)))
            self._kind[key] = self.names.get(ranks, "other")
        return self._kind[key]

    def install(self):
        for fname, arg in _SEND.items():
            orig = getattr(self.dist, fname, None)
            if orig is None:
                continue
            self._orig[fname] = orig
            setattr(self.dist, fname, self._wrap(fname, orig, arg))
        return self

    def _wrap(self, fname, orig, arg):
        sig = inspect.signature(orig)

        def counted(*a, **kw):
            bound = sig.bind(*a, **kw)
            t = bound.arguments.get(arg)
            g = self._group_name(bound.arguments.get("group"))
            n = int(t.numel() * t.element_size()) if t is not None else 0
            self.bytes[g] = self.bytes.get(g, 0) + n
            self.calls[g] = self.calls.get(g, 0) + 1
            return orig(*a, **kw)

        counted.__wrapped__ = orig
        return counted

    def take(self):
        """Bytes and calls per group since the last call, and start counting anew."""
        out = (dict(self.bytes), dict(self.calls))
        self.bytes, self.calls = {}, {}
        return out

    def uninstall(self):
        for fname, orig in self._orig.items():
            setattr(self.dist, fname, orig)
        self._orig = {}


def _status_kb():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def rss_bytes():
    return 1024 * _status_kb()["VmRSS"]


def reset_peak():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_bytes():
    return 1024 * _status_kb()["VmHWM"]


def pin_mmap_threshold(nbytes=64 * 1024):
    """glibc: allocations of ``nbytes`` or more always through mmap (and the threshold no longer
    adapts), so a freed array leaves the RSS at once and the next arm's growth is its own."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, int(nbytes)))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _storage(obj):
    """(start address, bytes) of the whole buffer under a NumPy array or torch tensor, or None."""
    import numpy as np
    import torch

    from slamb_comm.adapters.torch.tensors import is_dtensor

    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):
            obj = obj._local_tensor
        s = obj.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.nbytes() else None
    if isinstance(obj, np.ndarray):
        base = obj
        while isinstance(base.base, np.ndarray):
            base = base.base
        if base.nbytes == 0:
            return None
        return (base.__array_interface__["data"][0], base.nbytes)
    return None


def _walk(obj, label, out, seen, depth=0):
    """Every NumPy array and torch tensor reachable from ``obj`` through attributes, dicts, lists,
    tuples and sets (not through modules, classes, functions or process groups): ``out`` gets
    (label, storage)."""
    import numpy as np
    import torch

    if depth > 10 or id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
        return
    seen.add(id(obj))
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        s = _storage(obj)
        if s is not None:
            out.append((label, s))
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, label if not isinstance(k, str) or depth > 3 else k, out, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _walk(v, label, out, seen, depth + 1)
        return
    if inspect.ismodule(obj) or inspect.isroutine(obj) or type(obj).__module__.startswith(("torch.distributed",
                                                                                          "torch._C")):
        return
    attrs = dict(getattr(obj, "__dict__", {}) or {})
    for k in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, k):
            attrs[k] = getattr(obj, k)
    for k, v in attrs.items():
        _walk(v, k if depth < 4 else label, out, seen, depth + 1)


def optimizer_bytes(opt, model):
    """Bytes the optimizer keeps, each storage once, the parameters' and gradients' excluded:
    (total, {label: bytes}). HybridSLAMB: ``opt.state`` and its buckets (rule: m, v, scratch;
    communicator: mask, wire; flat buffers); AdamW: ``opt.state``."""
    import torch

    roots = [("state", opt.state)]
    buckets = getattr(opt, "ready_buckets", None)
    if isinstance(buckets, list):
        for e in buckets:
            roots += [("rule", e.rule), ("comm", e.comm), ("flat", getattr(e, "flat", None))]
    found, seen = [], set()
    exclude = set()
    for p in model.parameters():
        for t in (p, p.grad):
            if isinstance(t, torch.Tensor):
                s = _storage(t)
                if s is not None:
                    exclude.add(s[0])
    for name, root in roots:
        _walk(root, name, found, seen)
    spans = {}
    for label, (start, n) in found:
        if start in exclude:
            continue
        if start not in spans or spans[start][1] < n:
            spans[start] = (label, n)
    # storages that lie inside another one (a view through another base) count once
    ordered = sorted((s, n, lab) for s, (lab, n) in spans.items())
    total, by, end = 0, {}, -1
    for s, n, lab in ordered:
        if s + n <= end:
            continue
        add = n - max(0, end - s)
        total += add
        by[lab] = by.get(lab, 0) + add
        end = max(end, s + n)
    return total, by


def _rng(vals, fmt):
    return f"{fmt(statistics.median(vals))} ({fmt(min(vals))}-{fmt(max(vals))})" if len(vals) > 1 else fmt(vals[0])


def bytes_table(rows, args, n_total):
    out = [f"{n_total:,} parameters, {rows[0]['replicas']} x {rows[0]['shards']} mesh; per rank, replica group only; "
           "medians (ranges) over the ranks", "",
           "| arm | local params | HSDP model count / step | measured / step (steady) | sync step | "
           "mean over a period | steady / HSDP | period / HSDP |", "|---|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        mb = lambda v: f"{v / 1e6:.3f} MB"  # noqa: E731
        pct = lambda v: f"{100 * v:.2f}%"  # noqa: E731
        sync = [r["replica_bytes_sync_step"] for r in rs if r["replica_bytes_sync_step"] != ""]
        out.append(f"| {arm} | {_rng([r['params_local'] for r in rs], lambda v: f'{v:,.0f}')} | "
                   f"{_rng([r['hsdp_model_bytes_per_step'] for r in rs], mb)} | "
                   f"{_rng([r['replica_bytes_steady'] for r in rs], mb)} | {_rng(sync, mb) if sync else '-'} | "
                   f"{_rng([r['replica_bytes_period_mean'] for r in rs], mb)} | "
                   f"{_rng([r['of_hsdp_steady'] for r in rs], pct)} | "
                   f"{_rng([r['of_hsdp_period_mean'] for r in rs], pct)} |")
    return "\n".join(out)


def memory_table(rows):
    out = ["| arm | optimizer state / local param | / AdamW | RSS growth (build + 1st step) / param | "
           "peak RSS in a step / param |", "|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rs = [r for r in rows if r["arm"] == arm]
        f2 = lambda v: f"{v:.2f} B"  # noqa: E731
        peak = [r["rss_peak_in_step_per_param"] for r in rs if r["rss_peak_in_step_per_param"] != ""]
        out.append(f"| {arm} | {_rng([r['state_bytes_per_param'] for r in rs], f2)} | "
                   f"{_rng([r['state_of_adamw'] for r in rs], lambda v: f'{v:.3f}')} | "
                   f"{_rng([r['rss_growth_per_param'] for r in rs], f2)} | {_rng(peak, f2) if peak else '-'} |")
    return "\n".join(out)


def time_table(rows):
    ok = [r for r in rows if int(r.get("ok", 0))]
    out = ["| link per node | arm | step ms | first step ms (HybridSLAMB: its sync) | opt.step ms | "
           "link MB / step / node | step / HSDP+AdamW | with the sync every H steps (bound) | load before |",
           "|---|---|---|---|---|---|---|---|---|"]
    f0 = lambda v: f"{v:.0f}"  # noqa: E731
    f2 = lambda v: f"{v:.2f}"  # noqa: E731
    for link in dict.fromkeys(r["link"] for r in ok):
        for arm in dict.fromkeys(r["arm"] for r in ok):
            rs = [r for r in ok if r["link"] == link and r["arm"] == arm]
            if not rs:
                continue
            out.append(f"| {link} | {arm} | {_rng([r['step_ms'] for r in rs], f0)} | "
                       f"{_rng([r['first_step_ms'] for r in rs], f0)} | {_rng([r['opt_ms_max'] for r in rs], f0)} | "
                       f"{_rng([r['link_tx_bytes_per_step_per_node'] / 1e6 for r in rs], f2)} | "
                       f"{_rng([r['ratio_to_hsdp_adamw'] for r in rs], f2)} | "
                       f"{_rng([r['ratio_incl_sync_bound'] for r in rs], f2)} | "
                       f"{_rng([r['load_before'] for r in rs], f2)} |")
    return "\n".join(out)
