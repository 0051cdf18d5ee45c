"""A mask's positions within one tensor (M_t of docs/algorithm.md section 1 there), with the
gather and scatter on them: what :mod:`slamb_comm.wire.masks` hands out per tensor and step.

* :class:`Picks` -- every element (an always-dense tensor), or the base of the others;
* :class:`IndexPicks` -- explicit sorted positions (the bernoulli and topk masks);
* :class:`GridPicks` -- the cyclic mask's picks, from its group geometry: no position array on
  the CPU (cache-sized ranges), a few whole-tensor operations on a GPU.
"""

import numpy as np

class Picks:
    """M_t within one tensor of ``n`` elements, in local (0-based) positions.

    ``count`` (a host int) elements are picked; their payload order is increasing
    position. :meth:`ranges` cuts the tensor into ranges for a blocked loop; the other
    methods act on one such range ``r`` (or on the whole tensor for ``r=None``):
    :meth:`span` (its slice of the tensor's payload), :meth:`take` and :meth:`put` (gather
    and scatter on the tensor's 1-D array ``a``).
    """

    kind = "all"

    def __init__(self, n):
        self.n = int(n)
        self.count = self.n

    def ranges(self, limit=None):
        """``(lo, hi, tag)`` ranges covering ``[0, n)``, of about ``limit`` elements (None: one)."""
        if limit is None or self.n <= limit:
            return [(0, self.n, None)]
        return [(lo, min(lo + limit, self.n), None) for lo in range(0, self.n, limit)]

    def span(self, r):
        return (0, self.count) if r is None else (r[0], r[1])

    def take(self, a, r, out):
        lo, hi = (0, self.n) if r is None else r[:2]
        out[...] = a[lo:hi]
        return out

    def put(self, a, r, vals):
        lo, hi = (0, self.n) if r is None else r[:2]
        a[lo:hi] = vals

    def positions(self, xp):
        """The picked positions as an int64 array (materialised: for tests and inspection)."""
        return xp.arange(self.n, dtype=np.int64)


class IndexPicks(Picks):
    """Picks given as sorted local positions (an int array on the tensor's device)."""

    kind = "index"

    def __init__(self, n, pos):
        self.n = int(n)
        self.pos = pos
        self.count = int(pos.size)
        self._cuts = None

    def _cut(self, r):
        if r is None or (r[0] == 0 and r[1] >= self.n):
            return 0, self.count
        if self._cuts is None or self._cuts[0] != r:  # NumPy only: blocked loops are a CPU thing
            a, b = np.searchsorted(self.pos, (r[0], r[1]))
            self._cuts = (r, (int(a), int(b)))
        return self._cuts[1]

    def span(self, r):
        return self._cut(r)

    def take(self, a, r, out):
        s, e = self._cut(r)
        out[...] = a[self.pos[s:e]]
        return out

    def put(self, a, r, vals):
        s, e = self._cut(r)
        a[self.pos[s:e]] = vals

    def positions(self, xp):
        return self.pos.astype(np.int64)


