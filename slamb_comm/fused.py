"""SLAMB's step on the whole fused buffer at once: the device path of :meth:`Slamb.step`.

:class:`~slamb_comm.slamb.Slamb` does its CPU step tensor by tensor, in cache-sized blocks (no
launches to save there). On a device every operation is a kernel launch, so this module does the
same step (docs/algorithm.md section 1, bitwise the same positions and payload) as a constant
number of whole-buffer operations, whatever the number of tensors -- the idea of apex's
``multi_tensor_apply`` and torch's fused optimizers, written as array expressions that run the
same on NumPy, on the tests' strict CuPy double and on CuPy:

* **Per-tensor constants live in small device arrays, built once** (:class:`Plan`): the start of
  every tensor in the fused buffer (per-tensor sums are one ``add.reduceat``), the cyclic mask's
  rotations (one small integer per group of C units) and, per element, one int32 index
  ``tensor * (C + 1) + chunk`` (chunk C for always-dense elements) that turns a per-(tensor,
  chunk) table of update coefficients into the per-element coefficient with one ``take``.
  Per step, the payload's per-tensor starts and counts come from a table indexed by the chunk
  ``(t - 1) mod C``: nothing is computed per tensor on the host, nothing copied to the device
  after the first step of a cycle (the first cycle after the start copies C + 1 freshness values).
* **Positions of M_t**: the selected unit of global group g is ``g C + (j - h(g)) mod C``; a
  unit maps to its element through its tensor's shift (one ``searchsorted``); the always-dense
  elements join them in one sort. The same positions as :class:`~slamb_comm.masks.CyclicMask`.
* **Trust ratios**: the four squared norms per tensor are four ``reduceat``; the ratios and rates
  of all tensors are one fused elementwise function on arrays of one entry per tensor.

Scratch on the device: two buffers of the fused size (the direction and one temporary) and the
int32 index (4 bytes per parameter, kept), besides m and v. Where this path does not apply
(NumPy arrays unless asked for, a list of arrays instead of one fused buffer, the bernoulli and
topk masks, ``block > 1``, a ratio change within its first cycle, tensors that skipped a step)
:meth:`Slamb.step` goes tensor by tensor.

``fuse`` marks the elementwise functions CuPy compiles into one kernel (``cupy.fuse``); on
NumPy and on the strict double they run as written. None of this has run on a GPU yet.
"""

import math

import numpy as np

from . import arrays as _arr
from .errors import LayoutError, NonFiniteError
from .stats import Traffic, allreduce_wire

__all__ = ["Plan", "applies", "step"]


_FUSED = {}  # (library, name) -> its fused function: built (and traced) once per process


def _fuse(xp, name, f):
    """``xp.fuse(f, kernel_name=name)`` where the library has it (CuPy: one kernel, compiled at
    the first call and cached), else ``f``. The name must be a C identifier: CuPy names the
    kernel after it (a lambda's ``<lambda>`` does not compile)."""
    fuse = getattr(xp, "fuse", None)
    if fuse is None:
        return f
    key = (id(xp), name)
    if key not in _FUSED:
        _FUSED[key] = fuse(kernel_name=name)(f)
    return _FUSED[key]


def _momentum(m, g, a, b):
    return a * m + b * g


def _blend(a, s, f):
    return a + (s - a) * f


def _trust(xp, xn2, un2, c_min, c_max):
    """``clamp(||x|| / ||u||, c_min, c_max)`` per entry, 1 where either norm is 0 (from squares)."""
    xn, un = xp.sqrt(xn2), xp.sqrt(un2)
    ok = (xn > 0) & (un > 0)
    r = xp.minimum(xp.maximum(xn / xp.where(ok, un, 1.0), c_min), c_max)
    return xp.where(ok, r, 1.0)


