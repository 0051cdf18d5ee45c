"""The top-k exchange's launches on a device: :class:`Plan`, the tables, scratch and launches of
:mod:`slamb_comm.device.topk_kernels`' radix select for one :class:`~slamb_comm.wire.codecs.TopKWire` on one
device. The kernels and their algorithm are described there."""

from typing import NamedTuple

import numpy as np

from . import tables as _dev
from . import kernels as _k
from .kernels import TILE
from ..errors import STATUS_NON_FINITE
from .topk_kernels import CODES, SEG_BYTES, SOURCE, schedule

__all__ = ["Plan"]

DUMMIES = ("float16", "float32", "float64", "uint64", "int64")  # one element each, for pointers a launch does not read


class _Sizes(NamedTuple):
    """What the launches' declared bytes are made of (elements, payload entries, tiles)."""

    total: int
    tiled: int  # elements of the tensors cut into tiles (the others are segments)
    seg_k: int  # entries of the segments
    tiled_k: int  # entries of the tiled tensors
    tiles: int  # tiles and segments
    tiled_tiles: int
    rows: int  # tiled tensors
    subtiles: int  # pieces of at most TILE elements (the decode's)
    search: int  # steps of a binary search in a tensor's entries, at most


class _Tables(NamedTuple):
    """The device tables (int64 views of one copy)."""

    sched: object  # the digits' count, then shift and width per digit
    tens: object  # 8 per tensor: offset, size, k, first entry, first tile, tiles, row (-1: a segment)
    tiles: object  # 4 per tile: tensor, lo, hi, index among the tiled tensors' tiles (-1: a segment)


class _State(NamedTuple):
    """The device scratch, zeroed once: the kernels leave it as they found it."""

    word: object  # uint32: the non-finite flag, the write kernel's block counter
    prefix: object  # uint64 per tensor: the known high digits of its k-th largest key
    rank: object  # int64 per tensor: the k-th largest's rank among the keys with those digits
    done: object  # uint32 per tensor: its tiles done in this launch
    rows: object  # uint32, 2,048 per tiled tensor: its histogram of the current digit
    thist: object  # uint16 per tiled tensor's tile: its histogram of the last digit
    tstat: object  # int64, 3 per tiled tensor's tile: keys above (higher digits), first entry, ties before
    status: object  # int32: the status word of a select that has no payload
    dummy: dict  # dtype name -> 1 element, for the pointers a launch does not read


