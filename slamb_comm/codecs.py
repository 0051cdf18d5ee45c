"""Codecs: the fused layout, exact top-k, shared random masks, and the wire layout.

Everything here is pure array code (NumPy or CuPy), with no communication: the
communicator strings these together with a transport.

* :class:`Layout`: many tensors viewed as one contiguous fused buffer, with the
  always-dense rule of ALGORITHM.md section 1 (ndim <= 1 or fewer than
  ``dense_threshold`` elements).
* :func:`topk_indices`: exact top-k by magnitude; :func:`k_elems` the fixed count
  ``max(1, round(ratio * n))`` per tensor, so an allgather needs no size exchange.
* :class:`CyclicMask`, :class:`BernoulliMask`, :class:`TopKUnionMask`: the masks M_t of
  ALGORITHM.md section 1, drawn from generators the mask owns (never a global RNG). Their
  ``select(t)`` gives a :class:`Selection`: the positions of M_t and the gather/scatter on them.
* :class:`TopKWire`: one rank's top-k payload as one byte buffer
  ``[status int32, pad int32 | indices int32 x K | values x K]``.
"""

import hashlib
import math

import numpy as np

from . import arrays as _arr
from .arrays import value_dtype
from .errors import ConfigError, DTypeError

__all__ = [
    "DATA_DTYPES",
    "Layout",
    "check_ratio",
    "k_elems",
    "topk_indices",
    "topk_indices_reference",
    "CyclicMask",
    "BernoulliMask",
    "TopKUnionMask",
    "make_mask",
    "Selection",
    "TopK",
    "TopKWire",
]

#: dtypes of the arrays slamb_comm exchanges (parameters, gradients, momenta).
DATA_DTYPES = ("float16", "float32", "float64")


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


