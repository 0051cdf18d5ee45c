"""SLAMB's step on a device: a few kernels whatever the number of tensors (the GPU path of :meth:`SlambRule.step`).

:class:`~slamb_comm.methods.slamb.SlambRule` does its CPU step tensor by tensor, in cache-sized blocks. On a
device a step is bound by memory traffic and launches, so :class:`DeviceStep` runs the same step
(docs/algorithm.md section 1: the same positions, the same payload bits) as the kernels of
:mod:`slamb_comm.device.kernels` over a table of tiles:

1. ``slamb_pack``: the gradient read once (NaN, Inf or a square that overflows v sets the status
   word), this rank's new momentum on M_t written into the payload;
2. one allreduce of the payload; then either ``slamb_verdict``, which flags a non-finite sum on the
   device (a step decided there: ``on_nonfinite='skip'``), or one host read of it
   (:meth:`Communicator.reduce_checked`);
3. ``slamb_moments``: m and v committed, M_t's means put into m, the direction w formed and each
   tile's squared norms summed (float32 over a thread's run, float64 above it; w is not stored);
4. ``slamb_trust``: per tensor, its tiles' partial sums in tile order, the trust ratios, the rates;
5. ``slamb_update``: w recomputed, each element's freshness derived from the mask's formula, x updated;
6. after steps 1, H + 1, ...: the periodic sync of x (:meth:`Communicator.sync`).

Kernels 3 to 5 change nothing when the verdict says so; the verdict's word travels back to pinned host
memory behind an event, and :meth:`SlambRule.settle` (the next step, or a read of
``skipped_steps``) takes a skipped step back. So a step makes no host read and queues behind the
backward pass; a periodic-sync step waits for its own verdict before it averages the parameters.

**Costs per step** (float32, ratio k, N parameters; counted on the tests' strict CuPy double by
``python3 benchmarks/launches.py``): about 44 bytes of device traffic per parameter for the
three passes (the gradient's check 4, moments 24, update 16) plus the payload's few bytes; 7
device operations at two ranks and no host read (two on a periodic-sync step), at any number of
tensors, on a fused buffer or a list of arrays, in the mask's first cycle and after a ratio change
too; no host-to-device copy once the tables are built (a table of device addresses is copied when
the arrays move). Memory beyond m and v: the payload (``k N`` values and the always-dense tensors),
one float64 partial per tile and tensor, small tables.

**The kernels' arithmetic** (issue 43): what is per group of C units is done per group -- each tile
hashes its groups once into shared memory, and an element's group is one 32-bit multiply
(:func:`divisor`) -- indices inside a tile are 32-bit, the freshness and the update's coefficient are
computed in the parameters' dtype, and registers stay at or under 40 per thread (sm_90,
``tests/test_kernels_ptxas.py``), so occupancy does not cap the bandwidth.

**Parameters and gradients are read where they are**: through a table of device addresses, one
per tensor, built from a fused buffer, a list of arrays, or an adapter's :class:`Addresses`, and
copied to the device only when an address changes.

Where this path does not apply the step goes tensor by tensor (:func:`applies`): NumPy arrays,
the bernoulli and topk masks, ``block > 1``, more than :data:`MAX_LEVELS` ratio changes within one
cycle, and tensors that once skipped a step (their freshness is stored, not derived).
"""

import math
from typing import NamedTuple

import numpy as np

from .. import arrays as _arr
from . import tables as _dev
from . import kernels as _k
from ..errors import LayoutError, NonFiniteError

__all__ = ["DeviceStep", "Plan", "applies", "MAX_LEVELS"]

#: the unit shift that marks an always-dense tensor in the kernels' tables (``SLAMB_DENSE_SHIFT``): a
#: compressible piece of a sharded tensor may have a negative shift (its units start past its offset)
DENSE_SHIFT = np.iinfo(np.int64).min

#: the masks whose freshness the update kernel derives: the current one and those before it still
#: within their first cycle (a ratio schedule that changes more often goes tensor by tensor)
MAX_LEVELS = 4

#: the kernels count chunks in 32 bits (a ratio below about 5e-10 goes tensor by tensor)
MAX_CHUNKS = (1 << 31) - _k.TILE


