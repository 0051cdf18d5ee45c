"""1-bit LAMB's step on a device (docs/onebit_lamb.md section 5): :class:`LambOnDevice`, the
device state of one :class:`~slamb_comm.methods.onebit_lamb.OneBitLambRule` beyond m, v and f, and the
launches of :mod:`slamb_comm.device.onebit_kernels`' kernels for its step. The rule decides what runs;
this module only launches, declaring the bytes each launch moves."""

import numpy as np

from .. import arrays as _arr
from . import tables as _dev
from . import onebit_kernels as _ok
from .kernels import TILE

__all__ = ["LambOnDevice"]


class LambOnDevice:
    """The device side of one :class:`OneBitLambRule` beyond m, v and f, and its launches: the
    layout's tiles and tables of addresses (the communicator's), three float64 partials per tile,
    a flag word, and the per-tensor numbers as the rows of ``stat`` (κ, φ, the last coefficients,
    γ, the rates), copied in from the optimizer's lists only when those changed (the first step,
    a load) and read back with the step's one host read. Each launch declares the bytes it moves."""

    def __init__(self, xp, opt):
        self.opt, self.lay = opt, opt.layout
        self.tiles, self.tables = opt.comm.device_tables(xp)
        self.T, self.N, self.isz = len(self.lay), self.lay.total, self.lay.dtype.itemsize
        self.partials = xp.empty(3 * max(1, self.tiles.count), np.float64)
        self.word = xp.zeros(8, np.uint32)
        self.stat = None
        self._synced = None  # the lists stat was last equal to

    def row(self, k):
        return self.stat[k * self.T : (k + 1) * self.T]

    def operand(self, xp, role, a, views):
        """``a`` (a fused buffer or a list, ``views`` its validated tensors) as the kernels read it."""
        fused = not isinstance(a, (list, tuple))
        return _dev.tensors(xp, self.tables, f"onebit_lamb {role}", _arr.as_array(a) if fused else views, self.lay.dtype)

    def _lists(self):
        opt = self.opt
        return tuple(None if r is None else tuple(r) for r in (opt.kappa, opt.phi, opt.lamb_coeffs, opt.gamma))

    def copy_in(self, xp):
        """``stat`` from the optimizer's lists, where they are not what it holds (a copy to the device)."""
        key = self._lists()
        if key != self._synced:
            opt, T = self.opt, self.T
            rows = [opt.kappa, opt.phi, opt.lamb_coeffs, opt.gamma or [1.0] * T, [0.0] * T]
            self.stat = xp.asarray(np.asarray(rows, np.float64).reshape(-1))
            self._synced = key

    def read_back(self, gamma):
        """The step's host read: κ, φ and the coefficients (and γ where this step fixed it) into the lists."""
        opt, T = self.opt, self.T
        rows = _arr.to_host(self.stat[: 4 * T]).reshape(4, T).tolist()
        opt.kappa[:], opt.phi[:], opt.lamb_coeffs[:] = rows[0], rows[1], rows[2]
        if gamma:
            opt.gamma = rows[3]
        self._synced = self._lists()

    def _launch(self, xp, kind, args, reads, writes, vdt=None, grid=None):
        dtypes = (self.lay.dtype,) if vdt is None else (self.lay.dtype, vdt)
        tiles = [("tables", 20 * self.tiles.count)]
        _ok.launch(xp, _ok.name(kind, *dtypes), self.tiles.count if grid is None else grid, args, reads + tiles, writes)

    def scan(self, xp, g, out):
        """The gradient ``g`` copied into the fused ``out`` and checked (the warm-up's input to the
        dense allreduce), or with ``out`` None M checked (the compression stage at P = 1):
        ``word[2]`` says whether some value is not finite."""
        opt, N, isz = self.opt, self.N, self.isz
        b1 = opt.betas[0]
        args = (*_dev.tiled(self.tiles), g.tab, g.flat, g.fused, self.tiles.toff, opt.m, self.row(3), np.float64(b1),
                np.float64(1.0 - b1), _dev.dummy(xp, self.lay.dtype, out), np.int32(out is None), self.word)
        reads = [("g", N * isz), ("m", 0 if out is not None else N * isz), _dev.table_bytes(g, self.T)]
        self._launch(xp, "scan", args, reads, [("gradient", 0 if out is None else N * isz)])

    def _direction(self, c1, cv):
        return np.float64(c1), np.float64(cv), np.float64(self.opt.eps), np.float64(self.opt.weight_decay)

    def warm(self, xp, x, gbar, copy_f, c1, c2):
        """The warm-up's moments on the mean gradient ``gbar`` (and ``f = v`` where ``copy_f``), each
        tile's ``||x||²`` and ``||u||²`` (docs/onebit_lamb.md section 2.2, steps 1-3)."""
        opt, N, isz = self.opt, self.N, self.isz
        (b1, b2), f = opt.betas, _dev.dummy(xp, self.lay.dtype, opt.f if copy_f else None)
        args = (*_dev.tiled(self.tiles), x.tab, x.flat, x.fused, self.tiles.toff, gbar, opt.m, opt.v, f,
                np.int32(copy_f), np.float64(b1), np.float64(1.0 - b1), np.float64(b2), np.float64(1.0 - b2),
                *self._direction(c1, c2), self.partials)
        self._launch(xp, "warm", args, [("x, g, m, v", 4 * N * isz), _dev.table_bytes(x, self.T)],
                     [("m, v, f", (3 if copy_f else 2) * N * isz), ("partials", 24 * self.tiles.count)])

    def comp(self, xp, x, g, w, errors, corrections):
        """The compression stage's moments (docs/onebit_lamb.md section 2.3, steps 4-9): M
        decoded from phase 2's blocks (``w``, the exchange's :class:`~slamb_comm.exchange.onebit.DeviceWire`;
        None at P = 1: M from m and ``g``), m, f, each tile's largest ratio and norms; then the
        error buffers (``errors``: worker, server) committed in place from ``w.c`` and ``w.u``."""
        opt, N, isz, ex = self.opt, self.N, self.isz, self.opt.exchange
        (b1, b2), (c1, cv, cf), dt = opt.betas, corrections, self.lay.dtype
        u8, on = _dev.dummy(xp, np.uint8), w is not None
        e, es = errors if on else (None, None)
        Np, nc = (ex.padded, ex.chunk) if on else (0, 0)
        blocks = (w.recv2, w.send, w.send2) if on else (u8, u8, u8)
        args = (*_dev.tiled(self.tiles), x.tab, x.flat, x.fused, g.tab, g.flat, g.fused, self.tiles.toff, opt.m, opt.v,
                opt.f, self.row(3), np.int32(on), blocks[0], np.int64(ex.block), np.int64(ex.chunk), np.float64(b1),
                np.float64(1.0 - b1), np.float64(b2), np.float64(1.0 - b2), np.float64(c1), *self._direction(cv, cf),
                self.partials, _dev.dummy(xp, dt, w and w.c), _dev.dummy(xp, dt, e), np.int64(Np), blocks[1],
                _dev.dummy(xp, dt, w and w.u), _dev.dummy(xp, dt, es), blocks[2])
        reads = [("M", N // 8 if on else N * isz), ("m, v, f", 3 * N * isz), ("c, u", (Np + nc) * isz),
                 ("x", N * isz if opt.weight_decay > 0 else 0), _dev.table_bytes(x, self.T)]
        writes = [("m, f", 2 * N * isz), ("errors", (Np + nc) * isz), ("partials", 24 * self.tiles.count)]
        self._launch(xp, "comp", args, reads, writes, ex.value_dtype, max(self.tiles.count, Np // TILE + 1))

    def coeffs(self, xp, compressed, lr):
        """Per tensor, from its tiles' partials: the LAMB coefficient and κ (warm-up), or the factor
        φ (compression), the coefficient and the rate ``lr`` times it, into ``stat``."""
        opt, T = self.opt, self.T
        args = (self.partials, self.tiles.tt0, self.tiles.ntt, np.int64(T), np.int32(compressed),
                np.int32(opt.weight_decay > 0), np.float64(lr), np.float64(opt.c_min), np.float64(opt.c_max),
                np.float64(opt.coeff_beta), np.float64(opt.factor_min), np.float64(opt.factor_max),
                np.float64(opt.factor_threshold), self.stat)
        _ok.launch(xp, "ob_coeffs", T, args, reads=[("partials", 24 * self.tiles.count), ("tables, stat", 32 * T)],
                   writes=[("stat", 24 * T)])

    def update(self, xp, x, c1, cv):
        """``x -= rate u`` with the direction recomputed (docs/onebit_lamb.md sections 2.2 and 2.3)."""
        opt, N, isz = self.opt, self.N, self.isz
        args = (*_dev.tiled(self.tiles), x.tab, x.flat, x.fused, self.tiles.toff, opt.m, opt.v, *self._direction(c1, cv),
                self.row(4))
        self._launch(xp, "update", args, [("x, m, v", 3 * N * isz), ("rates", 8 * self.T), _dev.table_bytes(x, self.T)],
                     [("x", N * isz)])

    def gamma(self, xp):
        """The momentum scaling factors γ into ``stat``'s row 3 (the first compression step)."""
        tiles = self.tiles
        args = (*_dev.tiled(tiles), self.opt.m, tiles.tt0, tiles.ntt, np.int64(self.T), self.partials, self.stat,
                self.word)
        self._launch(xp, "gamma", args, [("m", self.N * self.isz), ("partials", 8 * tiles.count)],
                     [("partials", 24 * tiles.count), ("gamma", 8 * self.T)])

    def encode(self, xp, w, g, e):
        """Phase 1's encoding (into the exchange's :class:`~slamb_comm.exchange.onebit.DeviceWire` ``w``) of the
        scaled momentum ``M = γ (β1 m + (1 - β1) g)`` (docs/onebit_lamb.md section 2.3, step 2), computed from m
        and this rank's gradient ``g`` without storing it, plus the worker error ``e`` (None: zeros)."""
        opt, N, isz, dt = self.opt, self.N, self.isz, self.lay.dtype
        b1, ex = opt.betas[0], opt.exchange
        tail, grid, writes = w.worker_pass()
        args = (g.tab, g.flat, g.fused, self.tiles.toff, np.int32(self.T), np.int64(N), opt.m, self.row(3),
                np.float64(b1), np.float64(1.0 - b1), _dev.dummy(xp, dt, e), np.int32(e is not None), *tail)
        reads = [("m, g", 2 * N * isz), ("worker error", 0 if e is None else ex.padded * isz),
                 _dev.table_bytes(g, self.T)]
        _ok.launch(xp, _ok.name("encode_m", dt, ex.value_dtype), grid, args, reads, writes)
