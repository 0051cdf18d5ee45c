"""The shared masks M_t of docs/algorithm.md section 1 (step 2), derived per tensor when needed.

No mask keeps an array of positions for the run: a step's positions are derived from the
seed and the step when a tensor needs them, and dropped after. What a mask hands out is a
:class:`Picks` per tensor: M_t within that tensor, with the gather and scatter on it, in
cache-sized ranges on the CPU and in a few whole-tensor kernels on a GPU.

* :class:`CyclicMask` (default): every compressible unit (an element, or a run of
  ``block`` contiguous elements of the fused buffer) is synchronised exactly once every
  ``C = ceil(1/k)`` steps. The permutation is keyed and stratified: the units, numbered in
  fused-buffer order, are cut into groups of C consecutive units; group g assigns its C
  units to the C chunks as the rotation ``chunk = (offset + h(g)) mod C``, where ``h`` is a
  64-bit mixing hash (splitmix64) of (seed, g). Chunk (t-1) mod C is M_t. Chunks differ in
  size by at most one unit, the positions of a step come out sorted, and both the
  positions and every element's chunk (hence its freshness) are computed from O(1)
  numbers per tensor and one hash per group.
* :class:`BernoulliMask`: each compressible element is in M_t with probability k, drawn
  per (seed, t, tensor) from gaps of a geometric distribution (O(k n) work).
* :class:`TopKUnionMask`: the union over ranks of each rank's per-tensor top-k; a collective.

Always-dense tensors (ndim <= 1 or fewer than ``dense_threshold`` elements) are in M_t
whole at every step. No mask touches a global random generator.
"""

import math

import numpy as np

from .. import arrays as _arr
from .codecs import check_ratio, k_elems, topk_indices
from ..errors import ConfigError
from .picks import GridPicks, IndexPicks, Picks

__all__ = ["Picks", "Selection", "CyclicMask", "BernoulliMask", "TopKUnionMask", "make_mask", "check_block"]

_M64 = (1 << 64) - 1
_G1, _G2, _G3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

#: elements per range of the CPU's blocked loops (a few such ranges fit in L2)
BLOCK = 1 << 18


def check_block(block):
    """A run length of the cyclic mask: an integer >= 1."""
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ConfigError(f"block must be an integer >= 1, got {block!r}")
    return int(block)


def _mix(z):
    """splitmix64's finaliser on a Python int."""
    z = ((z ^ (z >> 30)) * _G2) & _M64
    z = ((z ^ (z >> 27)) * _G3) & _M64
    return z ^ (z >> 31)


def _rot_dtype(C):
    return np.uint8 if C <= 256 else (np.uint16 if C <= 65536 else np.int64)


