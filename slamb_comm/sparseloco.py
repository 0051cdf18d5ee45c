"""SparseLoCo on the core, and its shared-mask variant (docs/algorithm.md section 14).

SparseLoCo (Sarfi, Thérien, Lidin & Belilovsky, 2025, arXiv:2508.15706) is DiLoCo's outer
loop (docs/algorithm.md section 12) with the pseudo-gradient sent sparse: every
``sync_interval`` (H) inner steps, on every rank r, with fused buffers of N elements::

    e_r    = beta * e_r + (anchor - x_r)        # the error-feedback accumulator, per rank
    s_r    = Q(TopK(e_r))                       # per chunk of the fused buffer: its top-k, quantized
    e_r    = e_r - s_r                          # what was not sent (and the rounding) stays
    anchor = anchor - outer_lr * (1/P) sum_r s_r
    x_r    = anchor                             # on every rank; no outer momentum

* :class:`SparseLoCo`: TopK keeps, per chunk of ``chunk`` consecutive elements of the fused
  buffer, the ``topk`` entries of largest ``|e_r|``; Q rounds them to ``bits`` bits with one
  float32 scale per chunk (:class:`ChunkTopK`). Every rank picks its own positions, so the
  payloads travel in one all-gather of ``ChunkTopK.nbytes`` bytes per rank: the wire per link
  is ``(P - 1) * nbytes`` and grows with the number of ranks.
* :class:`SharedMaskSparseLoCo`: TopK is replaced by the shared cyclic mask M_j of outer step
  j (:class:`~slamb_comm.masks.CyclicMask`, docs/algorithm.md section 1 step 2), the same
  positions on every rank, so the exchange is ONE allreduce of the ``|M_j|`` values (in
  ``value_dtype``, float16 by default) whatever P: wire ``2 (P - 1)/P * (|M_j| + 1) * itemsize``.
  No b-bit code is sent there: a sum of P codes needs ``b + log2 P`` bits and the ranks' scales
  differ, so b-bit values cannot stay b bits through a ring's partial sums. Each rank rounds its
  values to float16 (the error buffer keeps the rounding) and the float16 sums are checked.

**An index costs ceil(log2 chunk) bits on the wire, 12 at the default chunk of 4096.** Every
chunk sends exactly ``topk`` entries (the shorter last chunk ``ceil(topk L / chunk)`` of its L),
so an entry's chunk is implied by its place in the payload and only its offset within the chunk
travels, packed with its b-bit value code into one field of ``ceil(log2 chunk) + bits`` bits.
The width is fixed so that every rank's payload has the same, known size (an all-gather needs
it) and decoding is shifts and masks; an entropy code of the sorted offsets would need about
log2 C(4096, 64) / 64 = 7.4 bits per index and is not done. At the defaults (chunk 4096,
topk 64, 2 bits) a chunk costs 64 x 14 bits + a 4-byte scale = 116 bytes for 16,384 bytes of
float32: 0.71% of a dense step's payload per outer step, 0.014% per inner step at H = 50.

Both classes share :mod:`slamb_comm.periodic`'s construction (collective agreement on arrays and
options, x broadcast from rank 0), state (``anchor``, equal on every rank; ``error``, per rank)
and checks: a rank with bad input or a non-finite accumulator flags its status word, and every
rank raises (PeerError, the rank's own error, or NonFiniteError) with nothing changed.
"""

import time

import numpy as np

from . import arrays as _arr
from .codecs import Layout, check_ratio
from .communicator import Communicator
from .errors import (
    collective_error,STATUS_BAD_INPUT, STATUS_NON_FINITE, STATUS_OK, ConfigError, DTypeError, SlambCommError)
from .periodic import DEFAULT_INTERVAL, check_number, host_copy, Periodic, check_interval
from .stats import Traffic, allgather_wire, allreduce_wire

__all__ = ["ChunkTopK", "SparseLoCo", "SharedMaskSparseLoCo", "BITS", "pack_bits", "unpack_bits"]