class Layout:
    """A fixed list of tensors fused into one contiguous 1-D buffer.

    Args:
        shapes: the tensors' shapes, in exchange order.
        dtype: the one dtype of the fused buffer (float16, float32 or float64).
        names: optional names (default ``"0"``, ``"1"``, ...), used in error messages.
        dense_threshold: tensors with ndim <= 1 or fewer elements than this are always
            sent whole by masked exchanges (ALGORITHM.md section 1).

    Attributes:
        sizes, offsets: element counts and start offsets of each tensor in the buffer.
        total: the buffer's element count.
        dense: per tensor, whether the always-dense rule applies.
    """

    def __init__(self, shapes, dtype="float32", names=None, dense_threshold=9000):
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        dt = np.dtype(dtype)
        if dt.name not in DATA_DTYPES:
            raise DTypeError(f"unsupported array dtype {dt.name}; slamb_comm exchanges {', '.join(DATA_DTYPES)}")
        self.dtype = dt
        self.names = [str(n) for n in names] if names is not None else [str(i) for i in range(len(self.shapes))]
        if len(self.names) != len(self.shapes):
            raise ConfigError(f"{len(self.names)} names for {len(self.shapes)} tensors")
        if int(dense_threshold) < 0:
            raise ConfigError(f"dense_threshold must be >= 0, got {dense_threshold}")
        self.dense_threshold = int(dense_threshold)
        self.sizes = [int(math.prod(s)) for s in self.shapes]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets.pop()
        self.dense = [len(s) <= 1 or n < self.dense_threshold for s, n in zip(self.shapes, self.sizes)]
        itype = np.int32 if self.total < 2**31 else np.int64
        self.index_dtype = np.dtype(itype)
        parts_dense = [np.arange(o, o + n, dtype=itype) for o, n, d in zip(self.offsets, self.sizes, self.dense) if d]
        parts_comp = [np.arange(o, o + n, dtype=itype) for o, n, d in zip(self.offsets, self.sizes, self.dense) if not d]
        self.dense_index = np.concatenate(parts_dense) if parts_dense else np.zeros(0, itype)
        self.compressible_index = np.concatenate(parts_comp) if parts_comp else np.zeros(0, itype)

    @classmethod
    def from_arrays(cls, arrays, names=None, dense_threshold=9000):
        """The layout of ``arrays`` (all of one dtype)."""
        arrays = list(arrays)
        dtypes = {a.dtype.name for a in arrays}
        if len(dtypes) > 1:
            raise DTypeError(f"arrays of one fused buffer must share a dtype; got {sorted(dtypes)}")
        dtype = dtypes.pop() if dtypes else "float32"
        return cls([a.shape for a in arrays], dtype, names=names, dense_threshold=dense_threshold)

    def __len__(self):
        return len(self.shapes)

    def __repr__(self):
        return f"Layout({len(self)} tensors, {self.total} elements, {self.dtype.name}, {sum(self.dense)} always dense)"

    def describe(self, limit=8):
        """A short human description: tensor names, shapes, dtype."""
        items = [f"{n}{list(s)}" for n, s in zip(self.names[:limit], self.shapes[:limit])]
        more = f", ... ({len(self) - limit} more)" if len(self) > limit else ""
        return f"{len(self)} tensors of {self.dtype.name}, {self.total} elements: {', '.join(items)}{more}"

    def digest(self, *extra):
        """A 16-byte fingerprint of the layout plus ``extra`` options, for cross-rank checks."""
        h = hashlib.sha256(repr((self.shapes, self.dtype.name, self.dense_threshold, extra)).encode())
        return h.digest()[:16]

    def views(self, flat):
        """Per-tensor views (shaped like the tensors) into a fused 1-D buffer."""
        return [flat[o : o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def segments(self):
        """``(offset, size)`` of every tensor."""
        return list(zip(self.offsets, self.sizes))


def topk_indices_reference(x, k):
    """The reference top-k: a stable sort by decreasing magnitude, first ``k``, sorted by index.

    Defines the exact result every faster selection must reproduce: the ``k`` largest
    ``|x|``, ties broken in favour of the lower index, returned in increasing index order.
    O(n log n); used for small inputs and in tests.
    """
    xp = _arr.namespace(x)
    n = x.size
    k = max(0, min(int(k), n))
    order = xp.argsort(-xp.abs(x), kind="stable")[:k]
    return xp.sort(order).astype(np.int64)


#: below this many elements, :func:`topk_indices` just uses the reference sort
_SMALL = 1 << 14


def topk_indices(x, k):
    """Indices of the ``k`` entries of 1-D ``x`` with the largest magnitude, in increasing order.

    Exactly :func:`topk_indices_reference` (ties go to the lower index), but in a few
    linear passes instead of a sort or a full selection: a strided sample of ``|x|``
    estimates a threshold a little below the k-th largest magnitude; one pass keeps the
    candidates above it (about ``1.05 k`` of them); an exact selection among the
    candidates fixes the result up to exactly ``k``. If the estimate overshoots (fewer
    than ``k`` candidates), the threshold is lowered and the pass repeated.

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
    if n <= _SMALL:
        return topk_indices_reference(x, k)
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


_CHUNK = 1 << 18


def _candidates(xp, x, lo):
    """Positions and magnitudes of the entries of ``x`` with ``|x| >= lo``, in order. On the
    CPU in cache-sized chunks: one read of ``x``, no full-size temporaries."""
    if xp is not np:
        mag = xp.abs(x)
        cand = xp.flatnonzero(mag >= lo)
        return cand, mag[cand]
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


class Selection:
    """M_t of one step: the positions in the fused buffer, and the gather and scatter on them.

    ``index`` lists every position in payload order: the always-dense elements, then any
    elements listed one by one, then ``blocks`` (ids of whole runs of ``block`` contiguous
    elements starting at ``id * block``) in order. Element masks have no blocks. With
    blocks, :meth:`take` and :meth:`put` copy whole runs (a near-memcpy) instead of single
    elements (a random access per element).
    """

    def __init__(self, index, blocks=None, block=1):
        self.index = index
        self.size = int(index.size)
        self.block = int(block)
        self.blocks = blocks if blocks is not None and blocks.size else None
        self.head = self.size - (0 if self.blocks is None else self.blocks.size * self.block)

    def __len__(self):
        return self.size

    def __array__(self, dtype=None, copy=None):
        """NumPy sees the positions (``np.asarray(selection)``; host selections only)."""
        return self.index if dtype is None else self.index.astype(dtype)

    def _rows(self, a):
        """``a``'s whole runs as the rows of a 2-D view."""
        return a[: a.size // self.block * self.block].reshape(-1, self.block)

    def _items(self, a):
        """``a``'s whole runs as one opaque item each, so that NumPy's take and put copy a run
        per item (a memcpy) instead of indexing rows."""
        return a[: a.size // self.block * self.block].view(np.dtype((np.void, self.block * a.itemsize)))

    def take(self, a, out=None):
        """``a[index]`` (into ``out`` if given; ``out`` may have another dtype)."""
        xp = _arr.namespace(a)
        if out is None:
            out = xp.empty(self.size, a.dtype)
        head, tail = out[: self.head], out[self.head :]
        if xp is np and out.dtype == a.dtype:  # no bounds checks: the positions come from the mask
            if self.head:
                np.take(a, self.index[: self.head], out=head, mode="clip")
            if self.blocks is not None:
                items = self._items(a)
                np.take(items, self.blocks, out=tail.view(items.dtype), mode="clip")
        else:
            head[...] = a[self.index[: self.head]]
            if self.blocks is not None:
                tail.reshape(-1, self.block)[...] = self._rows(a)[self.blocks]
        return out

    def put(self, a, vals):
        """``a[index] = vals`` (``vals``: an array in payload order, or a scalar)."""
        scalar = not hasattr(vals, "shape")
        if not scalar and _arr.namespace(a) is np and vals.dtype == a.dtype:  # no bounds checks, as in take
            if self.head:
                np.put(a, self.index[: self.head], vals[: self.head], mode="clip")
            if self.blocks is not None:
                items = self._items(a)
                np.put(items, self.blocks, vals[self.head :].view(items.dtype), mode="clip")
            return
        a[self.index[: self.head]] = vals if scalar else vals[: self.head]
        if self.blocks is not None:
            self._rows(a)[self.blocks] = vals if scalar else vals[self.head :].reshape(-1, self.block)


class _Mask:
    kind = ""

    def __init__(self, layout, ratio, seed):
        self.layout = layout
        self.ratio = check_ratio(ratio)
        self.seed = int(seed)
        self._device = {}

    def _on(self, xp, name, host):
        """``host`` on the device of ``xp`` (cached by name)."""
        if xp is np:
            return host
        key = (xp.__name__, name)
        if key not in self._device:
            self._device[key] = xp.asarray(host)
        return self._device[key]

    def _with_dense(self, xp, part, blocks=None, block=1):
        """The Selection of the always-dense positions followed by ``part`` (whose tail is ``blocks``)."""
        dense = self._on(xp, "dense", self.layout.dense_index)
        return Selection(xp.concatenate((dense, part)) if dense.size else part, blocks, block)

    def state_dict(self):
        return {"kind": self.kind, "ratio": self.ratio, "seed": self.seed}


class CyclicMask(_Mask):
    """The paper's random-k mask: chunks of one shared random permutation, in turn.

    At construction, the compressible elements' positions are permuted by a generator
    seeded with ``seed`` (which every rank must share: the communicator broadcasts it
    from rank 0) and cut into ``C = ceil(1 / ratio)`` chunks of near-equal size. Step
    ``t`` (1-based) selects chunk ``(t - 1) mod C`` plus every always-dense element, so
    each compressible element is synchronised exactly once every C steps.

    ``block`` > 1 permutes runs instead of elements: the fused buffer is cut into runs of
    ``block`` contiguous positions (run ``j`` = ``[j*block, (j+1)*block)``), every run
    holding a compressible element takes part in the permutation, and a run is selected
    with all of its compressible elements. Staleness is still exactly C; the gather and
    scatter copy whole runs. ``block=1`` (default) is ALGORITHM.md's element mask.
    """

    kind = "cyclic"

    def __init__(self, layout, ratio, seed, block=1):
        super().__init__(layout, ratio, seed)
        self.block = check_block(block)
        self.num_chunks = math.ceil(1.0 / self.ratio - 1e-9)
        B, comp = self.block, layout.compressible_index
        runs = np.unique(comp // B) if B > 1 else comp
        perm = np.random.Generator(np.random.PCG64(self.seed)).permutation(runs)
        chunks = [np.sort(c) for c in np.array_split(perm, self.num_chunks)]
        if B == 1:
            self._chunks = [(c, None) for c in chunks]
            return
        is_comp = np.zeros(layout.total, bool)
        is_comp[comp] = True
        nb = layout.total // B  # runs that lie wholly inside the buffer
        whole_run = is_comp[: nb * B].reshape(nb, B).all(axis=1)
        offs = np.arange(B, dtype=comp.dtype)
        self._chunks = []  # per chunk: its positions in payload order (loose elements, then whole runs), runs
        for c in chunks:
            whole = c < nb
            whole[whole] = whole_run[c[whole]]
            full, partial = c[whole].astype(comp.dtype), c[~whole].astype(comp.dtype)
            loose = (partial[:, None] * B + offs).ravel()
            loose = loose[loose < layout.total]
            runs = (full[:, None] * B + offs).ravel()
            self._chunks.append((np.concatenate((loose[is_comp[loose]], runs)), full.astype(np.intp)))

    def chunk(self, step):
        return (int(step) - 1) % self.num_chunks

    def select(self, step, xp=np, flat=None, transport=None):
        """M_t as a :class:`Selection`: the dense part first, then the chunk of step ``t``."""
        j = self.chunk(step)
        part, full = self._chunks[j]
        blocks = None if full is None else self._on(xp, ("runs", j), full)
        return self._with_dense(xp, self._on(xp, ("chunk", j), part), blocks, self.block)

    def state_dict(self):
        return {**super().state_dict(), "block": self.block}


def check_block(block):
    """A run length of the cyclic mask: an integer >= 1."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ConfigError(f"block must be an integer >= 1, got {block!r}")
    return int(block)


class BernoulliMask(_Mask):
    """Each compressible element is in M_t with probability ``ratio``, independently.

    Drawn on the host from ``numpy.random.Generator(PCG64([seed, t]))``: the same on every
    rank, reproducible from (seed, t) alone. Staleness is unbounded.
    """

    kind = "bernoulli"

    def select(self, step, xp=np, flat=None, transport=None):
        comp = self.layout.compressible_index
        rng = np.random.Generator(np.random.PCG64([self.seed, int(step)]))
        part = comp[rng.random(comp.size) < self.ratio]
        return self._with_dense(xp, xp.asarray(part) if xp is not np else part)


class TopKUnionMask(_Mask):
    """Each rank picks, per compressible tensor, the ``k_elems(ratio, n)`` largest ``|flat|``;
    M_t is the union over ranks (indices are allgathered first), plus the dense elements.
    """

    kind = "topk"

    def select(self, step, xp=np, flat=None, transport=None):
        if flat is None or transport is None:
            raise ConfigError("the topk mask needs the data and a transport to select indices")
        lay = self.layout
        picks = []
        for (o, n), dense in zip(lay.segments(), lay.dense):
            if not dense:
                picks.append(topk_indices(flat[o : o + n], k_elems(self.ratio, n)).astype(lay.index_dtype) + o)
        local = xp.concatenate(picks) if picks else xp.zeros(0, lay.index_dtype)
        everyone = xp.empty(local.size * transport.size, lay.index_dtype)
        transport.allgather(local, everyone)
        return self._with_dense(xp, xp.unique(everyone))


_MASKS = {m.kind: m for m in (CyclicMask, BernoulliMask, TopKUnionMask)}


def make_mask(kind, layout, ratio, seed, block=1):
    """Build the mask named ``kind`` ('cyclic', 'bernoulli' or 'topk'); ``block`` is the cyclic mask's run length."""
    if kind not in _MASKS:
        raise ConfigError(f"unknown mask {kind!r}; choose one of {sorted(_MASKS)}")
    if kind == "cyclic":
        return CyclicMask(layout, ratio, seed, block)
    if check_block(block) != 1:
        raise ConfigError(f"block={block} applies to the cyclic mask only, not {kind!r}")
    return _MASKS[kind](layout, ratio, seed)


class TopK:
    """The top-k codec as an option: ``compression=slamb_comm.TopK(0.01)`` selects sparse top-k
    gradient exchange with error feedback in the adapters.

    Per tensor, each rank sends the ``max(1, round(ratio * n))`` entries of largest
    magnitude of ``gradient + error`` and keeps the rest in its error buffer; every rank
    receives all ranks' entries and averages them (ALGORITHM.md section 2); then the
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
    """

    def __init__(self, ratio, value_dtype="float32", on_nonfinite="skip"):
        self.ratio = check_ratio(ratio)
        self.value_dtype = _arr.value_dtype(value_dtype).name
        if on_nonfinite not in ("skip", "raise"):
            raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite

    def __repr__(self):
        return f"TopK({self.ratio}, value_dtype={self.value_dtype!r}, on_nonfinite={self.on_nonfinite!r})"

    # A framework's compressor interface (Horovod's), for a clear error if passed to the wrong place.
    def compress(self, tensor):
        """Not a Horovod compressor: raises TypeError naming the right entry point."""
        raise TypeError("slamb_comm.TopK is not a Horovod compressor: pass it to "
                        "slamb_comm.adapters.horovod.DistributedOptimizer, not hvd.DistributedOptimizer")

    decompress = compress


class TopKWire:
    """The wire layout of one rank's top-k payload, and its encode/decode.

    Per tensor i, ``K_i = k_elems(ratio, n_i)`` entries. One rank's payload is one byte
    buffer: an 8-byte header (int32 status, int32 padding), the K = sum K_i local
    indices as int32 (index within its tensor), padding to 8 bytes, then the K values
    in ``value_dtype``. Every rank's payload has the same size, so the allgather needs
    no size exchange.
    """

    HEADER = 8

    def __init__(self, layout, ratio, value_dtype_name="float32"):
        self.layout = layout
        self.ratio = check_ratio(ratio)
        self.value_dtype = value_dtype(value_dtype_name)
        self.counts = [k_elems(self.ratio, n) for n in layout.sizes]
        self.k_total = sum(self.counts)
        self.idx_at = self.HEADER
        self.val_at = self.HEADER + ((4 * self.k_total + 7) // 8) * 8
        self.nbytes = self.val_at + self.value_dtype.itemsize * self.k_total

    def empty(self, xp, ranks=1):
        return xp.zeros(self.nbytes * ranks, dtype=np.uint8)

    def parts(self, buf):
        """``(status, indices, values)`` views of one rank's payload ``buf``."""
        status = buf[:4].view(np.int32)
        idx = buf[self.idx_at : self.idx_at + 4 * self.k_total].view(np.int32)
        val = buf[self.val_at : self.nbytes].view(self.value_dtype)
        return status, idx, val

    def encode(self, flat, out):
        """Select each tensor's top-k of ``flat``, write it into ``out``; return global positions."""
        _, idx, val = self.parts(out)
        xp = _arr.namespace(flat)
        positions = []
        at = 0
        for (o, n), k in zip(self.layout.segments(), self.counts):
            if k == 0:
                continue
            loc = topk_indices(flat[o : o + n], k)
            idx[at : at + k] = loc
            positions.append(loc + o)
            at += k
        pos = xp.concatenate(positions) if positions else xp.zeros(0, np.int64)
        val[...] = flat[pos]
        return pos

    def decode_add(self, buf, out):
        """Add one rank's payload into the fused buffer ``out`` (indices are unique per rank)."""
        _, idx, val = self.parts(buf)
        at = 0
        for (o, n), k in zip(self.layout.segments(), self.counts):
            if k == 0:
                continue
            seg = out[o : o + n]
            seg[idx[at : at + k]] += val[at : at + k].astype(out.dtype, copy=False)
            at += k