class _Geometry:
    """Where one compressible tensor's units and groups lie (host integers only).

    Units are numbered over the whole fused buffer in order: with ``B = 1`` the compressible
    elements, else the runs ``[r B, (r+1) B)`` that hold a compressible element. Local
    element ``e`` of the tensor (fused offset ``o``) is in unit ``qs + (o + e)//B - r0``.
    """

    def __init__(self, o, n, B, C, qs, key):
        self.o, self.n, self.B, self.C, self.qs, self.key = o, n, B, C, qs, key
        self.r0 = o // B
        e1 = (-o) % B  # first local element that starts a run
        q1 = qs + (1 if e1 else 0)  # that run's unit
        q_a = -(-q1 // C) * C  # the first group boundary at or after it
        e_a = e1 + (q_a - q1) * B
        if e_a >= n:
            self.e_a, self.G = n, 0
        else:
            self.e_a = e_a
            self.G = ((n - e_a) // B) // C
        self.g_a = q_a // C  # global index of the first body group
        body_end = self.e_a + self.G * C * B
        self.head = (0, self.e_a)
        self.tail = (body_end, n)

    def unit(self, e):
        return self.qs + (self.o + e) // self.B - self.r0

    def rot(self, g):
        """h(g) for one group (host): the top 32 bits of the mixed group id, scaled to [0, C)."""
        return ((_mix((self.key + g + _G1) & _M64) >> 32) * self.C) >> 32

    def picked(self, rng, j):
        """The sub-range of ``rng`` (within one group) whose unit is in chunk j."""
        lo, hi = rng
        if hi <= lo:
            return (lo, lo)
        g = self.unit(lo) // self.C  # a head or a tail lies within one group
        q = g * self.C + (j - self.rot(g)) % self.C
        first = (self.r0 + q - self.qs) * self.B - self.o  # local start of unit q's run
        a, b = max(lo, first), min(hi, first + self.B)
        return (a, b) if a < b else (lo, lo)

    def count(self, j):
        h, t = self.picked(self.head, j), self.picked(self.tail, j)
        return (h[1] - h[0]) + self.G * self.B + (t[1] - t[0])

    def chunks(self, lo, hi, xp):
        """The chunk of every element of ``[lo, hi)`` (an int64 array on ``xp``; O(hi - lo))."""
        if hi <= lo:
            return xp.zeros(0, np.int64)
        g0, g1 = self.unit(lo) // self.C, self.unit(hi - 1) // self.C + 1
        if g1 - g0 == 1:  # a head or a tail (every step): a few units, on the host, one copy over
            q = (np.arange(lo, hi, dtype=np.int64) + self.o) // self.B + (self.qs - self.r0)
            c = (q % self.C + self.rot(g0)) % self.C
            return c if xp is np else xp.asarray(c)
        q = (xp.arange(lo, hi, dtype=np.int64) + self.o) // self.B + (self.qs - self.r0)
        h = self.rotations(g0, g1, xp).astype(np.int64)
        return (q % self.C + xp.take(h, q // self.C - g0)) % self.C

    def body_rotations(self, xp):
        """h(g) of every body group, computed on the device (one vectorised hash, no division),
        in the smallest unsigned dtype that holds C values."""
        return self.rotations(self.g_a, self.g_a + self.G, xp)

    def rotations(self, g0, g1, xp):
        """h(g) for the groups g0 <= g < g1 (what :meth:`rot` gives one at a time)."""
        z = xp.arange(g0, g1, dtype=np.uint64)
        z += np.uint64((self.key + _G1) & _M64)
        z ^= z >> np.uint64(30)
        z *= np.uint64(_G2)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_G3)
        z ^= z >> np.uint64(31)
        z >>= np.uint64(32)
        z *= np.uint64(self.C)
        z >>= np.uint64(32)
        return z.astype(_rot_dtype(self.C))


# ---------------------------------------------------------------------------- selection
class Selection:
    """M_t over the whole layout: one :class:`Picks` per tensor.

    ``index`` (built on first use) lists the positions in the fused buffer in payload order
    (tensor by tensor, increasing); ``take`` and ``put`` gather and scatter on a fused
    buffer or on a list of per-tensor arrays.
    """

    def __init__(self, layout, picks, xp=np, block=1):
        self.layout = layout
        self.picks = picks
        self.xp = xp
        self.block = block
        self.counts = [p.count for p in picks]
        self.starts = [0]
        for c in self.counts:
            self.starts.append(self.starts[-1] + c)
        self.size = self.starts.pop()
        self._index = None

    def __len__(self):
        return self.size

    @property
    def index(self):
        if self._index is None:
            xp = self.xp
            parts = [p.positions(xp) + o for p, o in zip(self.picks, self.layout.offsets) if p.count]
            self._index = xp.concatenate(parts) if parts else xp.zeros(0, np.int64)
        return self._index

    def __array__(self, dtype=None, copy=None):
        """NumPy sees the positions (``np.asarray(selection)``; host selections only)."""
        return self.index if dtype is None else self.index.astype(dtype)

    @property
    def blocks(self):
        """For a mask over runs (``block`` > 1): the ids of the runs of the fused buffer (run r
        is ``[r * block, (r + 1) * block)``) whose compressible elements M_t brings; None for a
        mask over elements."""
        if self.block == 1:
            return None
        xp = self.xp
        parts = [p.positions(xp) + o for p, o, i in zip(self.picks, self.layout.offsets, range(len(self.picks)))
                 if p.kind != "all" and p.count]
        return xp.unique(xp.concatenate(parts) // self.block) if parts else xp.zeros(0, np.int64)

    def _views(self, a):
        if isinstance(a, (list, tuple)):
            return [x.reshape(-1) for x in a]
        return self.layout.flat_views(a)

    def take(self, a, out=None):
        """``a[index]`` in payload order (into ``out`` if given; it may have another dtype)."""
        views = self._views(a)
        if out is None:
            out = _arr.namespace(views[0] if views else a).empty(self.size, views[0].dtype if views else np.float32)
        for p, v, s, c in zip(self.picks, views, self.starts, self.counts):
            if c:
                p.take(v, None, out[s : s + c])
        return out

    def put(self, a, vals):
        """``a[index] = vals`` (``vals``: an array in payload order, or a scalar)."""
        scalar = not hasattr(vals, "shape")
        for p, v, s, c in zip(self.picks, self._views(a), self.starts, self.counts):
            if c:
                p.put(v, None, vals if scalar else vals[s : s + c])


# ---------------------------------------------------------------------------- masks
class _Mask:
    kind = ""

    def __init__(self, layout, ratio, seed):
        self.layout = layout
        self.ratio = check_ratio(ratio)
        self.seed = int(seed)

    def state_dict(self):
        return {"kind": self.kind, "ratio": self.ratio, "seed": self.seed}

    def count(self, t, i):
        """|M_t| within tensor ``i`` (host integer, no device work)."""
        return self.picks(t, i, np).count

    def counts(self, t):
        """|M_t| within every tensor, a list (host integers)."""
        return [self.count(t, i) for i in range(len(self.layout))]

    def select(self, t, xp=np, views=None, transport=None):
        """M_t over the layout as a :class:`Selection`."""
        return Selection(self.layout, [self.picks(t, i, xp) for i in range(len(self.layout))], xp,
                         getattr(self, "block", 1))


class CyclicMask(_Mask):
    """The paper's random-k mask: chunks of one shared keyed permutation, in turn.

    Units (single compressible elements, or with ``block`` > 1 the runs of ``block``
    contiguous positions of the fused buffer that hold a compressible element; a selected
    run brings all its compressible elements) are numbered in fused-buffer order and cut
    into groups of ``C = ceil(1/ratio)`` consecutive units. In group g, the unit at offset
    w belongs to chunk ``(w + h(g)) mod C``, with h a keyed 64-bit hash of the shared seed
    and g. Step t selects chunk ``(t - 1) mod C`` plus every always-dense element, so each
    compressible element is synchronised exactly once every C steps, and every group gives
    each chunk one unit (chunk sizes differ by at most one unit).

    Nothing of size O(elements) is kept: :meth:`picks` derives a tensor's positions at
    step t from a hash per group, and :meth:`staleness` gives every chunk's steps since
    its last synchronisation, from which SLAMB derives the freshness instead of storing it.

    A ratio schedule (:meth:`rebased`): the mask that takes over after step ``origin`` counts
    its cycle from there (step ``origin + s`` selects chunk ``(s - 1) mod C``), so every unit
    is synchronised within C steps of the change, C of the new ratio. Until its first cycle
    is complete, an element it has not reached yet keeps the freshness the previous mask
    gave it at the change, decayed since (``prev``: the mask before, O(tensors) numbers).
    """

    kind = "cyclic"

    def __init__(self, layout, ratio, seed, block=1, origin=0, prev=None):
        super().__init__(layout, ratio, seed)
        self.origin, self.prev = int(origin), prev
        self.block = check_block(block)
        self.num_chunks = C = math.ceil(1.0 / self.ratio - 1e-9)
        self._key = _mix((self.seed + _G1) & _M64)
        B = self.block
        self._geo = {}
        self._counts = {}  # chunk -> every tensor's count in it (see counts())
        if layout.shards is not None:
            self._geo, self.units = self._sharded(layout, C), None
            return
        q, last_run = 0, -1
        for i in layout.compressible:
            o, n = layout.offsets[i], layout.sizes[i]
            r0, r1 = o // B, (o + n - 1) // B
            qs = q - 1 if r0 == last_run else q
            q, last_run = qs + (r1 - r0) + 1, r1
            self._geo[i] = _Geometry(o, n, B, C, qs, self._key)
        self.units = q

    def _sharded(self, layout, C):
        """Pieces of whole tensors (``layout.shards``): units are the whole tensors' compressible
        elements in order, so a piece's units are those of its elements in the whole tensor and
        its picks are the unsharded mask's, restricted to it (needs ``block == 1``)."""
        if self.block != 1:
            raise ConfigError(f"block={self.block}: sharded tensors take the cyclic mask with block=1 "
                              "(runs of the fused buffer would differ between shardings)")
        geo, base = {}, 0
        for i, (sh, dense) in enumerate(zip(layout.shards, layout.dense)):
            if dense:
                continue
            if layout.sizes[i]:
                geo[i] = _Geometry(layout.offsets[i], layout.sizes[i], 1, C, base + sh.start, self._key)
            base += math.prod(sh.shape)
        return geo

    def chunk(self, step):
        return (int(step) - self.origin - 1) % self.num_chunks

    def rebased(self, ratio, origin):
        """The mask for ``ratio`` from step ``origin + 1`` on: a new permutation of C' =
        ceil(1/ratio) chunks, cycled from there, with this mask as ``prev`` (which forgets its
        own ``prev`` if its first cycle was complete by then)."""
        if self.prev is not None and int(origin) - self.origin >= self.num_chunks:
            self.prev = None
        return CyclicMask(self.layout, ratio, self.seed, self.block, origin, self)

    def levels(self):
        """The masks from the oldest one that still matters to this one's freshness, to this one."""
        return (self.prev.levels() if self.prev is not None else []) + [self]

    def schedule(self):
        """``[(ratio, origin), ...]`` of :meth:`levels` (what :func:`make_mask` rebuilds them from)."""
        return [(m.ratio, m.origin) for m in self.levels()]

    def settled(self, t):
        """Whether every element's freshness after step ``t`` follows this mask alone."""
        return self.prev is None or int(t) - self.origin >= self.num_chunks

    def freshness(self, i, t, beta3, lo, hi, xp=np):
        """The freshness after step ``t`` of elements ``[lo, hi)`` of compressible tensor ``i``
        (float64 on ``xp``): ``beta3 ** staleness`` of the element's chunk, times, where this
        mask has not reached the element yet, its freshness under ``prev`` at the change."""
        geo = self._geo[i]
        s = int(t) - self.origin
        c = geo.chunks(lo, hi, xp)
        F = xp.asarray(beta3 ** np.asarray(self.staleness(t), np.float64))
        f = xp.take(F, c)
        if self.prev is not None and s < self.num_chunks:
            reached = xp.asarray(np.arange(self.num_chunks) < s)
            before = self.prev.freshness(i, self.origin, beta3, lo, hi, xp)
            f = xp.where(xp.take(reached, c), f, f * before)
        return f

    def picks(self, t, i, xp=np, rotations=None):
        """M_t within tensor ``i`` (a :class:`GridPicks`, or everything for a dense tensor).
        ``rotations``: :meth:`rotations` of the tensor, if the caller kept them (they do not
        depend on t)."""
        geo = self._geo.get(i)
        if geo is None or self.num_chunks == 1:
            return Picks(self.layout.sizes[i])
        return GridPicks(geo, self.chunk(t), geo.body_rotations(xp) if rotations is None else rotations, xp)

    def rotations(self, i, xp=np):
        """The rotation h(g) of each body group of tensor ``i`` (one small unsigned int per group
        of C units: at k = 0.1, a tenth of a byte per element), or None for a dense tensor."""
        geo = self._geo.get(i)
        if geo is None or self.num_chunks == 1:
            return None
        return geo.body_rotations(xp)

    def count(self, t, i):
        return self.count_of_chunk(self.chunk(t), i)

    def selects_in(self, i):
        """Whether tensor ``i`` is compressible here (its units are in the cycle), not always dense."""
        return i in self._geo

    def counts(self, t):
        """|M_t| within every tensor: the same list for every step of one chunk (built once per chunk, so
        that a step's host work does not grow with the tensors; do not change it)."""
        j = self.chunk(t)
        cached = self._counts.get(j)
        if cached is None:
            cached = self._counts[j] = [self.count_of_chunk(j, i) for i in range(len(self.layout))]
        return cached

    def count_of_chunk(self, j, i):
        """The elements of tensor ``i`` in chunk ``j`` (every element of a dense tensor)."""
        geo = self._geo.get(i)
        if geo is None or self.num_chunks == 1:
            return self.layout.sizes[i]
        return geo.count(j)

    @property
    def key(self):
        """The 64-bit key of the mask's hash, from the seed: ``h(g) = ((mix(key + g + G1) >> 32) C) >> 32``
        (what the device kernels compute per element)."""
        return self._key

    def first_unit(self, i):
        """The number of compressible tensor ``i``'s first unit in fused-buffer order."""
        return self._geo[i].qs

    def rotation(self, g):
        """h(g) of the buffer's group ``g`` (host integer)."""
        return ((_mix((self._key + int(g) + _G1) & _M64) >> 32) * self.num_chunks) >> 32

    def staleness(self, t):
        """Per chunk c, the steps since its elements were last synchronised, at step t (after
        step t's exchange): 0 for chunk (s-1) mod C; s for a chunk not yet reached, with
        ``s = t - origin`` the steps this mask has run."""
        C, s = self.num_chunks, int(t) - self.origin
        if s <= 0:
            return [0] * C
        j = (s - 1) % C
        return [j - c if c <= j else (j - c + C if s > C else s) for c in range(C)]

    def state_dict(self):
        out = {**super().state_dict(), "block": self.block}
        if self.origin or self.prev is not None:
            out["schedule"] = self.schedule()
        return out


class BernoulliMask(_Mask):
    """Each compressible element is in M_t with probability ``ratio``, independently.

    Drawn on the host, per tensor i, from ``numpy.random.Generator(PCG64([seed, t, i]))`` as
    the gaps of a geometric distribution (a Bernoulli process, in O(ratio * n) work): the
    same on every rank, reproducible from (seed, t) alone. Staleness is unbounded.
    """

    kind = "bernoulli"

    def picks(self, t, i, xp=np):
        n = self.layout.sizes[i]
        if i not in self.layout.compressible or self.ratio >= 1.0:
            return Picks(n)
        rng = np.random.Generator(np.random.PCG64([self.seed, int(t), i]))
        p = self.ratio
        gaps = []
        end = 0
        while end < n:  # almost always one draw: the mean and six standard deviations
            want = int(n * p + 6.0 * math.sqrt(n * p * (1 - p)) + 16)
            g = rng.geometric(p, size=want)
            gaps.append(g)
            end += int(g.sum())
        pos = np.cumsum(np.concatenate(gaps)) - 1
        pos = pos[: np.searchsorted(pos, n)].astype(np.int64)
        return IndexPicks(n, pos if xp is np else xp.asarray(pos))


class TopKUnionMask(_Mask):
    """Each rank picks, per compressible tensor, the ``k_elems(ratio, n)`` largest ``|values|``;
    M_t is the union over ranks (positions are allgathered first), plus the dense elements.

    The union is formed on the device without a host read per tensor: one sort of every
    rank's picks, a mark of the first of equal neighbours and a prefix sum; the only host
    read is the per-tensor counts (one small array).
    """

    kind = "topk"

    def pick(self, i, values):
        """This rank's picks in tensor ``i`` (local positions, int64, increasing)."""
        return topk_indices(values, k_elems(self.ratio, values.size))

    def union(self, xp, local, transport):
        """The Selection whose picks in every compressible tensor are the union over ranks of
        ``local[i]`` (this rank's picks, from :meth:`pick`). Collective."""
        lay = self.layout
        comp = lay.compressible
        parts = [local[i] + lay.offsets[i] for i in comp]
        mine = xp.concatenate(parts) if parts else xp.zeros(0, np.int64)
        every = xp.empty(mine.size * transport.size, np.int64)
        transport.allgather(mine, every)
        picks = [Picks(n) for n in lay.sizes]
        if not comp:
            return Selection(lay, picks, xp)
        s = xp.sort(every)
        first = xp.empty(s.size, dtype=bool)
        first[:1] = True
        xp.not_equal(s[1:], s[:-1], out=first[1:])
        rank = xp.cumsum(first)  # 1-based rank of each distinct position
        ends = xp.searchsorted(s, xp.asarray(np.array([lay.offsets[i] + lay.sizes[i] for i in comp], np.int64)))
        upto = _arr.to_host(rank.take(ends - 1)).tolist()  # the one host read
        out = xp.empty(upto[-1], np.int64)
        rank -= 1
        out[rank] = s  # equal positions write the same value to the same slot
        prev = 0
        for i, u in zip(comp, upto):
            picks[i] = IndexPicks(lay.sizes[i], out[prev:u] - lay.offsets[i])
            prev = u
        return Selection(lay, picks, xp)

    def picks(self, t, i, xp=np):
        raise ConfigError("the topk mask needs every rank's data: use select(t, xp, views, transport)")

    def count(self, t, i):
        raise ConfigError("the topk mask's counts are known only after its collective selection")

    def select(self, t, xp=np, views=None, transport=None):
        """Collective: ``views`` is this rank's data, a fused buffer or one 1-D array per tensor."""
        if views is None or transport is None:
            raise ConfigError("the topk mask needs the data and a transport to select indices")
        if hasattr(views, "ndim") and views.ndim == 1 and views.size == self.layout.total:
            views = self.layout.flat_views(views)
        local = {i: self.pick(i, views[i].reshape(-1)) for i in self.layout.compressible}
        return self.union(xp, local, transport)


_MASKS = {m.kind: m for m in (CyclicMask, BernoulliMask, TopKUnionMask)}


def make_mask(kind, layout, ratio, seed, block=1, schedule=None):
    """Build the mask named ``kind`` ('cyclic', 'bernoulli' or 'topk'); ``block`` is the cyclic
    mask's run length; ``schedule``: its ratio changes so far, as :meth:`CyclicMask.schedule`
    gives them (the last entry's ratio is ``ratio``)."""
    if kind not in _MASKS:
        raise ConfigError(f"unknown mask {kind!r}; choose one of {sorted(_MASKS)}")
    if kind == "cyclic":
        if not schedule:
            return CyclicMask(layout, ratio, seed, block)
        (k, o), *rest = schedule
        mask = CyclicMask(layout, k, seed, block, origin=o)
        for k, o in rest:
            mask = mask.rebased(k, o)
        if mask.ratio != check_ratio(ratio):
            raise ConfigError(f"the mask's schedule {schedule} ends at ratio {mask.ratio}, not {ratio}")
        return mask
    if check_block(block) != 1:
        raise ConfigError(f"block={block} applies to the cyclic mask only, not {kind!r}")
    if layout.shards is not None:
        raise ConfigError(f"the {kind!r} mask draws its positions per piece, so shards of one tensor would not "
                          "pick the unsharded positions: sharded tensors take mask='cyclic'")
    return _MASKS[kind](layout, ratio, seed)