#: the value codes SparseLoCo sends: 2, 4 or 8-bit levels with a float32 scale per chunk, or 32:
#: the values as float32 (no scale; for comparisons and exact tests)
BITS = (2, 4, 8, 32)


def _pad8(n):
    return -(-n // 8) * 8


def pack_bits(fields, width, out):
    """Write the unsigned integers ``fields`` (each < 2**width) as one little-endian bit stream
    into the uint8 array ``out``: field j holds stream bits ``[j width, (j + 1) width)``, least
    significant first, and stream bit b is bit ``b mod 8`` of byte ``b div 8``. Scratch: one byte
    per bit of the stream."""
    xp = _arr.namespace(fields)
    f = fields.astype(np.uint64, copy=False)
    bits = xp.empty((f.size, width), np.uint8)
    for j in range(width):
        bits[:, j] = (f >> np.uint64(j)) & np.uint64(1)
    packed = xp.packbits(bits.reshape(-1), bitorder="little")
    out[: packed.size] = packed
    return out


def unpack_bits(stream, width, count):
    """The inverse of :func:`pack_bits`: ``count`` fields of ``width`` bits from ``stream``
    (uint8, shape ``(..., bytes)``), as uint64 of shape ``(..., count)``."""
    xp = _arr.namespace(stream)
    bits = xp.unpackbits(stream, bitorder="little").reshape(stream.shape[:-1] + (-1,))  # row by row
    bits = bits[..., : count * width].reshape(stream.shape[:-1] + (count, width))
    out = xp.zeros(bits.shape[:-1], np.uint64)
    for j in range(width):
        out |= bits[..., j].astype(np.uint64) << np.uint64(j)
    return out


class ChunkTopK:
    """SparseLoCo's wire format: chunk-wise top-k of a fused buffer, b-bit values, packed.

    Args:
        total: N, the fused buffer's elements (>= 1).
        chunk: s, the elements per chunk: chunk c is ``[c s, min((c + 1) s, N))`` of the fused
            buffer, across tensor boundaries (2 <= s <= 2**24).
        topk: k, the entries a full chunk sends (1 <= k <= s); the last chunk, of L <= s
            elements, sends ``k_last = ceil(k L / s)``.
        bits: the value code: 2, 4 or 8 (levels with a float32 scale per chunk) or 32 (float32).

    The quantizer of a chunk with kept values v, in sign and magnitude: the scale
    ``a = float32(max |v|)``, ``M = 2**(bits - 1)`` magnitudes ``a j / M`` (j = 1..M), the
    code ``(v < 0) << (bits - 1) | (j - 1)`` with ``j = clip(rint(|v| / a * M), 1, M)``, and the
    value decoded ``(1 - 2 sign) (a j) / M`` (0 where a = 0). 2 bits: -a, -a/2, a/2, a. The
    kept values are the chunk's largest magnitudes, so no level is spent near zero.

    The payload (uint8, :attr:`nbytes`): an 8-byte header (int32 status word, 4 zero bytes); the
    chunks' float32 scales (``pad8(4 n_chunks)`` bytes, absent for bits = 32); then the K entries,
    chunk by chunk, each ``(offset << bits) | code`` in :attr:`width` bits, bit-packed
    (:func:`pack_bits`), ``pad8(ceil(K width / 8))`` bytes.
    """

    def __init__(self, total, chunk=4096, topk=64, bits=2):
        if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 1:
            raise ConfigError(f"SparseLoCo needs at least one element to exchange, got {total!r}")
        self.total, self.s, self.bits = int(total), _int_in("chunk", chunk, 2, 1 << 24), bits
        self.k = _int_in("topk", topk, 1, self.s, f"at most chunk = {self.s}; the paper sends 1-3% of each chunk")
        if bits not in BITS or isinstance(bits, bool):
            raise ConfigError(f"bits must be one of {BITS} (2, the paper's; 32 sends float32 values), got {bits!r}")
        self.n_chunks = -(-self.total // self.s)
        self.last = self.total - (self.n_chunks - 1) * self.s  # the last chunk's length L
        self.k_last = min(self.last, -(-self.k * self.last // self.s))
        self.full = self.n_chunks if self.last == self.s else self.n_chunks - 1  # chunks of exactly s
        self.K = self.full * self.k + (0 if self.last == self.s else self.k_last)
        self.index_bits = max(1, (self.s - 1).bit_length())
        self.width = self.index_bits + bits
        self.scale_bytes = 0 if bits == 32 else _pad8(4 * self.n_chunks)
        self.entry_bytes = _pad8(-(-self.K * self.width // 8))
        self.nbytes = 8 + self.scale_bytes + self.entry_bytes
        counts = [self.k] * self.full + ([] if self.last == self.s else [self.k_last])
        self.entry_chunk = np.repeat(np.arange(self.n_chunks, dtype=np.int64), counts)  # K host integers
        self._dev = {}

    def _chunk_of(self, xp):
        key = (xp.__name__, None if xp is np else xp.cuda.Device().id)
        if key not in self._dev:
            self._dev[key] = self.entry_chunk if xp is np else xp.asarray(self.entry_chunk)
        return self._dev[key]

    def select(self, e):
        """Each chunk's top-k of ``|e|`` (a fused 1-D buffer of N elements): ``(offsets within the
        chunk, int64 [K]; values [K])``, chunk by chunk. Ties: in the order argpartition leaves them."""
        xp, s, k = _arr.namespace(e), self.s, self.k
        offs, vals = [], []
        for n, w, kk, lo in ((self.full, s, k, 0), (int(self.last != s), self.last, self.k_last, self.full * s)):
            if not n:
                continue
            c = e[lo : lo + n * w].reshape(n, w)
            i = xp.argpartition(xp.abs(c), w - kk, axis=1)[:, w - kk :] if kk < w else \
                xp.broadcast_to(xp.arange(w), (n, w))
            offs.append(i.reshape(-1).astype(np.int64))
            vals.append(xp.take_along_axis(c, i, axis=1).reshape(-1))
        return xp.concatenate(offs), xp.concatenate(vals)

    def scales(self, vals):
        """Per chunk, ``max |v|`` of its kept values as float32 (may overflow to Inf: rejected)."""
        xp = _arr.namespace(vals)
        a = xp.abs(vals)
        parts = []
        if self.full:
            parts.append(a[: self.full * self.k].reshape(self.full, self.k).max(axis=1))
        if self.last != self.s:
            parts.append(a[self.full * self.k :].max(keepdims=True))
        with np.errstate(over="ignore"):
            return xp.concatenate(parts).astype(np.float32)

    def quantize(self, vals, scales):
        """The codes (uint64 [K]) of ``vals`` under the chunks' ``scales`` (see the class docstring)."""
        xp = _arr.namespace(vals)
        if self.bits == 32:
            with np.errstate(over="ignore"):
                return vals.astype(np.float32).view(np.uint32).astype(np.uint64)
        M = 1 << (self.bits - 1)
        a = scales.astype(vals.dtype)[self._chunk_of(xp)]
        with np.errstate(invalid="ignore", divide="ignore"):  # a NaN/Inf scale: the step is rejected
            j = xp.clip(xp.rint(xp.abs(vals) / xp.where(a > 0, a, 1) * M), 1, M).astype(np.uint64)
        return ((vals < 0).astype(np.uint64) << np.uint64(self.bits - 1)) | (j - np.uint64(1))

    def dequantize(self, codes, scales, dtype):
        """The values (``dtype``) that ``codes`` stand for: exactly what every rank decodes."""
        dtype = np.dtype(dtype)
        if self.bits == 32:
            return codes.astype(np.uint32).view(np.float32).astype(dtype)
        xp, M = _arr.namespace(codes), 1 << (self.bits - 1)
        a = scales.astype(dtype)[self._chunk_of(xp)]
        j = ((codes & np.uint64(M - 1)) + np.uint64(1)).astype(dtype)
        sign = 1 - 2 * (codes >> np.uint64(self.bits - 1)).astype(dtype)
        return sign * (a * j) / dtype.type(M)

    def parts(self, buf):
        """Views of a payload (uint8): (status int32[1], scales float32[n_chunks] or None, entry bytes)."""
        scales = None if self.bits == 32 else buf[8 : 8 + 4 * self.n_chunks].view(np.float32)
        return buf[:4].view(np.int32), scales, buf[8 + self.scale_bytes : self.nbytes]

    def encode(self, e, buf):
        """Select, quantize and pack ``e`` into the payload ``buf``. Returns ``(positions in the
        fused buffer, int64 [K]; the values as decoded, e's dtype [K]; ok)``, ``ok`` (a bool or a
        0-d device array) false where a scale or a float32 value is not finite."""
        xp = _arr.namespace(e)
        offs, vals = self.select(e)
        _, sc, entries = self.parts(buf)
        a = self.scales(vals) if self.bits != 32 else None
        codes = self.quantize(vals, a)
        if a is not None:
            sc[...] = a
            ok = xp.isfinite(a).all()
        else:
            ok = xp.isfinite(codes.astype(np.uint32).view(np.float32)).all()
        pack_bits((offs.astype(np.uint64) << np.uint64(self.bits)) | codes, self.width, entries)
        pos = self._chunk_of(xp) * self.s + offs
        return pos, self.dequantize(codes, a, e.dtype), ok

    def decode(self, buf, dtype):
        """One payload (uint8 [nbytes]) -> ``(positions in the fused buffer, int64 [K]; values [K]
        in dtype)``. Scratch: about ``K (width + 40)`` bytes."""
        xp, dtype = _arr.namespace(buf), np.dtype(dtype)
        fields = unpack_bits(buf[8 + self.scale_bytes : self.nbytes], self.width, self.K)
        codes = fields & np.uint64((1 << self.bits) - 1)
        pos = self._chunk_of(xp) * self.s + (fields >> np.uint64(self.bits)).astype(np.int64)
        scales = None if self.bits == 32 else buf[8 : 8 + 4 * self.n_chunks].copy().view(np.float32)
        return pos, self.dequantize(codes, scales, dtype)

    def mean(self, bufs, dtype):
        """``(1/P) sum_r decode(bufs[r])`` as a fused buffer in ``dtype`` (``bufs``: ``(P, nbytes)``):
        decoded and added rank by rank in rank order (positions are unique within a payload), so
        the scratch does not grow with P and every rank gets the same bits."""
        xp = _arr.namespace(bufs)
        out = xp.zeros(self.total, dtype)
        for r in range(bufs.shape[0]):
            pos, vals = self.decode(bufs[r], dtype)
            out[pos] += vals
        out *= out.dtype.type(1.0 / bufs.shape[0])
        return out


def _int_in(name, v, lo, hi, fix=""):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}" + (f"; {fix}" if fix else ""))
    return int(v)


def _dtype_of(x):
    """The float dtype of ``x`` (a list of arrays or a fused buffer): float32 or float64."""
    if isinstance(x, (list, tuple)) and not x:
        return  # the layout's own check names the problem
    dt = getattr(_arr.as_array(x[0] if isinstance(x, (list, tuple)) else x), "dtype", None)
    if dt is not None and dt.name not in ("float32", "float64"):
        raise DTypeError(f"SparseLoCo keeps its anchor and error in the arrays' dtype, got {dt.name}: pass float32 "
                         "(or float64) arrays, e.g. a float32 copy of 16-bit parameters")


class _SparseOuter(Periodic):
    """What the two variants share: options, the fold into e, the outer step, the state."""

    def _init(self, transport, x, names, check, options, value_dtype, bucket_bytes):
        def checks():
            _dtype_of(x)
            self.sync_interval = check_interval("sync_interval", self._H, f"the paper uses 15 to 250; "
                                                f"this library's default is {DEFAULT_INTERVAL}")
            self.outer_lr = check_number("outer_lr", self._lr, lambda v: v > 0, "a finite number > 0",
                                          "1 applies the mean of the sparse updates as it is")
            self.beta = check_number("beta", self._beta, lambda v: 0 <= v <= 1, "a number in [0, 1]",
                                      "the error feedback's decay; 0.95 is the default")
            check()

        def all_options():
            return dict(options(), sync_interval=self.sync_interval, outer_lr=self.outer_lr, beta=self.beta)

        xp, views, flat = self._setup(transport, x, names, all_options, checks, value_dtype, bucket_bytes)
        with _arr.device_scope(views[0]):
            self.anchor = flat.copy() if flat is not None else xp.concatenate(views)
            self.error = xp.zeros_like(self.anchor)

    def due(self):
        """Whether the next :meth:`step` is an outer step (it then needs x)."""
        return (self.t + 1) % self.sync_interval == 0

    def _local(self, x):
        """``(xp, views, flat, None)`` of this rank's x, or ``(xp, None, None, error)`` for input this
        rank must reject (it still takes part in the exchange, flagged)."""
        try:
            if x is None:
                raise ConfigError(f"{self.kind} step {self.t} is an outer step: pass x to step()")
            return (*self._views(x), None)
        except (SlambCommError, TypeError) as e:
            return _arr.namespace(self.anchor), None, None, e

    def _fold(self, xp, views, flat):
        """The new accumulator ``beta e + (anchor - x)`` (a new array; e is not changed) and
        whether it is finite (a bool, or a 0-d device array)."""
        if flat is not None:
            d = self.anchor - flat
        else:
            d = xp.concatenate(views)
            xp.subtract(self.anchor, d, out=d)
        if self.beta:
            d += self.anchor.dtype.type(self.beta) * self.error
        return d, xp.isfinite(d).all()

    def _apply(self, views, flat):
        """x = anchor on this rank (in place)."""
        if flat is not None:
            flat[...] = self.anchor
        else:
            for v, o, n in zip(views, self.layout.offsets, self.layout.sizes):
                v[...] = self.anchor[o : o + n]

    def state_dict(self):
        """The step count, the anchor (equal on every rank) and this rank's error accumulator
        (host copies); loading it back on the same rank continues bitwise."""
        return dict(self._base_state(), anchor=host_copy(self.anchor), error=host_copy(self.error))

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly (onto the device of the current anchor)."""
        self._load_arrays(state, ("anchor", "error"))


class SparseLoCo(_SparseOuter):
    """SparseLoCo's outer loop on a fixed list of arrays (docs/algorithm.md section 14).

    Call :meth:`step` on every rank after every inner step; at steps with ``t % sync_interval
    == 0`` it runs the rule of the module docstring: one all-gather of :attr:`codec`'s payload
    (``codec.nbytes`` bytes per rank, wire ``(P - 1) * nbytes``), then x = anchor everywhere.

    Args:
        transport: a transport, or None for one process. x: this rank's parameters (a list of
            float32/float64 arrays, or one fused 1-D buffer), overwritten with rank 0's at
            construction (collective).
        sync_interval: H, inner steps between outer steps (default 50; the paper: 15 to 250).
        outer_lr: applied to the mean of the sparse updates (default 1.0).
        beta: the error feedback's decay in [0, 1] (default 0.95).
        chunk, topk, bits: the wire format (:class:`ChunkTopK`): 4096, 64 (1.56%), 2.
        names, bucket_bytes: as :class:`~slamb_comm.periodic.DiLoCo`.

    Attributes: ``anchor`` (fused, equal on every rank), ``error`` (this rank's accumulator),
    ``codec``, ``t``, ``stats`` (kind ``'sparseloco_allgather'``).

    Costs of an outer step: the new accumulator (N elements, committed in place of the old one),
    one ``argpartition`` over all full chunks and one for the last, the packing of K entries, the
    all-gather (``P * nbytes`` received), the P payloads decoded one at a time (about
    ``K (width + 40)`` bytes of scratch each) and one host read (the status words). Memory kept:
    ``anchor`` and ``error``, 2N elements.
    """

    kind = "SparseLoCo"

    def __init__(self, transport, x, *, sync_interval=DEFAULT_INTERVAL, outer_lr=1.0, beta=0.95, chunk=4096,
                 topk=64, bits=2, names=None, bucket_bytes=32 << 20):
        self._H, self._lr, self._beta = sync_interval, outer_lr, beta

        def check():
            n = sum(int(np.prod(np.shape(a))) for a in x) if isinstance(x, (list, tuple)) else int(np.size(x))
            self.codec = ChunkTopK(n, chunk, topk, bits)

        def options():
            c = self.codec
            return {"chunk": c.s, "topk": c.k, "bits": c.bits}

        self._init(transport, x, names, check, options, None, bucket_bytes)

    def step(self, x=None):
        """Count one inner step; at an outer step (see :meth:`due`) run it on ``x`` in place and
        return True. Collective at outer steps. Raises on every rank with nothing changed but the
        count: NonFiniteError (a non-finite accumulator or scale), PeerError / LayoutError."""
        self.t += 1
        if self.t % self.sync_interval:
            return False
        t0 = time.perf_counter()
        xp, views, flat, problem = self._local(x)
        codec, lay, P = self.codec, self.layout, self.transport.size
        with _arr.device_scope(self.anchor):
            send = xp.zeros(codec.nbytes, np.uint8)
            status = codec.parts(send)[0]
            status[...] = STATUS_BAD_INPUT
            if problem is None:
                e, ok = self._fold(xp, views, flat)
                pos, sent, ok2 = codec.encode(e, send)
                status[...] = xp.where(ok & ok2, STATUS_OK, STATUS_NON_FINITE)
            t1 = time.perf_counter()
            recv = xp.empty(P * codec.nbytes, np.uint8)
            self.transport.allgather(send, recv)
            t2 = time.perf_counter()
            recv = recv.reshape(P, codec.nbytes)
            dense = lay.total * self.dtype.itemsize
            traffic = (lambda enc, comm, dec: Traffic.one_call(
                payload_bytes=codec.nbytes, wire_bytes=allgather_wire(codec.nbytes, P), dense_bytes=dense, size=P,
                elements_sent=codec.K, elements_total=lay.total, encode_s=enc, comm_s=comm, decode_s=dec))
            codes = _arr.to_host(recv[:, :4].copy().view(np.int32)).ravel().tolist()  # the one host read
            if any(codes):
                with self.stats.failed("sparseloco_allgather", lambda: traffic(t1 - t0, t2 - t1, 0.0)):
                    raise collective_error(codes, problem, f"SparseLoCo outer step at t = {self.t}",
                                           nonfinite="non-finite pseudo-gradient or accumulator (NaN/Inf)")
            mean = codec.mean(recv, self.dtype)
            e[pos] -= sent  # what this rank sent leaves its accumulator (values as decoded)
            mean *= self.dtype.type(self.outer_lr)
            self.anchor -= mean
            self.error = e
            self._apply(views, flat)
        self.stats.record("sparseloco_allgather", traffic(t1 - t0, t2 - t1, time.perf_counter() - t2))
        return True


class SharedMaskSparseLoCo(_SparseOuter):
    """SparseLoCo with the shared cyclic mask for top-k (docs/algorithm.md section 14): ONE
    allreduce per outer step, whose payload and wire do not grow with the number of ranks.

    At outer step j (the j-th call with ``t % sync_interval == 0``), with M_j the cyclic mask's
    step-j positions (the same on every rank; every compressible element once every
    ``C = ceil(1/ratio)`` outer steps, always-dense tensors every time)::

        e_r      = beta * e_r + (anchor - x_r)
        s_r      = round_to(value_dtype, e_r[M_j])     # sent
        e_r[M_j] = e_r[M_j] - s_r
        anchor[M_j] = anchor[M_j] - outer_lr * (1/P) sum_r s_r     # one allreduce, then / P
        x_r      = anchor

    The sum travels in ``value_dtype`` (float16 by default: 2 bytes per entry and no index, against
    SparseLoCo's ``index_bits + bits`` = 14 bits and a scale per chunk); it is divided by P in the
    arrays' dtype. A sum that overflows float16 raises NonFiniteError on every rank, nothing changed.

    Args:
        transport, x, sync_interval, outer_lr, beta, names, bucket_bytes: as :class:`SparseLoCo`.
        ratio: the mask's density k in (0, 1] (default 1/64, SparseLoCo's density at its defaults).
        value_dtype: 'float16' (default), 'float32', or None (the arrays' dtype: exact, for tests).
        seed: the mask's seed (default 0; the same on every rank, checked at construction).
        dense_threshold: tensors with ndim <= 1 or fewer elements go whole every outer step
            (default 9000, the Communicator's).

    Attributes: as :class:`SparseLoCo`, with ``comm`` the masked :class:`Communicator` (its
    ``mask``), and ``stats`` kind ``'sparseloco_allreduce'``.
    """

    kind = "SharedMaskSparseLoCo"

    def __init__(self, transport, x, *, sync_interval=DEFAULT_INTERVAL, outer_lr=1.0, beta=0.95, ratio=1 / 64,
                 value_dtype="float16", seed=0, dense_threshold=9000, names=None, bucket_bytes=32 << 20):
        self._H, self._lr, self._beta = sync_interval, outer_lr, beta

        def check():
            self.ratio = check_ratio(ratio)
            self.seed = _int_in("seed", seed, 0, (1 << 62) - 1)
            self.dense_threshold = _int_in("dense_threshold", dense_threshold, 0, 1 << 62)
            if value_dtype is not None:
                _arr.value_dtype(value_dtype)  # DTypeError naming the choices

        def options():
            return {"ratio": self.ratio, "seed": self.seed, "dense_threshold": self.dense_threshold}

        self._init(transport, x, names, check, options, value_dtype, bucket_bytes)
        lay = self.layout
        stats = self.stats
        self.comm = Communicator(self.transport, Layout(lay.shapes, lay.dtype, names=lay.names,
                                                        dense_threshold=self.dense_threshold),
                                 ratio=self.ratio, mask="cyclic", value_dtype=self.value_dtype, seed=self.seed,
                                 bucket_bytes=bucket_bytes)
        self.comm.stats = self.stats = stats  # one record of the start's broadcast and every exchange

    def step(self, x=None):
        """As :meth:`SparseLoCo.step`, through one masked allreduce (see the class docstring)."""
        self.t += 1
        if self.t % self.sync_interval:
            return False
        t0 = time.perf_counter()
        j = self.t // self.sync_interval
        xp, views, flat, problem = self._local(x)
        lay, P, vd = self.layout, self.transport.size, self.value_dtype
        with _arr.device_scope(self.anchor):
            sel = self.comm.select(j, xp)
            m = sel.size
            buf = xp.zeros(m + 1, vd)
            bad, sent = False, None
            if problem is None:
                e, ok = self._fold(xp, views, flat)
                bad = ~ok if xp is not np else not bool(ok)
                vals = sel.take(e)
                sent = _arr.cast(vals, vd)
                buf[:m] = sent
            t1 = time.perf_counter()
            payload, dense = (m + 1) * vd.itemsize, lay.total * self.dtype.itemsize
            traffic = (lambda enc, comm, dec: Traffic.one_call(
                payload_bytes=payload, wire_bytes=allreduce_wire(payload, P), dense_bytes=dense, size=P,
                elements_sent=m, elements_total=lay.total, encode_s=enc, comm_s=comm, decode_s=dec))
            with self.stats.failed("sparseloco_allreduce", lambda: traffic(t1 - t0, time.perf_counter() - t1, 0.0)):
                self.comm.reduce_checked(buf, problem, bad, f"SharedMaskSparseLoCo outer step {j} (t = {self.t})",
                                         (sel.starts, sel.counts), sent=lambda: sent)
            t2 = time.perf_counter()
            mean = _arr.cast(buf[:m], self.dtype)  # the sum, widened before dividing (it may exceed float16)
            if P > 1:
                mean *= self.dtype.type(1.0 / P)
            mean *= self.dtype.type(self.outer_lr)
            vals -= _arr.cast(sent, self.dtype)
            sel.put(e, vals)
            a = sel.take(self.anchor)
            a -= mean
            sel.put(self.anchor, a)
            self.error = e
            self._apply(views, flat)
        self.stats.record("sparseloco_allreduce", traffic(t1 - t0, t2 - t1, time.perf_counter() - t2))
        return True