class Plan:
    """The constants of the fused step for one layout, mask and device (built once, on first use).

    Host: per chunk j, the payload's per-tensor counts and starts and its size. Device: the
    segment starts of the per-tensor sums, the mask's group rotations and rotation table, per
    compressible tensor its last unit and its unit-to-element shift, the always-dense elements'
    positions, and the per-element coefficient index (int32, 4 bytes per parameter).
    """

    def __init__(self, slamb, xp):
        lay, mask = slamb.layout, slamb.comm.mask
        self.xp = xp
        self.key = (xp.__name__, None if xp is np else xp.cuda.Device().id)
        T, N = len(lay), lay.total
        C = self.C = mask.num_chunks if mask.kind == "cyclic" else 1
        self.T, self.N = T, N
        sizes = self.sizes = np.asarray(lay.sizes, np.int64)
        offsets = np.asarray(lay.offsets, np.int64)
        put = (lambda a: a) if xp is np else xp.asarray
        # per-tensor sums over the fused buffer: reduceat over the non-empty tensors' starts
        ne = np.flatnonzero(sizes > 0)
        self.all_full = ne.size == T
        self.seg = put(offsets[ne])
        self.ne = put(ne)
        comp = list(lay.compressible) if C > 1 else []
        is_comp = set(comp)
        dense = [i for i in range(T) if lay.sizes[i] and i not in is_comp]
        # payload counts per chunk: every element of a dense tensor, the mask's count otherwise
        self.counts = np.zeros((C, T), np.int64)
        for j in range(C):
            for i in range(T):
                self.counts[j, i] = mask.count_of_chunk(j, i) if i in is_comp else lay.sizes[i]
        self.starts = np.concatenate([np.zeros((C, 1), np.int64), np.cumsum(self.counts, axis=1)], axis=1)
        self.K = self.starts[:, -1].copy()  # payload size per chunk
        self.everything = not comp  # every element in every step's M_t
        # payload segments per chunk (non-empty counts), as device tables built once
        self.pseg, self.pne, self.pfull = [], [], []
        for j in range(C):
            nz = np.flatnonzero(self.counts[j] > 0)
            self.pseg.append(put(self.starts[j, nz]))
            self.pne.append(put(nz))
            self.pfull.append(nz.size == T)
        if not self.everything:
            units = [lay.sizes[i] for i in comp]
            qs = np.concatenate([[0], np.cumsum(units)])[:-1]
            self.U = int(sum(units))
            self.G = -(-self.U // C)  # groups, the last one possibly partial
            self.unit_end = put(np.asarray(qs + np.asarray(units), np.int64))
            self.shift = put(np.asarray(offsets[comp] - qs, np.int64))
            self.Kc = np.asarray([int(self.counts[j, comp].sum()) for j in range(C)])
            self.h = mask.group_rotations(self.G, xp)
            lut = np.array([[(j - c) % C for c in range(C)] for j in range(C)], np.int64)
            self.lut = put(lut)
            didx = [np.arange(offsets[i], offsets[i] + sizes[i], dtype=np.int64) for i in dense]
            self.dense_idx = put(np.concatenate(didx)) if didx else None
        # per element: tensor * (C + 1) + chunk, chunk C for always-dense elements (freshness 1)
        idx_dtype = np.int32 if T * (C + 1) < 2**31 else np.int64
        cidx = np.repeat(np.arange(T, dtype=np.int64) * (C + 1) + C, sizes).astype(idx_dtype)
        for i in comp:
            o, n = lay.offsets[i], lay.sizes[i]
            cidx[o : o + n] += (mask.element_chunks(i) - C).astype(idx_dtype)
        self.cidx = put(cidx)
        self.mask = mask
        self._tables = {}  # (name, values) -> device array of per-tensor constants
        self._F = {}  # chunk j -> device row of C + 1 freshness values (settled cycles)

    def per_tensor(self, name, values):
        """``values`` (one float per tensor) as a float64 device array, copied when they change
        (a scalar where they are all equal: no array, no copy)."""
        if len(set(values)) <= 1:
            return float(values[0]) if values else 0.0
        key = (name, tuple(values))
        a = self._tables.get(key)
        if a is None:
            self._tables = {k: v for k, v in self._tables.items() if k[0] != name}
            host = np.asarray(values, np.float64)
            a = self._tables[key] = host if self.xp is np else self.xp.asarray(host)
        return a

    def freshness(self, t, beta3):
        """Per chunk, and last for always-dense elements (1), the freshness after step t: a
        float64 device row of C + 1 values; kept per chunk once the mask's first cycle is complete
        (before, one copy per step)."""
        mask = self.mask
        if self.everything:
            j, settled, stale = 0, True, [0] * self.C
        else:
            j = mask.chunk(t)
            settled = int(t) - mask.origin > mask.num_chunks
            stale = mask.staleness(t)
        row = self._F.get(j) if settled else None
        if row is None:
            host = np.asarray([beta3**s for s in stale] + [1.0], np.float64)
            row = host if self.xp is np else self.xp.asarray(host)
            if settled:
                self._F[j] = row
        return row

    def positions(self, j):
        """M_t's positions in the fused buffer for chunk j, increasing (the payload's order)."""
        xp, C = self.xp, self.C
        q = xp.arange(self.G, dtype=np.int64)
        q *= C
        q += xp.take(self.lut[j], self.h)
        q = q[: self.Kc[j]]  # only the last group can select a unit past the end
        pos = q + xp.take(self.shift, xp.searchsorted(self.unit_end, q, side="right"))
        if self.dense_idx is None:
            return pos
        return xp.sort(xp.concatenate((self.dense_idx, pos)))


def _segsum(xp, a, seg, ne, full, T):
    """Per-tensor float64 sums of ``a`` over segments starting at ``seg`` (one entry per
    tensor with elements; ``ne`` their indices, zeros for the others)."""
    s = xp.add.reduceat(a, seg, dtype=np.float64)
    if full:
        return s
    out = xp.zeros(T, np.float64)
    out[ne] = s
    return out


def applies(slamb, x, g, xp, skip):
    """Whether the fused path can take this step (see the module docstring)."""
    mask = slamb.comm.mask
    want = slamb.fused if slamb.fused is not None else xp is not np
    return (want and mask.kind == "cyclic" and mask.block == 1 and not skip and not slamb._fx  # noqa: SLF001
            and mask.settled(slamb.t + 1) and len(slamb.layout) > 0
            and hasattr(x, "shape") and hasattr(g, "shape"))


def step(slamb, x, g, lr=None, weight_decay=None, written=None):
    """One whole SLAMB step on fused buffers ``x`` and ``g`` (see :meth:`Slamb.step`), as a
    constant number of whole-buffer operations. Raises NonFiniteError on every rank (nothing
    changed) if any rank's gradient is bad."""
    lay = slamb.layout
    x, g = _arr.as_array(x), _arr.as_array(g)
    xp = _arr.namespace(x, g)
    for name, a in (("parameters", x), ("gradients", g)):
        if a.shape != (lay.total,) or a.dtype != lay.dtype:
            raise LayoutError(f"{name}: expected a fused buffer of {lay.total} {lay.dtype.name}, "
                              f"got {a.shape} {a.dtype.name}")
    with _arr.device_scope(x):
        slamb._ensure_state(xp, x)  # noqa: SLF001 (this module is Slamb's device step)
        plan = slamb._plan(xp)  # noqa: SLF001
        t = slamb.begin_step()
        try:
            payload, pos = _exchange(slamb, plan, xp, x, g, t)
        except BaseException:
            slamb.abort_step()
            raise
        return _apply(slamb, plan, xp, x, g, t, payload, pos, lr, weight_decay, written)


def _exchange(slamb, plan, xp, x, g, t):
    lay, comm = slamb.layout, slamb.comm
    dt = lay.dtype
    b1 = slamb.betas[0]
    j = comm.mask.chunk(t) if plan.C > 1 else 0
    K = int(plan.K[j])
    pos = None if plan.everything else plan.positions(j)
    payload = xp.empty(K + 1, comm.value_dtype)
    tmp = slamb._buf(xp, "tmp", lay.total, dt)  # noqa: SLF001
    if pos is None:
        vals = _fuse(xp, "slamb_momentum", _momentum)(slamb.m, g, dt.type(b1), dt.type(1.0 - b1))
    else:
        vals = _fuse(xp, "slamb_momentum", _momentum)(xp.take(slamb.m, pos), xp.take(g, pos),
                                                      dt.type(b1), dt.type(1.0 - b1))
    _arr.cast_into(payload[:K], vals)
    del vals
    # a NaN or Inf, or an element whose square overflows v (|g| >= sqrt of the dtype's max)
    with np.errstate(over="ignore", invalid="ignore"):  # NumPy: an overflowing square is what is checked
        bad = ~xp.isfinite(xp.sum(xp.square(g, out=tmp), dtype=np.float64))
    try:
        comm.reduce_checked(payload, None, bad, f"SLAMB momentum exchange at step {t}",
                            spans=(plan.starts[j, :-1], plan.counts[j]))
    except NonFiniteError as e:  # the failure path: name this rank's bad tensors (host reads are fine)
        names = [lay.names[i] for i, v in enumerate(lay.flat_views(g))
                 if v.size and not bool(xp.isfinite(xp.sum(xp.square(v), dtype=np.float64)))]
        if not names:
            raise
        raise NonFiniteError(f"{e} (this rank: non-finite gradient in {names})", e.ranks, names) from None
    nbytes = payload.size * payload.dtype.itemsize
    dense = lay.total * dt.itemsize
    comm.stats.record("masked_allreduce", Traffic(
        1, nbytes, allreduce_wire(nbytes, comm.size), dense, allreduce_wire(dense, comm.size), K, lay.total))
    return payload, pos


def _apply(slamb, plan, xp, x, g, t, payload, pos, lr, weight_decay, written):
    lay, comm = slamb.layout, slamb.comm
    dt = lay.dtype.type
    N, T, C = lay.total, len(lay), plan.C
    P = comm.size
    b1, b2 = slamb.betas
    lr = slamb.lr if lr is None else slamb._per_tensor(lr, "lr")  # noqa: SLF001
    wd = slamb.weight_decay if weight_decay is None else slamb._per_tensor(weight_decay, "weight_decay")  # noqa: SLF001
    m, v = slamb.m, slamb.v
    tmp = slamb._buf(xp, "tmp", N, lay.dtype)  # noqa: SLF001
    w = slamb._buf(xp, "u", N, lay.dtype)  # noqa: SLF001
    # 1. the moments, in place (every rank's status came back good)
    m *= dt(b1)
    xp.multiply(g, dt(1.0 - b1), out=tmp)
    m += tmp
    xp.multiply(g, g, out=tmp)
    tmp *= dt(1.0 - b2)
    v *= dt(b2)
    v += tmp
    # 2. M_t's means
    j = comm.mask.chunk(t) if C > 1 else 0
    K = int(plan.K[j])
    means = _arr.cast(payload[:K], lay.dtype, copy=False)
    if P > 1:
        means = means * dt(1.0 / P)
    if pos is None:
        m[...] = means
    else:
        m[pos] = means
    del means
    # 3. the direction w = m / (sqrt(v) + eps sqrt(1-b2^t)) + (wd / s_u) x, u = s_u w
    s_u = math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
    xp.sqrt(v, out=w)
    w += dt(slamb.eps * math.sqrt(1.0 - b2**t))
    xp.divide(m, w, out=w)
    wdt = plan.per_tensor("wd", wd)
    if isinstance(wdt, float):
        if wdt:
            xp.multiply(x, dt(wdt / s_u), out=tmp)
            w += tmp
    else:  # per element from the (tensor, chunk) index: a table of T (C + 1) entries
        table = xp.repeat((wdt * (1.0 / s_u)).astype(lay.dtype), C + 1)
        xp.take(table, plan.cidx, out=tmp)
        tmp *= x
        w += tmp
    # 4. the per-tensor squared norms: all of x and u, and M_t's part of them
    xx = _segsum(xp, xp.square(x, out=tmp), plan.seg, plan.ne, plan.all_full, T)
    ww = _segsum(xp, xp.square(w, out=tmp), plan.seg, plan.ne, plan.all_full, T)
    if pos is None:
        xs, ws = xx, ww
    else:
        xs = _segsum(xp, xp.square(xp.take(x, pos)), plan.pseg[j], plan.pne[j], plan.pfull[j], T)
        ws = _segsum(xp, xp.square(xp.take(w, pos)), plan.pseg[j], plan.pne[j], plan.pfull[j], T)
    # 5. trust ratios and rates of every tensor (one fused function), then the coefficient table
    lr_t = plan.per_tensor("lr", lr)
    rate_s, rate_a = _rate_pair(xp)(xx, ww, xs, ws, s_u * s_u, lr_t, s_u, 1.0 / math.sqrt(P),
                                    slamb.c_min, slamb.c_max)
    # 6. x -= (rate_S f + rate_A (1 - f)) u, per element from a (tensor, chunk) table
    F = plan.freshness(t, slamb.beta3)
    table = _coefficients(xp)(rate_a[:, None], rate_s[:, None], F[None, :]).astype(lay.dtype)
    coef = xp.take(table.reshape(-1), plan.cidx, out=tmp)
    coef *= w
    x -= coef
    # 7. commit, then the periodic sync
    slamb.t = t
    slamb._t_open = None  # noqa: SLF001
    slamb._payload = None  # noqa: SLF001
    if written is not None:
        for i in range(T):
            written(i)
    if (t - 1) % slamb.sync_interval == 0 and P > 1:
        finite = xp.isfinite(xp.sum(xp.square(x, out=tmp), dtype=np.float64))
        comm.sync(x, written=written, finite=finite)
    return x


def _rate_pair(xp):
    """The fused function on one entry per tensor: ``(rate_S, rate_A)`` = ``(lr s_u phi_S,
    lr s_u / sqrt(P) phi_A)`` from the four squared norms (float64) and ``s2 = s_u^2``."""
    def pair(xx, ww, xs, ws, s2, lr, s_u, inv_sqrt_p, c_min, c_max):
        phi_s = _trust(xp, xs, ws * s2, c_min, c_max)
        phi_a = _trust(xp, xp.maximum(xx - xs, 0.0), xp.maximum(ww - ws, 0.0) * s2, c_min, c_max)
        return lr * s_u * phi_s, lr * s_u * inv_sqrt_p * phi_a
    return _fuse(xp, "slamb_rate_pair", pair)


def _coefficients(xp):
    """The fused function of the (tensor, chunk) table ``rate_A + (rate_S - rate_A) f``."""
    return _fuse(xp, "slamb_coefficients", _blend)
