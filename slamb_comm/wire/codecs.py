"""Codecs: exact top-k and the top-k wire layout.

Everything here is pure array code (NumPy or CuPy), with no communication: the
communicator strings these together with a transport. The fused layout of the tensors is
:mod:`slamb_comm.wire.layout`, the masks M_t :mod:`slamb_comm.wire.masks`.

* :func:`topk_indices`: exact top-k by magnitude; :func:`k_elems` the fixed count
  ``max(1, round(ratio * n))`` per tensor, so an allgather needs no size exchange.
* :class:`TopKWire`: one rank's top-k payload as one byte buffer
  ``[status int32, pad int32 | indices int32 x K | pad | values x K | pad]``, 8-byte
  aligned, so that every rank's payload in an allgather buffer starts aligned.
"""

import math
import os

import numpy as np

from .. import arrays as _arr
from ..device import topk_step as _tk
from ..arrays import value_dtype
from ..errors import ConfigError
from .layout import per_tensor

__all__ = [
    "check_ratio",
    "k_elems",
    "topk_indices",
    "topk_indices_reference",
    "TopK",
    "several_ranks",
    "TopKWire",
]

def check_ratio(ratio):
    """Return ``ratio`` as a float, or raise ConfigError unless it lies in (0, 1]."""
    try:
        r = float(ratio)
    except (TypeError, ValueError):
        raise ConfigError(f"ratio must be a number in (0, 1], got {ratio!r}") from None
    if not (0.0 < r <= 1.0):
        raise ConfigError(f"ratio must be in (0, 1], got {ratio!r}")
    return r


def k_elems(ratio, n):
    """The number of elements a top-k codec sends for a tensor of ``n`` elements."""
    if n == 0:
        return 0
    return max(1, min(n, int(round(ratio * n))))


def topk_indices_reference(x, k):
    """The reference top-k: a stable sort by decreasing magnitude, first ``k``, sorted by index.

    Defines the exact result every faster selection must reproduce: the ``k`` largest
    ``|x|``, ties broken in favour of the lower index, returned in increasing index order.
    O(n log n) on the CPU (used for small inputs and in tests); on a GPU a radix sort, with
    no synchronisation with the host.
    """
    xp = _arr.namespace(x)
    n = x.size
    k = max(0, min(int(k), n))
    key = xp.abs(x)
    xp.negative(key, out=key)
    order = xp.argsort(key, kind="stable")[:k]
    return xp.sort(order).astype(np.int64)


#: up to this many elements, :func:`topk_indices` selects the k-th magnitude directly (one
#: partition of the whole input) instead of estimating it from a sample
_SMALL = 1 << 14