class Plan:
    """The top-k exchange's kernels for one :class:`~slamb_comm.wire.codecs.TopKWire` on one device:
    its tables (one host-to-device copy, at the first launch), its scratch, its launches
    (:meth:`encode`, :meth:`select`, :meth:`decode`)."""

    def __init__(self, wire, xp):
        lay = wire.layout
        self.xp, self.wire, self.layout, self.sched = xp, wire, lay, schedule(lay.dtype)
        seg = SEG_BYTES // lay.dtype.itemsize
        tens, tiles, rows, m = [], [], 0, 0  # m: the tiled tensors' tiles so far
        for i, (o, n, a, k) in enumerate(zip(lay.offsets, lay.sizes, wire.starts, wire.counts)):
            t0 = len(tiles)
            if n > seg:
                tiles += [(i, lo, min(lo + TILE, o + n), m + j) for j, lo in enumerate(range(o, o + n, TILE))]
                m += len(tiles) - t0
            elif n:
                tiles.append((i, o, o + n, -1))
            tens.append((o, n, k, a, t0, len(tiles) - t0, rows if n > seg else -1, 0))
            rows += n > seg
        sched = [len(self.sched)] + [v for d in self.sched for v in d]
        self._host = np.asarray(sched + [0] * (16 - len(sched)) + [v for t in tens or [(0,) * 8] for v in t]
                                + [v for t in tiles or [(0, 0, 0, -1)] for v in t], np.int64)
        cut = [i for i, t in enumerate(tens) if t[6] >= 0]
        tiled_k = sum(wire.counts[i] for i in cut)
        self.sizes = _Sizes(lay.total, sum(lay.sizes[i] for i in cut), wire.k_total - tiled_k, tiled_k, len(tiles), m,
                            rows, sum(-(-(hi - lo) // TILE) for _, lo, hi, _ in tiles),
                            max(wire.counts + [1]).bit_length())
        self._ntens = max(1, len(tens))
        self._tables = self._state = None
        self._ptrs = {}  # a list's addresses -> their device table, the most recent last

    def _ensure(self, ptrs=()):
        """Copy the tables (and the addresses ``ptrs`` of a list: the same copy) to the device and
        zero the scratch, at the first launch; returns the addresses' table."""
        xp, s, T = self.xp, self.sizes, self._ntens
        dev = xp.asarray(np.concatenate([self._host, np.asarray(ptrs, np.uint64).view(np.int64)]))
        self._tables = _Tables(dev[:16], dev[16 : 16 + 8 * T], dev[16 + 8 * T : self._host.size])
        parts = [("word", np.uint32, 2), ("prefix", np.uint64, T), ("rank", np.int64, T), ("done", np.uint32, T),
                 ("rows", np.uint32, 2048 * max(1, s.rows)),
                 ("thist", np.uint16, (1 << self.sched[-1][1]) * max(1, s.tiled_tiles)),
                 ("tstat", np.int64, 3 * max(1, s.tiled_tiles)), ("status", np.int32, 1)]
        parts += [(dt, dt, 1) for dt in DUMMIES]
        ends = np.cumsum([0] + [-(-np.dtype(dt).itemsize * n // 8) * 8 for _, dt, n in parts])  # 8-byte aligned
        buf = xp.zeros(int(ends[-1]), np.uint8)
        views = {name: buf[a : a + np.dtype(dt).itemsize * n].view(dt) for (name, dt, n), a in zip(parts, ends)}
        self._state = _State(**{k: v for k, v in views.items() if k not in DUMMIES},
                             dummy={dt: views[dt] for dt in DUMMIES})
        return dev[self._host.size :].view(np.uint64)

    def _input(self, x):
        """``(list?, fused buffer, table of addresses)`` of ``x``: a fused buffer of the layout, or a
        list of its tensors' arrays (their addresses copied to the device when they are new; the
        last :data:`slamb_comm.device.tables.KEEP` tables are kept)."""
        lay, xp = self.layout, self.xp
        if hasattr(x, "shape"):
            if self._tables is None:
                self._ensure()
            return 0, _dev.check_fused(lay, x, "x"), self._state.dummy["uint64"]
        ptrs = tuple(_dev.address(lay, i, a, "x", xp) for i, a in enumerate(x))
        table = self._ptrs.pop(ptrs, None)
        if table is None:
            table = self._ensure(ptrs) if self._tables is None else xp.asarray(np.asarray(ptrs, np.uint64))
            for old in list(self._ptrs)[: max(0, len(self._ptrs) - _dev.KEEP + 1)]:
                del self._ptrs[old]
        self._ptrs[ptrs] = table
        return 1, self._state.dummy[lay.dtype.name], table

    def _launch(self, kind, codes, args, reads, writes):
        grid = min(max(1, self.sizes.tiles), _dev.GRID)
        _k.launch(self.xp, f"topk_{kind}_{codes}", grid, args, reads=[r for r in reads if r[1]],
                  writes=[w for w in writes if w[1]], source=SOURCE)

    def encode(self, x, e, idx, val, status, keep, pos=None):
        """Every tensor's top-k of ``c = x + e`` (``x`` itself while ``e`` is None; ``x``: a fused
        buffer or a list of the tensors' arrays) into the payload's views ``idx`` (int32, index in
        its tensor) and ``val`` (the wire's dtype), its status word (int32: 0, or non-finite) into
        ``status`` (None: scratch), the fused positions into ``pos`` (int64, if given). With
        ``keep``, returns the fused buffer ``c - sent`` (the next error buffer; ``0 + x - sent``
        at the first exchange), else None. 1 + (digits - 1) + 1 launches, no host read.

        Declared bytes (N elements, K entries; per element 4 for float32): x and e 8N and c 4N
        (``keep``), then per further digit and for the write 4 per element of a tiled tensor; the
        entries ``K (4 + value)`` (and ``8K`` for ``pos``); the rows and tile counts."""
        s, dt, vdt = self.sizes, self.layout.dtype, val.dtype
        xin = self._input(x)
        st, (sched, tens, tiles), isz = self._state, self._tables, dt.itemsize
        cbuf = self.xp.empty(s.total, dt) if keep else st.dummy[dt.name]
        flags = (np.int32(e is not None), np.int32(keep), np.int32(pos is not None))
        ent = 4 + vdt.itemsize + 8 * int(flags[2]) + isz * keep
        pos = st.dummy["int64"] if pos is None else pos
        head = (tens, tiles, np.int64(s.tiles))
        tables = ("tables", s.tiles * 32 + len(self.layout) * (72 if xin[0] else 64))
        rows = ("rows", s.rows * (4 << self.sched[0][1]))
        self._launch("first", CODES[dt.name] + CODES[vdt.name], (
            *head, sched, np.int32(xin[0]), *xin[1:], st.dummy[dt.name] if e is None else e, flags[0], cbuf, flags[1],
            st.prefix, st.rank, st.done, st.rows, idx, val, pos, flags[2], st.word),
            reads=[("x", s.total * isz), ("e", s.total * isz * int(flags[0])), tables, rows],
            writes=[("c", s.total * isz * keep), rows, ("state", s.rows * 16), ("entries", s.seg_k * ent)])
        for p, (shift, width) in enumerate(self.sched[1:], 1):
            final = p == len(self.sched) - 1
            counts, rows = ("tile counts", s.tiled_tiles * ((2 << width) + 24) * final), ("rows", s.rows * (4 << width))
            self._launch("pass", CODES[dt.name], (
                *head, np.int32(xin[0]), *xin[1:], cbuf, flags[0], st.prefix, st.rank, st.done, st.rows, st.thist,
                st.tstat, np.int32(shift), np.int32(width), np.int32(final)),
                reads=[("c", s.tiled * isz), ("state", s.rows * 16), tables, rows, counts],
                writes=[rows, ("state", s.rows * 16), counts])
        self._launch("write", CODES[dt.name] + CODES[vdt.name], (
            *head, np.int32(xin[0]), *xin[1:], cbuf, flags[0], flags[1], st.prefix, st.rank, st.tstat, idx, val, pos,
            flags[2], st.word, st.status if status is None else status, np.int32(STATUS_NON_FINITE)),
            reads=[("c", s.tiled * isz), ("state", s.rows * 16 + s.tiled_tiles * 24), tables],
            writes=[("entries", s.tiled_k * ent), ("status", 4)])
        return cbuf if keep else None

    def select(self, c):
        """:meth:`encode` of the fused buffer ``c`` into scratch: ``(pos, local)``, the fused
        positions and the indices within their tensors (int64, in payload order)."""
        xp, K = self.xp, self.wire.k_total
        pos, idx = xp.empty(K, np.int64), xp.empty(K, np.int32)
        self.encode(c, None, idx, xp.empty(K, self.wire.value_dtype), None, False, pos)
        return pos, idx.astype(np.int64)

    def decode(self, recv, ranks):
        """The mean over ``ranks`` of every rank's payload in the gathered buffer ``recv`` (uint8,
        ``ranks * nbytes``), in a new fused buffer of the layout's dtype written once: summed in
        ``promote(dtype, float32)`` rank after rank, times ``1/ranks``, cast back (what the NumPy
        path computes, bit for bit). One launch; declared bytes: the output, every rank's entries,
        the binary searches."""
        s, w, lay = self.sizes, self.wire, self.layout
        if self._tables is None:
            self._ensure()
        out = self.xp.empty(lay.total, lay.dtype)
        self._launch("decode", CODES[lay.dtype.name] + CODES[w.value_dtype.name], (
            self._tables.tens, self._tables.tiles, np.int64(s.tiles), recv, np.int64(ranks), np.int64(w.nbytes),
            np.int64(w.idx_at), np.int64(w.val_at), np.float64(1.0 / ranks), np.int32(ranks > 1), out),
            reads=[("entries", ranks * w.k_total * (4 + w.value_dtype.itemsize)),
                   ("searches", ranks * s.subtiles * 8 * s.search), ("tables", s.tiles * 32 + len(lay) * 64)],
            writes=[("out", lay.total * lay.dtype.itemsize)])
        return out