def divisor(C):
    """``M`` such that ``(p M) >> 32 == p // C`` for every position ``p < C + TILE`` of a tile's span
    (``2**32 // C + 1``), or 0 where no such 32-bit M exists (the kernels divide then; C = 1 has no
    compressible tensor)."""
    return np.uint32(2**32 // C + 1) if 1 < C and C * (C + _k.TILE) < 2**32 else np.uint32(0)

def applies(slamb, x, g, xp, skip):
    """Whether :class:`DeviceStep` can take this step (see the module docstring)."""
    mask = slamb.comm.mask
    if slamb.fused is False or xp is np or skip or slamb.has_stored_freshness or len(slamb.layout) == 0:
        return False
    return (mask.kind == "cyclic" and mask.block == 1 and mask.num_chunks < MAX_CHUNKS
            and (mask.settled(slamb.t + 1) or len(mask.levels()) <= MAX_LEVELS))


class Plan:
    """The device tables of one layout, mask, device and grouping of the tensors (built once).

    Tiles: ``TILE`` consecutive elements of one tensor, ordered by group, then by tensor in the
    group's order, so that a group's tiles are one range (one pack launch) and a tensor's tiles
    are one range (its partial sums). Per tensor: its offset, its unit shift (a compressible
    element i is unit ``i - shift``; :data:`DENSE_SHIFT` marks an always-dense tensor) and, per chunk j, the base
    of its payload index. The payload (the "arena") holds, per chunk, every group's tensors'
    segments followed by that group's status word.
    """

    def __init__(self, layout, mask, xp, groups=None):
        T = len(layout)
        self.xp, self.mask = xp, mask
        self.C = mask.num_chunks
        self.C32, self.M = np.uint32(self.C), divisor(self.C)  # as the kernels take them
        self.tiles = _dev.Tiles(layout, xp, groups)
        self.groups = self.tiles.groups
        self.comp = set(layout.compressible) if self.C > 1 else set()
        shift = [layout.offsets[i] - mask.first_unit(i) if i in self.comp else DENSE_SHIFT for i in range(T)]
        self.tshift = xp.asarray(np.asarray(shift, np.int64))
        counts, g0 = self._chunk_tables(layout)
        self._arena(layout, counts, g0)

    def _chunk_tables(self, layout):
        """Per chunk j and tensor: its elements in M_t (``counts``) and, for a compressible tensor,
        the group of its first selected unit (``g0``; the k-th selected unit of the tensor is in
        group g0 + k: one per group)."""
        C, T, mask = self.C, len(layout), self.mask
        counts = np.zeros((C, T), np.int64)
        g0 = np.zeros((C, T), np.int64)
        j = np.arange(C, dtype=np.int64)
        for i in range(T):
            n = layout.sizes[i]
            if i not in self.comp:
                counts[:, i] = n
                continue
            qs = mask.first_unit(i)
            qe = qs + n
            gh, gt = qs // C, (qe - 1) // C
            head = gh * C + (j - mask.rotation(gh)) % C
            tail = gt * C + (j - mask.rotation(gt)) % C
            inside = lambda q: (q >= qs) & (q < qe)  # noqa: E731
            counts[:, i] = max(0, gt - gh - 1) + inside(head) + (inside(tail) if gt != gh else 0)
            g0[:, i] = np.where(head >= qs, gh, gh + 1)
        return counts, g0

    def _arena(self, layout, counts, g0):
        C, T = self.C, len(layout)
        pstart = np.zeros((C, T), np.int64)
        self.status = np.zeros((C, len(self.groups)), np.int64)  # per chunk and group: its status word
        self.group_start = np.zeros((C, len(self.groups)), np.int64)
        for jj in range(C):
            at = 0
            for k, grp in enumerate(self.groups):
                self.group_start[jj, k] = at
                for i in grp:
                    pstart[jj, i] = at
                    at += counts[jj, i]
                self.status[jj, k] = at
                at += 1
        self.counts, self.pstart = counts, pstart
        self.size = self.status[:, -1] + 1  # the arena's used length per chunk
        base = pstart - np.where([i in self.comp for i in range(T)], g0, 0)
        self.pbase = self.xp.asarray(base.reshape(-1))

    def bad_tensors(self, j, summed):
        """The tensors whose values in the summed payload ``summed`` (a host array of chunk j) are not
        finite (the failure path)."""
        bad = ~np.isfinite(summed)
        return [i for i in range(self.counts.shape[1])
                if self.counts[j, i] and bad[self.pstart[j, i] : self.pstart[j, i] + self.counts[j, i]].any()]

    def k_of(self, j, group=None):
        """The payload values of chunk j (of one group, or of all), status words excluded."""
        if group is None:
            return int(self.size[j]) - len(self.groups)
        lo, hi = self.group_start[j, group], self.status[j, group]
        return int(hi - lo)


class _Levels(NamedTuple):
    """The masks the update kernel derives freshness from, after step t (see ``slamb_update_impl``)."""

    C0: int
    s0: int
    count: int
    table: object  # (C, steps run) of each earlier mask, newest first, on the device

    def args(self):
        """``C0, jj, full, s0`` as the update kernel takes them (s0 only matters within the first cycle)."""
        full = self.s0 > self.C0
        return (np.uint32(self.C0), np.uint32((self.s0 - 1) % self.C0), np.uint32(full),
                np.uint32(0 if full else self.s0))


class _Tables:
    """Small device tables of one :class:`DeviceStep`, each built once for the values it holds: per-tensor
    constants, the masks' levels and the powers of beta3."""

    def __init__(self):
        self._tables = {}  # (name, values) -> device table

    def get(self, xp, key, make):
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = xp.asarray(make())
        return table

    def per_tensor(self, xp, name, values, one):
        """Per-tensor float64 constants: ``(scalar, table, 0)`` when all are equal (no table, no copy: a
        schedule that changes them every step costs nothing), else ``(0.0, table, 1)``, the table copied
        when the values change. ``one``: a one-element device array standing for the table."""
        if len(set(values)) <= 1:
            return np.float64(values[0] if values else 0.0), one, np.int32(0)
        key = (name, tuple(values))
        if key not in self._tables:
            self._tables = {k: v for k, v in self._tables.items() if k[0] != name}
        return np.float64(0.0), self.get(xp, key, lambda: np.asarray(values, np.float64)), np.int32(1)

    def levels(self, xp, mask, t, one):
        """The current mask and those before it whose first cycle is not over at step t."""
        top = (mask.num_chunks, int(t) - mask.origin)
        if mask.settled(t):
            return _Levels(*top, 1, one)
        older = mask.levels()[::-1]  # newest first
        rows = [(m.num_chunks, newer.origin - m.origin) for newer, m in zip(older, older[1:])]
        return _Levels(*top, len(rows) + 1,
                       self.get(xp, ("levels", tuple(rows)), lambda: np.asarray(rows, np.int64).reshape(-1)))

    def powers(self, xp, mask, b3):
        """``beta3 ** n`` for n = 0 .. the largest C of the masks (float64, as the CPU step)."""
        cmax = max(m.num_chunks for m in mask.levels())
        return self.get(xp, ("pw", b3, cmax), lambda: np.asarray([b3 ** s for s in range(cmax + 1)], np.float64))

    def index(self, xp, name, values):
        """A small int64 device table, built once."""
        return self.get(xp, (name, len(values)), lambda: np.asarray(values, np.int64))


class _Pending(NamedTuple):
    """A step committed before its verdict was read (docs/algorithm.md section 9, on the device)."""

    t: int
    stamp: np.uint32  # the attempt, as the pack kernel marked its bad tensors
    plan: Plan
    lookback: object  # the device's verdict, on its way to the host (:class:`~slamb_comm.device.tables.Lookback`)


class DeviceStep:
    """The device state and kernels of one :class:`~slamb_comm.methods.slamb.SlambRule`'s fused step: the
    plans, the tables of addresses, the payload, the partial sums and the rates. Its owner calls
    :meth:`open_step` and :meth:`close_step`; adapters that overlap the exchange with the backward pass
    call :meth:`pack` per group of tensors, run their own collectives on :meth:`payload`, check them, then
    :meth:`apply` and :meth:`finish`.

    **A step decided on the device** (``open_step(..., defer=True)``): after the payload's allreduce a
    verdict kernel flags a non-finite sum (some rank's status word, or an overflow), the update's kernels
    then change nothing, and the verdict travels back to pinned host memory behind an event. The step is
    committed at once; :meth:`settle` reads the verdict (waiting only if the device has not got there)
    and tells its owner to take the step back. So a step has no host read; the next one settles the last.
    """

    def __init__(self, slamb):
        self.slamb = slamb
        self._plans = {}
        self._tables = _dev.AddressTables(slamb.layout)
        self._arrays = {}  # name -> device scratch (payload, partials, rates, word, ...)
        self._consts = _Tables()
        self._where = None  # (library, device) of all of the above
        self._lookback = None  # the pinned host word the verdicts come back to
        self.pending = None  # the committed step whose verdict is not read yet (a _Pending)

    # ------------------------------------------------------------------ tables
    def plan(self, xp, groups=None):
        """The tables for the current mask, device and grouping (rebuilt when any changes)."""
        where = (xp.__name__, xp.cuda.Device().id)
        if self._where != where:  # another library or device: nothing of the old one is usable
            self.__init__(self.slamb)
            self._where = where
        key = None if groups is None else tuple(map(tuple, groups))
        plan = self._plans.get(key)
        if plan is None or plan.mask is not self.slamb.comm.mask:
            self._plans = {k: p for k, p in self._plans.items() if p.mask is self.slamb.comm.mask}
            plan = self._plans[key] = Plan(self.slamb.layout, self.slamb.comm.mask, xp, groups)
        return plan

    def addresses(self, xp, role, a):
        """The device table of addresses of ``a`` (a fused buffer, a list of arrays, or
        :class:`~slamb_comm.device.tables.Addresses`), copied to the device only when they are new."""
        return self._tables.table(xp, role, a)

    def _scratch(self, xp, name, n, dtype):
        a = self._arrays.get(name)
        if a is None or a.size < n or a.dtype != dtype:
            a = self._arrays[name] = xp.zeros(max(1, n), dtype)
        return a

    def payload(self, plan, t):
        """The payload of step t's chunk (every group's values and status words), on the device."""
        slamb = self.slamb
        arena = self._scratch(plan.xp, "payload", int(plan.size.max()), slamb.comm.value_dtype)
        return arena[: int(plan.size[_chunk(plan, t)])]

    def group_payload(self, plan, t, group):
        """Group ``group``'s part of :meth:`payload`: its values and its status word (one collective)."""
        j = _chunk(plan, t)
        return self.payload(plan, t)[int(plan.group_start[j, group]) : int(plan.status[j, group]) + 1]

    def _word(self, xp):
        """The flags the kernels share (``SLAMB_W_*``): the pack's bad-gradient flag and block counter,
        the update's non-finite flag, and the verdict that the step changes nothing."""
        return self._scratch(xp, "word", WORDS, np.uint32)

    def _tbad(self, xp):
        """Per tensor, the last step at which the pack saw a bad element of it (the failure path's names)."""
        return self._scratch(xp, "tbad", len(self.slamb.layout), np.uint32)

    def _one(self, xp, dtype=np.float64):
        return self._scratch(xp, f"one {np.dtype(dtype).name}", 1, dtype)

    # ------------------------------------------------------------------ kernels
    def pack(self, plan, t, g, group=0, role="g"):
        """Kernel 1 for one group of tensors: check this rank's gradients ``g`` and write its new
        momentum on M_t, and the group's status word, into the payload. ``role`` names the cache of
        ``g``'s table of addresses (one per group when each group's gradients live elsewhere, as
        DDP's buckets do)."""
        slamb, xp = self.slamb, plan.xp
        lay, dt = slamb.layout, slamb.layout.dtype
        j, T = _chunk(plan, t), len(lay)
        gtab = self.addresses(xp, role, g)
        arena = self.payload(plan, t)
        vdt = arena.dtype
        lo, hi = plan.tiles.group_tiles[group]
        b1 = slamb.betas[0]
        n = int(plan.tiles.elems[lo:hi].sum())
        k = plan.k_of(j, group)
        args = (*plan.tiles.table, np.int64(lo), np.int64(hi), gtab, plan.tiles.toff, plan.tshift,
                plan.pbase[j * T : (j + 1) * T], slamb.m, arena, np.int64(plan.status[j, group]), np.float64(0.0),
                np.float64(b1), np.float64(1.0 - b1), np.uint64(slamb.comm.mask.key), plan.C32, np.uint32(j),
                self._tbad(xp), _stamp(slamb.opened), self._word(xp))
        _k.launch(xp, _k.kernel_name("pack", dt, vdt), min(hi - lo, _dev.GRID), args,
                  reads=[("g", n * dt.itemsize), ("m on M_t", k * dt.itemsize), ("tables", (hi - lo) * 20 + T * 24)],
                  writes=[("payload", (k + 1) * vdt.itemsize)])

    def exchange(self, plan, t, g, defer=False):
        """Step t's exchange after :meth:`pack` of every group: one allreduce of the payload, its bytes
        counted. Then either the verdict on the device (``defer``; :meth:`settle` reads it later), or one
        host read: NonFiniteError on every rank (nothing changed) if some rank's gradient was bad, naming
        this rank's bad tensors."""
        comm, xp = self.slamb.comm, plan.xp
        buf = self.payload(plan, t)
        if defer:
            comm.transport.allreduce(buf)  # checked by the verdict kernel instead of a host read
            self.record(plan, t)
            self._verdict(plan, t, buf)
            return
        try:
            stamp = _stamp(self.slamb.opened)
            comm.reduce_checked(buf, None, lambda: self._bad_here(xp, stamp), _what(t),
                                spans=(plan.pstart[_chunk(plan, t)], plan.counts[_chunk(plan, t)]),
                                status_in_buffer=True)
        except NonFiniteError as e:
            self.record(plan, t)  # the failed step's bytes were sent too
            raise self._named(e, xp, stamp) from None
        self.record(plan, t)

    def _verdict(self, plan, t, buf):
        """The verdict kernel on the summed payload, and its word's way back to the host."""
        xp = plan.xp
        word = self._word(xp)
        n = buf.size
        _k.launch(xp, _k.kernel_name("verdict", None, buf.dtype), min(-(-n // _k.TILE), _dev.GRID),
                  (buf, np.int64(n), word), reads=[("summed payload", buf.nbytes)], writes=[("word", 4)])
        if self._lookback is None:
            self._lookback = _dev.Lookback(xp, 1)
        self._lookback.send(xp, word[SKIP : SKIP + 1])
        self.pending = _Pending(t, _stamp(self.slamb.opened), plan, self._lookback)

    def settle(self, wait=False):
        """The pending step (see the class docstring) if the device skipped it, else None; nothing is
        pending afterwards. Reads the verdict back, waiting only if the device has not reached it
        (``wait``: the caller knows it has not)."""
        p, self.pending = self.pending, None
        return p if p is not None and p.lookback.read(wait)[0] else None

    def explain(self, failed):
        """The NonFiniteError of a skipped step that :meth:`settle` returned, as every rank sees it
        (collective: every rank calls it for the same step, before the next step's pack)."""
        comm, plan, t, xp = self.slamb.comm, failed.plan, failed.t, failed.plan.xp
        j = _chunk(plan, t)
        buf = self.payload(plan, t)  # the step's sums, still there
        e = comm.failure(buf, None, self._bad_here(xp, failed.stamp), _what(t), spans=(plan.pstart[j], plan.counts[j]))
        return self._named(e, xp, failed.stamp) if isinstance(e, NonFiniteError) else e

    def bad_tensors(self, xp):
        """This rank's tensors whose gradient :meth:`pack` found bad in the step now open (a host read of a small
        table: for an adapter's failure path, to say which ranks' gradients were bad)."""
        bad = np.flatnonzero(_arr.to_host(self._tbad(xp)) == _stamp(self.slamb.opened))
        return [self.slamb.layout.names[i] for i in bad]

    def _bad_here(self, xp, stamp):
        """Whether this rank's gradient was bad in the attempt ``stamp`` (the failure path: a host read)."""
        return bool((_arr.to_host(self._tbad(xp)) == stamp).any())

    def _named(self, e, xp, stamp):
        """``e`` with this rank's tensors whose gradient was bad in the attempt ``stamp`` (a host read of a
        small table)."""
        bad = np.flatnonzero(_arr.to_host(self._tbad(xp)) == stamp)
        names = [self.slamb.layout.names[i] for i in bad]
        if not names:
            return e
        return NonFiniteError(f"{e} (this rank: non-finite gradient in {names})", e.ranks, names)

    def record(self, plan, t):
        """Count step t's exchange of the payload in the communicator's statistics."""
        comm = self.slamb.comm
        j = _chunk(plan, t)
        comm.record_masked_allreduce(int(plan.size[j]) * comm.value_dtype.itemsize, plan.k_of(j))

    def apply(self, plan, t, x, g, scale, lr=None, weight_decay=None):
        """Kernels 2 to 4 of step t: commit the moments with the exchanged payload (summed over the
        ranks: ``scale`` = 1/P; already averaged: 1), then the trust ratios and the update of x. They
        change nothing where the verdict kernel skipped the step."""
        slamb, xp = self.slamb, plan.xp
        lay, comm = slamb.layout, slamb.comm
        dt, T, N = lay.dtype, len(lay), lay.total
        j = _chunk(plan, t)
        b1, b2 = slamb.betas
        s_u = math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        eps_t = np.float64(slamb.eps * math.sqrt(1.0 - b2**t))
        one = self._one(xp)
        wd = self._consts.per_tensor(
            xp, "wd", slamb.weight_decay if weight_decay is None else slamb.per_tensor(weight_decay, "weight_decay"), one)
        lr = self._consts.per_tensor(xp, "lr", slamb.lr if lr is None else slamb.per_tensor(lr, "lr"), one)
        xtab, gtab = self.addresses(xp, "x", x), self.addresses(xp, "g", g)
        arena = self.payload(plan, t)
        nt, tiles = plan.tiles.count, plan.tiles
        partials = self._scratch(xp, "partials", 4 * nt, np.float64)
        rates = self._scratch(xp, "rates", 2 * T, np.float64)
        word, key, tables = self._word(xp), np.uint64(comm.mask.key), nt * 20 + T * 24
        grid, k, isz = min(nt, _dev.GRID), plan.k_of(j), dt.itemsize
        _k.launch(xp, _k.kernel_name("moments", dt, arena.dtype), grid, (
            *tiles.table, np.int64(nt), xtab, gtab, tiles.toff, plan.tshift, plan.pbase[j * T : (j + 1) * T], slamb.m,
            slamb.v, arena,
            np.float64(scale), np.float64(b1), np.float64(1.0 - b1), np.float64(b2), np.float64(1.0 - b2), eps_t,
            *wd, np.float64(s_u), key, plan.C32, np.uint32(j), plan.M, partials, word),
            reads=[("x, g, m, v", 4 * N * isz), ("means", k * arena.dtype.itemsize), ("tables", tables)],
            writes=[("m, v", 2 * N * isz), ("partials", 32 * nt)])
        self._trust(plan, partials, s_u, lr, rates, word)
        lv = self._consts.levels(xp, comm.mask, t, self._one(xp, np.int64))
        name = _k.kernel_name("update" if lv.count == 1 else "update_levels", dt)
        _k.launch(xp, name, grid, (
            *tiles.table, np.int64(nt), xtab, tiles.toff, plan.tshift, slamb.m, slamb.v, eps_t, *wd, np.float64(s_u),
            rates, key, *lv.args(), plan.M, np.int32(lv.count), lv.table,
            self._consts.powers(xp, comm.mask, slamb.beta3), word),
            reads=[("x, m, v", 3 * N * isz), ("rates", 16 * T), ("tables", tables)], writes=[("x", N * isz)])

    def _trust(self, plan, partials, s_u, lr, rates, word):
        """Kernel 3: the trust ratios and rates from the tiles' partial norms. Sharded tensors
        (``shard_group``): the piece's sums per tensor first, summed over the pieces (one allreduce of
        4 floats per tensor), then the rates from those, as one "tile" per tensor."""
        slamb, xp, tiles = self.slamb, plan.xp, plan.tiles
        T, nt = len(slamb.layout), plan.tiles.count
        grid, sqrt_p = min(T, _dev.GRID), np.float64(math.sqrt(slamb.comm.size))
        bounds, none = (np.float64(slamb.c_min), np.float64(slamb.c_max)), self._one(xp)
        tables = (tiles.tt0, tiles.ntt)
        if slamb.shard_group is not None and slamb.c_min != slamb.c_max:  # fixed ratios (SAdamW): no sums needed
            sums = self._scratch(xp, "sums", 4 * T, np.float64)
            _k.launch(xp, "slamb_trust", grid, (
                partials, *tables, np.int64(T), np.float64(s_u), *lr, sqrt_p, *bounds, rates, word, np.int32(1), sums),
                reads=[("partials", 32 * nt), ("tables", 16 * T)], writes=[("sums", 32 * T)])
            slamb.shard_group.allreduce(sums[: 4 * T])
            partials, nt = sums, T
            tables = (self._consts.index(xp, "first", np.arange(T)), self._consts.index(xp, "ones", np.ones(T)))
        _k.launch(xp, "slamb_trust", grid, (
            partials, *tables, np.int64(T), np.float64(s_u), *lr, sqrt_p, *bounds, rates, word, np.int32(0), none),
            reads=[("partials", 32 * nt), ("tables", 16 * T)], writes=[("rates", 16 * T)])

    def finish(self, t, x, written=None):
        """Commit step t (its update applied), then the periodic sync of x after steps 1, H + 1, ...
        A step decided on the device is settled first there (one host read: the sync must not average a
        skipped step's parameters); a skipped one is then taken back and not synced."""
        slamb = self.slamb
        slamb.end_step(t)
        if written is not None:
            for i in range(len(slamb.layout)):
                written(i)
        if (t - 1) % slamb.sync_interval == 0 and slamb.comm.size > 1:
            if self.pending is not None and slamb.report_skips(wait=True):
                return x
            word = self._word(slamb.xp)
            slamb.comm.sync(x, written=written, bad=word[XBAD])  # the update kernel's flag: x not finite
        return x

    def open_step(self, x, g, defer=False):
        """The next step's exchange on ``x`` (a fused buffer or a list of arrays; only read to know
        the device) from this rank's gradient ``g`` (the same, or :class:`Addresses`): pack every
        group, allreduce, check (``defer``: on the device, see the class docstring). Returns the open
        step for :meth:`close_step`; without ``defer`` raises NonFiniteError on every rank, with the step
        closed and nothing changed, if any rank's gradient is bad."""
        slamb = self.slamb
        first = _first_array(x)
        xp = _arr.namespace(first)
        with _arr.device_scope(first):
            slamb.report_skips()  # the last step's verdict, if it was decided on the device
            slamb.place(first)
            plan = self.plan(xp)
            t = slamb.begin_step()
            try:
                for k in range(len(plan.groups)):
                    self.pack(plan, t, g, k)
                self.exchange(plan, t, g, defer)
            except BaseException:
                slamb.abort_step()
                raise
        return _OpenStep(plan, t)

    def close_step(self, opened, x, g, lr=None, weight_decay=None, written=None):
        """The update of :meth:`open_step`'s step with the summed payload, its commit and the
        periodic sync."""
        with _arr.device_scope(_first_array(x)):
            self.apply(opened.plan, opened.t, x, g, 1.0 / self.slamb.comm.size, lr, weight_decay)
            return self.finish(opened.t, x, written)


class _OpenStep(NamedTuple):
    """A step whose exchange is done and whose update is not (between open_step and close_step)."""

    plan: Plan
    t: int


#: the kernels' flags (``SLAMB_W_*`` of slamb_comm/device/kernels.py): their number, the update's non-finite
#: flag, and the verdict that a step changes nothing
WORDS, XBAD, SKIP = 4, 2, 3


def _chunk(plan, t):
    return plan.mask.chunk(t) if plan.C > 1 else 0


def _stamp(opened):
    """The attempt that ``opened`` counts (steps opened so far, a retried step too) as the pack kernel marks
    a tensor's bad gradient: 32 bits, never 0."""
    return np.uint32((opened - 1) % 0xFFFFFFFF + 1)


def _what(t):
    return f"SLAMB momentum exchange at step {t}"


def _first_array(x):
    if hasattr(x, "shape") or hasattr(x, "__dlpack__"):
        return _arr.as_array(x)
    for v in x:
        return _arr.as_array(v)
    raise LayoutError("no arrays given")
