"""SparseLoCo's wire format: chunk-wise top-k of a fused buffer, b-bit values, bit-packed
offsets (docs/algorithm.md sections 14.1 and 14.2). Used by :mod:`slamb_comm.methods.sparseloco`."""

import numpy as np

from .. import arrays as _arr
from ..errors import ConfigError

__all__ = ["BITS", "ChunkTopK", "pack_bits", "unpack_bits", "pad8", "int_in"]

#: the value codes SparseLoCo sends: 2, 4 or 8-bit levels with a float32 scale per chunk, or 32:
#: the values as float32 (no scale; for comparisons and exact tests)
BITS = (2, 4, 8, 32)


def pad8(n):
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
        self.total, self.s, self.bits = int(total), int_in("chunk", chunk, 2, 1 << 24), bits
        self.k = int_in("topk", topk, 1, self.s, f"at most chunk = {self.s}; the paper sends 1-3% of each chunk")
        if bits not in BITS or isinstance(bits, bool):
            raise ConfigError(f"bits must be one of {BITS} (2, the paper's; 32 sends float32 values), got {bits!r}")
        self.n_chunks = -(-self.total // self.s)
        self.last = self.total - (self.n_chunks - 1) * self.s  # the last chunk's length L
        self.k_last = min(self.last, -(-self.k * self.last // self.s))
        self.full = self.n_chunks if self.last == self.s else self.n_chunks - 1  # chunks of exactly s
        self.K = self.full * self.k + (0 if self.last == self.s else self.k_last)
        self.index_bits = max(1, (self.s - 1).bit_length())
        self.width = self.index_bits + bits
        self.scale_bytes = 0 if bits == 32 else pad8(4 * self.n_chunks)
        self.entry_bytes = pad8(-(-self.K * self.width // 8))
        self.nbytes = 8 + self.scale_bytes + self.entry_bytes
        counts = [self.k] * self.full + ([] if self.last == self.s else [self.k_last])
        self.entry_chunk = np.repeat(np.arange(self.n_chunks, dtype=np.int64), counts)  # K host integers
        self._dev = {}

    def _chunk_of(self, xp):
        key = (xp.__name__, None if xp is np else xp.cuda.Device().id)
        if key not in self._dev:
            self._dev[key] = self.entry_chunk if xp is np else xp.asarray(self.entry_chunk)
        return self._dev[key]

    def positions(self, offsets):
        """Positions in the fused buffer (int64 [K]) of ``offsets`` within their chunks, given chunk
        by chunk in payload order (an entry's chunk is implied by its place)."""
        return self._chunk_of(_arr.namespace(offsets)) * self.s + offsets.astype(np.int64, copy=False)

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
        return self.positions(offs), self.dequantize(codes, a, e.dtype), ok

    def decode(self, buf, dtype):
        """One payload (uint8 [nbytes]) -> ``(positions in the fused buffer, int64 [K]; values [K]
        in dtype)``. Scratch: about ``K (width + 40)`` bytes."""
        dtype = np.dtype(dtype)
        fields = unpack_bits(buf[8 + self.scale_bytes : self.nbytes], self.width, self.K)
        codes = fields & np.uint64((1 << self.bits) - 1)
        pos = self.positions((fields >> np.uint64(self.bits)).astype(np.int64))
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


def int_in(name, v, lo, hi, fix=""):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}" + (f"; {fix}" if fix else ""))
    return int(v)