class GridPicks(Picks):
    """Picks of the cyclic mask in one tensor: a head range, a body of whole groups of C
    units (one selected unit per group), and a tail range; see :class:`CyclicMask`."""

    kind = "grid"

    def __init__(self, geo, j, h_body, xp):
        self.n, self.geo, self.j, self.xp = geo.n, geo, j, xp
        C, B = geo.C, geo.B
        self.h = h_body  # per body group: its rotation h(g) (small unsigned ints, on the device)
        # the unit group g selects is (j - h(g)) mod C: a lookup in this table of C offsets
        lut = np.array([(j - c) % C for c in range(C)], np.int64)
        self._lut = lut if xp is np else xp.asarray(lut)
        self._sel = None  # (g0, g1, the selected units of groups g0..g1 among the body's units)
        self.head = geo.picked(geo.head, j)
        self.tail = geo.picked(geo.tail, j)
        self.nh = self.head[1] - self.head[0]
        self.count = self.nh + geo.G * B + (self.tail[1] - self.tail[0])
        self._windows = None

    def sel(self, g0, g1):
        """The selected unit of each body group g0..g1, as an index among the body's units
        (``g C + (j - h(g)) mod C``); built per range when needed, the last one kept."""
        if self._sel is None or self._sel[0] != g0 or self._sel[1] != g1:
            xp, C = self.xp, self.geo.C
            idx = xp.arange(g0 * C, g1 * C, C, dtype=np.int64)
            idx += xp.take(self._lut, self.h[g0:g1])
            self._sel = (g0, g1, idx)
        return self._sel[2]

    def ranges(self, limit=None):
        g = self.geo
        out = []
        if g.head[1] > g.head[0]:
            out.append((g.head[0], g.head[1], "head"))
        if g.G:
            step = g.G if limit is None else max(1, limit // (g.C * g.B))
            for a in range(0, g.G, step):
                b = min(a + step, g.G)
                out.append((g.e_a + a * g.C * g.B, g.e_a + b * g.C * g.B, ("body", a, b)))
        if g.tail[1] > g.tail[0]:
            out.append((g.tail[0], g.tail[1], "tail"))
        return out

    def span(self, r):
        if r is None:
            return 0, self.count
        tag = r[2]
        if tag == "head":
            return 0, self.nh
        B = self.geo.B
        if tag == "tail":
            return self.nh + self.geo.G * B, self.count
        return self.nh + tag[1] * B, self.nh + tag[2] * B

    def _pieces(self, r):
        """``(part, s, e)`` for every part of range ``r`` (None: the whole tensor), with the
        part's payload slice relative to the start of ``r``'s."""
        parts = self.ranges(None) if r is None else [r]
        base = 0 if r is None else self.span(r)[0]
        out = []
        for part in parts:
            s, e = self.span(part)
            if e > s:
                out.append((part, s - base, e - base))
        return out

    def _body_rows(self, a, g0, g1):
        """The body of 1-D ``a`` as rows of one unit (B elements), and the selected rows of groups g0..g1."""
        geo = self.geo
        body = a[geo.e_a : geo.e_a + geo.G * geo.C * geo.B]
        return body.reshape(geo.G * geo.C, geo.B), self.sel(g0, g1)

    def take(self, a, r, out):
        B = self.geo.B
        if r is not None and type(r[2]) is tuple and B == 1 and out.dtype == a.dtype and self.xp is np:
            e_a = self.geo.e_a  # the CPU's hot path: one body range, single elements
            np.take(a[e_a : e_a + self.geo.G * self.geo.C], self.sel(r[2][1], r[2][2]), out=out, mode="clip")
            return out
        for part, s, e in self._pieces(r):
            dst, tag = out[s:e], part[2]
            if tag in ("head", "tail"):
                lo, hi = self.head if tag == "head" else self.tail
                dst[...] = a[lo:hi]
                continue
            rows, sel = self._body_rows(a, tag[1], tag[2])
            if dst.dtype == a.dtype and self.xp is np:  # no bounds checks: the mask made sel
                if B == 1:
                    np.take(rows.reshape(-1), sel, out=dst, mode="clip")
                else:  # a run as one opaque item: NumPy copies it with one memcpy
                    items = _items(rows)
                    np.take(items, sel, out=dst.view(items.dtype), mode="clip")
            else:
                dst.reshape(-1, B)[...] = rows[sel]
        return out

    def put(self, a, r, vals):
        B = self.geo.B
        scalar = not hasattr(vals, "shape")
        if (r is not None and type(r[2]) is tuple and B == 1 and not scalar and vals.dtype == a.dtype
                and self.xp is np):
            e_a = self.geo.e_a
            np.put(a[e_a : e_a + self.geo.G * self.geo.C], self.sel(r[2][1], r[2][2]), vals, mode="clip")
            return
        for part, s, e in self._pieces(r):
            v, tag = (vals if scalar else vals[s:e]), part[2]
            if tag in ("head", "tail"):
                lo, hi = self.head if tag == "head" else self.tail
                a[lo:hi] = v
                continue
            rows, sel = self._body_rows(a, tag[1], tag[2])
            if not scalar and v.dtype == a.dtype and self.xp is np:
                if B == 1:
                    np.put(rows.reshape(-1), sel, v, mode="clip")
                else:
                    items = _items(rows)
                    np.put(items, sel, v.view(items.dtype), mode="clip")
            else:
                rows[sel] = v if scalar else v.reshape(-1, B)

    def scale(self, table, r, u, out):
        """``out = table[chunk(e)] * u`` for the elements e of range ``r``, where ``table`` is
        the tensor's per-chunk coefficient table doubled (2C entries, an array on u's device);
        ``u`` and ``out`` are the range's 1-D arrays."""
        geo, xp = self.geo, self.xp
        tag = r[2]
        if type(tag) is not tuple:  # a head or a tail: a few units, chunk by chunk
            c = geo.chunks(r[0], r[1], xp)
            xp.multiply(table.take(c), u, out=out)
            return out
        g0, g1 = tag[1], tag[2]
        C = geo.C
        if self._windows is None or self._windows[0] is not table:
            self._windows = (table, xp.ascontiguousarray(_windows(xp, table, C)))
        coef = self._windows[1].take(self.h[g0:g1], axis=0)  # (groups, C): row g is table[h_g : h_g + C]
        if geo.B == 1:
            xp.multiply(coef.reshape(-1), u, out=out)
        else:
            xp.multiply(coef.reshape(g1 - g0, C, 1), u.reshape(g1 - g0, C, geo.B), out=out.reshape(g1 - g0, C, geo.B))
        return out

    def positions(self, xp):
        parts = []
        geo = self.geo
        if self.nh:
            parts.append(xp.arange(self.head[0], self.head[1], dtype=np.int64))
        if geo.G:
            starts = self.sel(0, geo.G) * geo.B + geo.e_a
            parts.append((starts[:, None] + xp.arange(geo.B, dtype=np.int64)[None, :]).reshape(-1))
        if self.tail[1] > self.tail[0]:
            parts.append(xp.arange(self.tail[0], self.tail[1], dtype=np.int64))
        return xp.concatenate(parts) if parts else xp.zeros(0, np.int64)


def _items(rows):
    """The rows of a C-contiguous 2-D NumPy array as a 1-D array of opaque items, one per row."""
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).reshape(-1)


def _windows(xp, table, C):
    """``(C, C)`` view of the doubled table: row w is ``table[w : w + C]``."""
    s = table.strides[0]
    return xp.lib.stride_tricks.as_strided(table, shape=(C, C), strides=(s, s))