def topk_indices(x, k):
    """Indices of the ``k`` entries of 1-D ``x`` with the largest magnitude, in increasing order.

    Exactly :func:`topk_indices_reference` (ties go to the lower index), but in a few
    linear passes instead of a sort or a full selection: a strided sample of ``|x|``
    estimates a threshold a little below the k-th largest magnitude; one pass keeps the
    candidates above it (about ``1.05 k`` of them); an exact selection among the
    candidates fixes the result up to exactly ``k``. If the estimate overshoots (fewer
    than ``k`` candidates), the threshold is lowered and the pass repeated. Up to
    ``_SMALL`` elements, one partition of ``|x|`` gives the k-th largest magnitude directly.

    ``x`` must be finite: the communicator checks that before encoding (a NaN compares
    false and would never be selected).
    """
    xp = _arr.namespace(x)
    n = x.size
    k = int(k)
    if k >= n:
        return xp.arange(n, dtype=np.int64)
    if k <= 0:
        return xp.zeros(0, dtype=np.int64)
    if xp is not np:
        # On a GPU: one stable sort (radix) and no host read; the candidate pass below needs
        # the candidates' count on the host, a synchronisation per tensor.
        return topk_indices_reference(x, k)
    if n <= _SMALL:
        return _select_small(x, k)
    # Strided sample: deterministic, and a perfect quantile sample for sorted inputs.
    sample = xp.sort(xp.abs(x[:: max(64, n // 65536)]))
    s = sample.size
    want = k / n * s  # expected number of sample points above the k-th largest magnitude
    margin = 4.0 * math.sqrt(want + 1.0) + 8
    lo_rank, hi_rank = int(want + margin), int(want - margin)
    while True:
        lo = sample[max(0, s - 1 - lo_rank)]  # a little below the k-th largest magnitude
        cand, vals = _candidates(xp, x, lo)
        if cand.size >= k or lo_rank >= s - 1:
            break
        lo_rank = 2 * lo_rank + 1  # rare: too few candidates, lower the threshold
    if cand.size < k:  # even the sample's minimum is above the k-th largest: every element is a candidate
        cand, vals = xp.arange(n, dtype=np.int64), xp.abs(x)
    c = cand.size
    if c == k:
        return cand.astype(np.int64, copy=False)
    # Elements above ``hi`` are surely in; the k-th largest lies in the band [lo, hi].
    hi = sample[s - 1 - hi_rank] if 0 <= hi_rank < s else None
    n_sure = int(xp.count_nonzero(vals > hi)) if hi is not None else 0
    if hi is not None and n_sure < k:  # (n_sure == k would leave nothing to select in the band)
        band = vals[(vals <= hi)]
        need = k - n_sure
        kth = xp.partition(band, band.size - need)[band.size - need]
    else:  # the upper estimate failed: exact selection over all candidates
        kth = xp.partition(vals, c - k)[c - k]
    above = vals > kth
    n_above = int(xp.count_nonzero(above))
    if n_above < k:  # ties at the k-th magnitude: the lowest indices win
        tie = xp.flatnonzero(vals == kth)[: k - n_above]
        above[tie] = True
    return cand[above].astype(np.int64, copy=False)


def _select_small(x, k):
    """:func:`topk_indices` of a small NumPy ``x`` (0 < k < n): the k-th largest magnitude by one
    partition (linear time, where the reference's stable sort is n log n: 15 against 450 us at
    6,553 elements), every magnitude above it, and of those equal to it the lowest indices."""
    mag = np.abs(x)
    n = mag.size
    part = np.partition(mag, n - k)
    if np.isnan(part[n - k :]).any():  # NaN: the partition ranks it above everything, the reference below
        return topk_indices_reference(x, k)
    kth = part[n - k]
    keep = mag > kth  # fewer than k: they all lie above the k-th largest
    short = k - int(np.count_nonzero(keep))
    if short:
        keep[np.flatnonzero(mag == kth)[:short]] = True
    return np.flatnonzero(keep).astype(np.int64, copy=False)


_CHUNK = 1 << 18


def _candidates(xp, x, lo):
    """Positions and magnitudes of the entries of ``x`` with ``|x| >= lo``, in order, in
    cache-sized chunks: one read of ``x``, no full-size temporaries (NumPy only)."""
    mag, hit = np.empty(min(x.size, _CHUNK), x.dtype), np.empty(min(x.size, _CHUNK), bool)
    cands, vals = [], []
    for o in range(0, x.size, _CHUNK):
        n = min(_CHUNK, x.size - o)
        m, h = mag[:n], hit[:n]
        np.abs(x[o : o + n], out=m)
        np.greater_equal(m, lo, out=h)
        nz = np.flatnonzero(h)
        cands.append(nz + o)
        vals.append(m[nz])
    return np.concatenate(cands), np.concatenate(vals)


def several_ranks():
    """Whether this process was launched as one of several ranks of a job: its launcher's world size
    (torchrun's ``WORLD_SIZE``, Open MPI's ``OMPI_COMM_WORLD_SIZE``, PMI's ``PMI_SIZE``, horovodrun's
    ``HOROVOD_SIZE``) is above 1. Options objects built there keep an invalid option for the
    collective that can tell the other ranks (docs/failures.md)."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE"):
        try:
            if int(os.environ.get(var, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def _topk_options(ratio, value_dtype, on_nonfinite, dense_threshold):
    """:class:`TopK`'s options, checked: ConfigError (or DTypeError) naming the first one out of range."""
    ratio, value_dtype = check_ratio(ratio), _arr.value_dtype(value_dtype).name
    if on_nonfinite not in ("skip", "raise"):
        raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
    if dense_threshold is not None and (isinstance(dense_threshold, bool) or int(dense_threshold) != dense_threshold
                                        or dense_threshold < 0):
        raise ConfigError(f"dense_threshold must be None or an integer >= 0, got {dense_threshold!r}")
    return ratio, value_dtype, on_nonfinite, None if dense_threshold is None else int(dense_threshold)


class TopK:
    """The top-k codec as an option: ``compression=slamb_comm.TopK(0.01)`` selects sparse top-k
    gradient exchange with error feedback in the adapters.

    Per tensor, each rank sends the ``max(1, round(ratio * n))`` entries of largest
    magnitude of ``gradient + error`` and keeps the rest in its error buffer; every rank
    receives all ranks' entries and averages them (docs/algorithm.md section 2); then the
    wrapped optimizer steps on that mean. The allgather's bytes grow with the number of
    ranks: it beats a dense allreduce only while about ``P * ratio * (value + 4 index
    bytes) < 8`` (fp32 dense).

    Args:
        ratio: the fraction k in (0, 1] of every tensor that is sent.
        value_dtype: ``'float32'`` or ``'float16'`` values on the wire.
        on_nonfinite: ``'skip'`` (default): a step with a NaN/Inf gradient on any rank is
            skipped by every rank (gradients become NaN everywhere, so an AMP GradScaler
            skips it too; logged and counted); ``'raise'``: every rank raises NonFiniteError.
            Either way the error buffers do not change.
        dense_threshold: ``None`` (default): no tensor is always dense, every tensor sends
            its ``max(1, round(ratio * n))`` entries, as docs/algorithm.md section 2 says. An int T:
            tensors with ndim <= 1 or fewer than T elements are sent whole every step (SLAMB's
            always-dense rule; biases and small tensors then cost ``n * (value + 4)`` bytes
            but carry no error buffer drift).
    """

    def __init__(self, ratio, value_dtype="float32", on_nonfinite="skip", dense_threshold=None):
        #: this rank's invalid option, kept instead of raised when this process is one of several ranks
        #: (:func:`several_ranks`): the adapter that builds the exchange raises it in its construction
        #: agreement, where the other ranks raise PeerError naming this rank; reading an option raises it
        self.problem = None
        try:
            self._options = _topk_options(ratio, value_dtype, on_nonfinite, dense_threshold)
        except (ValueError, TypeError) as err:
            if not several_ranks():
                raise
            self.problem, self._options = err, (1.0, "float32", "skip", None)

    def _option(self, i):
        if self.problem is not None:
            raise self.problem
        return self._options[i]

    @property
    def ratio(self):
        """The fraction k in (0, 1] of every tensor that is sent."""
        return self._option(0)

    @property
    def value_dtype(self):
        """The values' dtype on the wire, by name."""
        return self._option(1)

    @property
    def on_nonfinite(self):
        """``'skip'`` or ``'raise'``."""
        return self._option(2)

    @property
    def dense_threshold(self):
        """None, or the always-dense rule's threshold."""
        return self._option(3)

    def __repr__(self):
        if self.problem is not None:
            return f"TopK(<invalid: {self.problem}>)"
        return (f"TopK({self.ratio}, value_dtype={self.value_dtype!r}, on_nonfinite={self.on_nonfinite!r}, "
                f"dense_threshold={self.dense_threshold!r})")

    # A framework's compressor interface (Horovod's), for a clear error if passed to the wrong place.
    def compress(self, tensor):
        """Not a Horovod compressor: raises TypeError naming the right entry point."""
        raise TypeError("slamb_comm.TopK is not a Horovod compressor: pass it to "
                        "slamb_comm.adapters.horovod.DistributedOptimizer, not hvd.DistributedOptimizer")

    decompress = compress


class TopKWire:
    """The wire layout of one rank's top-k payload, and its encode/decode.

    Per tensor i, ``K_i = k_elems(ratio, n_i)`` entries (``n_i`` for the layout's always-dense
    tensors when ``whole_dense``). One rank's payload is one byte
    buffer: an 8-byte header (int32 status, int32 padding), the K = sum K_i local
    indices as int32 (index within its tensor), padding to 8 bytes, the K values in
    ``value_dtype``, and padding to 8 bytes. Every rank's payload has the same size, a
    multiple of 8, so the allgather needs no size exchange and rank r's payload at byte
    ``r * nbytes`` of the gathered buffer is aligned for its int32 and float views (a
    GPU faults on a misaligned typed read).

    The whole layout is encoded and decoded at once (:meth:`select`, :meth:`encode`,
    :meth:`decode_all`): on a device a constant number of launches whatever the number of
    tensors -- the selection is the radix select of :mod:`slamb_comm.device.topk_kernels` (its tables
    built once per device: :meth:`device`), the decode whole-buffer operations with the
    per-tensor constants of :meth:`table`; on the CPU, where there are no kernel launches to
    save, tensor by tensor (:func:`topk_indices`' linear-time selection, no temporary of the
    whole buffer's size).
    """

    HEADER = 8

    def __init__(self, layout, ratio, value_dtype_name="float32", whole_dense=False):
        self.layout = layout
        self.ratio = check_ratio(ratio)
        self.value_dtype = value_dtype(value_dtype_name)
        self.counts = [n if whole_dense and d else k_elems(self.ratio, n) for n, d in zip(layout.sizes, layout.dense)]
        self.starts = [0]
        for k in self.counts:
            self.starts.append(self.starts[-1] + k)
        self.k_total = self.starts.pop()
        self.idx_at = self.HEADER
        self.val_at = self.HEADER + ((4 * self.k_total + 7) // 8) * 8
        self.nbytes = ((self.val_at + self.value_dtype.itemsize * self.k_total + 7) // 8) * 8
        self._tables = {}
        self._plans = {}  # (library, device) -> its topk_device.Plan

    def empty(self, xp, ranks=1):
        return xp.zeros(self.nbytes * ranks, dtype=np.uint8)

    def parts(self, buf):
        """``(status, indices, values)`` views of one rank's payload ``buf``."""
        status = buf[:4].view(np.int32)
        idx = buf[self.idx_at : self.idx_at + 4 * self.k_total].view(np.int32)
        val = buf[self.val_at : self.val_at + self.value_dtype.itemsize * self.k_total].view(self.value_dtype)
        return status, idx, val

    def parts_all(self, recv):
        """``(indices, values)`` of every rank's payload in a gathered buffer ``recv`` of
        ``ranks * nbytes`` bytes (1-D, or ``(ranks, nbytes)``): ``(ranks, K)`` views, no copy
        (the whole buffer is viewed as int32 / ``value_dtype``, then sliced; each payload
        starts at a multiple of 8 bytes)."""
        rows = recv.reshape(-1, self.nbytes)
        isz = self.value_dtype.itemsize
        idx = rows.view(np.int32)[:, self.idx_at // 4 : self.idx_at // 4 + self.k_total]
        val = rows.view(self.value_dtype)[:, self.val_at // isz : self.val_at // isz + self.k_total]
        return idx, val

    # ------------------------------------------------------------------ per-tensor constants
    def table(self, xp):
        """The per-tensor constants on ``xp`` (on its current device), built once per device:
        an int64 array of 4 rows of one entry per tensor: the end of each tensor in the fused
        buffer (offset + size), the end of its entries in the payload (start + count), its
        offset, and offset - start. One host-to-device copy, at the first use on a device."""
        key = (xp.__name__, None if xp is np else xp.cuda.Device().id)
        t = self._tables.get(key)
        if t is None:
            off = np.asarray(self.layout.offsets, np.int64).reshape(-1)
            size = np.asarray(self.layout.sizes, np.int64).reshape(-1)
            start = np.asarray(self.starts, np.int64).reshape(-1)
            count = np.asarray(self.counts, np.int64).reshape(-1)
            host = np.stack([off + size, start + count, off, off - start])
            t = self._tables[key] = host if xp is np else xp.asarray(host)
        return t

    def entries(self, xp):
        """Per payload entry (K of them), the tensor it belongs to and that tensor's offset in
        the fused buffer (fused position = local index + offset): two int64 arrays on ``xp``
        (on a device: three operations, no host-to-device copy after the first call)."""
        if xp is np:
            seg = np.repeat(np.arange(len(self.counts), dtype=np.int64), self.counts)
            return seg, np.asarray(self.layout.offsets, np.int64).reshape(-1)[seg]
        t = self.table(xp)
        seg = xp.searchsorted(t[1], xp.arange(self.k_total, dtype=np.int64), side="right")
        return seg, t[2][seg]

    # ------------------------------------------------------------------ selection
    def device(self, xp):
        """The :class:`~slamb_comm.device.topk_step.Plan` of this wire on the current device of
        ``xp`` (its tables copied there at its first use, then kept)."""
        key = (xp.__name__, xp.cuda.Device().id)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _tk.Plan(self, xp)
        return plan

    def select(self, c):
        """Every tensor's top-k of the fused 1-D buffer ``c`` (finite): ``(pos, local)``, the
        fused positions (int64, increasing) and the same as indices within their tensors (what
        the wire carries), in payload order. Exactly :func:`topk_indices_reference` per tensor
        (ties go to the lower index; infinities rank above every finite value).

        On the CPU, per tensor with :func:`topk_indices`. On a device, for all tensors at once:
        the radix select of :mod:`slamb_comm.device.topk_kernels` (float32: 4 kernels reading ``c``
        once each, no sort, no host read) and one cast of the indices.
        """
        xp = _arr.namespace(c)
        K = self.k_total
        lay = self.layout
        if xp is np:
            pos = np.empty(K, np.int64)
            local = np.empty(K, np.int64)
            for o, n, a, k in zip(lay.offsets, lay.sizes, self.starts, self.counts):
                if k:
                    loc = topk_indices(c[o : o + n], k)
                    local[a : a + k] = loc
                    np.add(loc, o, out=pos[a : a + k])
            return pos, local
        if K == 0:
            return xp.zeros(0, np.int64), xp.zeros(0, np.int64)
        return self.device(xp).select(c)

    def encode_one(self, i, x, idx, val):
        """Write tensor ``i``'s top-k of the 1-D array ``x`` into the payload's ``idx``/``val``
        views (from :meth:`parts`); return the local positions (int64, increasing)."""
        a, k = self.starts[i], self.counts[i]
        loc = topk_indices(x, k)
        if k:
            idx[a : a + k] = loc
            val[a : a + k] = x[loc]
        return loc

    def encode(self, x, out):
        """Encode every tensor of ``x`` (a fused buffer, or a list of arrays shaped like the
        layout) into the payload ``out``; return the fused positions sent (int64). On a device the
        kernels of :meth:`select` write the payload (a list is read where it is, not fused)."""
        _, idx, val = self.parts(out)
        xp = _arr.namespace(out)
        if isinstance(x, (list, tuple)) or not (hasattr(x, "shape") or hasattr(x, "__dlpack__")):
            views = per_tensor(self.layout, x)
            c = [views[i] for i in range(len(self.layout))]
        else:
            c = _arr.as_array(x).reshape(-1)
        if xp is not np:
            pos = xp.empty(self.k_total, np.int64)
            if self.k_total:
                self.device(xp).encode(c, None, idx, val, None, False, pos)
            return pos
        if isinstance(c, list):
            c = np.concatenate(c) if c else np.zeros(0, self.layout.dtype)
        pos, local = self.select(c)
        self.write(c, pos, local, idx, val)
        return pos

    def write(self, c, pos, local, idx, val):
        """The payload's indices and values from :meth:`select`'s ``(pos, local)`` of ``c`` (NumPy)."""
        if not self.k_total:
            return
        idx[...] = local
        val[...] = c[pos]

    # ------------------------------------------------------------------ decoding
    def decode_all(self, recv, out, offsets=None):
        """Add every rank's payload of the gathered buffer ``recv`` into the fused buffer ``out``,
        rank after rank, in order: bitwise :meth:`decode_add` of each rank in turn. On a device,
        a constant number of operations per rank (one indexed add: the indices are unique within
        a rank's payload), none per tensor; ``offsets``: :meth:`entries`' second array, if the
        caller has it. On the CPU, tensor by tensor (no temporary of the payload's size)."""
        if not self.k_total:
            return out
        xp = _arr.namespace(out)
        if xp is np:
            views = self.layout.flat_views(out)
            for row in recv.reshape(-1, self.nbytes):
                self.decode_add(row, views)
            return out
        idx, val = self.parts_all(recv)
        if offsets is None:
            offsets = self.entries(xp)[1]
        pos = idx + offsets  # int64, fused positions, (ranks, K)
        if val.dtype != out.dtype:
            val = val.astype(out.dtype)
        for r in range(pos.shape[0]):
            out[pos[r]] += val[r]
        return out

    def decode_add(self, buf, out):
        """Add one rank's payload into ``out`` (a fused buffer, or a list of per-tensor arrays);
        the indices are unique within a rank's tensor, so a plain indexed add is exact."""
        if not isinstance(out, (list, tuple)) and hasattr(out, "shape") and _arr.namespace(buf) is not np:
            self.decode_all(buf, _arr.as_array(out))
            return
        _, idx, val = self.parts(buf)
        for i, seg in enumerate(per_tensor(self.layout, out)):
            a, k = self.starts[i], self.counts[i]
            if k:
                seg[idx[a : a + k]] += val[a : a + k].astype(seg.dtype, copy=False)
