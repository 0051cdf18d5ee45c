"""The communicator: layout agreement, masked allreduce, sparse allgather, sync.

A :class:`Communicator` is built once for a fixed list of arrays (shapes, one dtype,
order) and a transport. Construction is collective: the ranks check that they agree on
the layout and options, and share a random seed broadcast from rank 0. Then:

* :meth:`Communicator.masked_allreduce` -- ``x[M_t] = mean over ranks of x[M_t]``, in
  place, for the shared mask M_t of step t (SLAMB's momentum exchange);
* :meth:`Communicator.sparse_allgather` -- top-k with error feedback: returns the mean
  over ranks of every rank's decoded top-k of ``g + e`` (ALGORITHM.md section 2);
* :meth:`Communicator.sync` -- the dense mean of the whole buffer, in place (periodic
  parameter sync, and the dense baseline).

Each takes either one fused 1-D buffer of ``layout.total`` elements (no copy) or a
list of arrays shaped like the layout (copied into an internal fused buffer and back).

Failure behaviour: every payload carries a status word. A rank whose input is bad
(wrong shape, dtype, contiguity, library) still takes part in the collective with a
dummy payload and then raises the specific error; every other rank raises
:class:`~slamb_comm.errors.PeerError` naming it. Non-finite values (NaN, Inf) are
detected before they reach any state: the exchange raises
:class:`~slamb_comm.errors.NonFiniteError` on every rank and changes nothing (no
momentum, parameter or error buffer is written). The check costs one pass over the
payload and, on a GPU, one host read per exchange.
"""

import secrets
import time

import numpy as np

from . import arrays as _arr
from .codecs import DATA_DTYPES, Layout, TopKWire, check_block, check_ratio, make_mask
from .errors import (
    ConfigError,
    DTypeError,
    LayoutError,
    LayoutMismatchError,
    NonContiguousError,
    NonFiniteError,
    PeerError,
    SlambCommError,
)
from .stats import Stats, Traffic, allgather_wire, allreduce_wire
from .transports import LocalTransport

__all__ = ["Communicator"]

_OK, _BAD_INPUT, _NON_FINITE = 0, 1, 2


class Communicator:
    """Sparse and dense exchanges of one fixed set of arrays among all ranks of a transport.

    Args:
        transport: an :class:`~slamb_comm.transports.MPITransport`,
            :class:`~slamb_comm.transports.NCCLTransport`, a Horovod transport, or
            ``None`` for a single process (:class:`~slamb_comm.transports.LocalTransport`).
        arrays: the arrays to exchange (only shapes and the dtype are used here), or a
            :class:`~slamb_comm.codecs.Layout`.
        names: optional tensor names for error messages.
        ratio: the fraction k in (0, 1] that sparse exchanges send (mask size, top-k count).
        mask: 'cyclic' (default, bounded staleness), 'bernoulli', or 'topk' (union of the
            ranks' top-k picks).
        value_dtype: dtype of sparse payload values: ``None`` (default: the arrays' own
            dtype, so nothing is rounded), 'float32', or 'float16' (half the bytes of fp32;
            values beyond +-65504 become Inf and are rejected as non-finite).
        seed: the mask seed. Whatever each rank passes, rank 0's value is broadcast and
            used by all; ``None`` lets rank 0 draw one. No global RNG is touched.
        dense_threshold: tensors with ndim <= 1 or fewer elements are always exchanged
            whole by the masked allreduce.
        block: run length of the cyclic mask. 1 (default) permutes single elements, as
            ALGORITHM.md section 1 says; a larger value (e.g. 256) permutes runs of that
            many contiguous elements, so the masked allreduce's gather and scatter copy
            whole runs instead of scattered elements (see :class:`~slamb_comm.codecs.CyclicMask`).

    Raises (on every rank, never on one only):
        ConfigError: ratio, mask or threshold out of range or unknown.
        DTypeError: unsupported array or payload dtype.
        LayoutMismatchError: ranks disagree on shapes, dtype, order or options.
        PeerError: another rank raised one of the above.
    """

    def __init__(
        self,
        transport,
        arrays,
        *,
        names=None,
        ratio=0.1,
        mask="cyclic",
        value_dtype=None,
        seed=None,
        dense_threshold=9000,
        block=1,
    ):
        self.transport = transport if transport is not None else LocalTransport()
        self.stats = Stats()
        self.residual = None  # error-feedback buffer of sparse_allgather, allocated on first use
        self._fused = None
        problem = None
        digest = bytes(16)
        try:
            self.ratio = check_ratio(ratio)
            if isinstance(arrays, Layout):
                self.layout = arrays
            else:
                arrs = [_arr.as_array(a) for a in arrays]
                self.layout = Layout.from_arrays(arrs, names=names, dense_threshold=dense_threshold)
            self.value_dtype = _arr.value_dtype(self.layout.dtype if value_dtype is None else value_dtype)
            if mask not in ("cyclic", "bernoulli", "topk"):
                raise ConfigError(f"unknown mask {mask!r}; choose one of ['bernoulli', 'cyclic', 'topk']")
            self.mask_kind = mask
            self.block = check_block(block)
            if mask != "cyclic" and self.block != 1:
                raise ConfigError(f"block={block} applies to the cyclic mask only, not {mask!r}")
            digest = self._digest()
        except (SlambCommError, TypeError) as e:
            problem = e
        self._agree(problem, digest)
        # Share the mask seed: rank 0's (or one it draws) wins, so ranks cannot diverge.
        seed_buf = np.array([secrets.randbits(62) if seed is None else int(seed)], dtype=np.int64)
        self.transport.broadcast(seed_buf, root=0)
        self.seed = int(seed_buf[0])
        self.mask = make_mask(self.mask_kind, self.layout, self.ratio, self.seed, self.block)
        self.wire = TopKWire(self.layout, self.ratio, self.value_dtype)

    # ------------------------------------------------------------------ agreement
    @property
    def rank(self):
        """This process's rank in the transport (0 <= rank < size)."""
        return self.transport.rank

    @property
    def size(self):
        """The number of ranks P taking part in every exchange."""
        return self.transport.size

    def _agree(self, problem, digest):
        """Collective check at construction: same layout and options everywhere, no local error."""
        t = self.transport
        mine = np.zeros(4, dtype=np.int64)
        mine[0] = _OK if problem is None else _BAD_INPUT
        mine[1:3] = np.frombuffer(digest, dtype=np.int64)
        if problem is None:
            mine[3] = self.layout.total
        everyone = np.zeros(4 * t.size, dtype=np.int64)
        t.allgather(mine, everyone)
        everyone = everyone.reshape(t.size, 4)
        failed = [r for r in range(t.size) if everyone[r, 0] != _OK]
        if problem is not None:
            raise problem
        if failed:
            raise PeerError(f"rank(s) {failed} rejected the communicator's arguments (see their error)", failed)
        differ = [r for r in range(t.size) if not np.array_equal(everyone[r, 1:3], everyone[0, 1:3])]
        if differ:
            sizes = {r: int(everyone[r, 3]) for r in range(t.size)}
            raise LayoutMismatchError(
                f"ranks disagree on the exchanged arrays or options: rank(s) {differ} differ from rank 0 "
                f"(total elements per rank: {sizes}); this is rank {t.rank} with {self.layout.describe()}, "
                f"ratio={self.ratio}, mask={self.mask_kind!r}, block={self.block}, value_dtype={self.value_dtype.name}"
            )

    def _digest(self):
        """Layout plus the options every rank must share (block only when it is not 1)."""
        extra = () if self.block == 1 else (("block", self.block),)
        return self.layout.digest(self.ratio, self.mask_kind, self.value_dtype.name, *extra)

    # ------------------------------------------------------------------ inputs
    def _take(self, x):
        """Validate ``x`` locally; return ``(xp, flat, views_to_write_back)``.

        Raises LayoutError/NonContiguousError/DTypeError/TypeError on bad input; the
        caller turns that into a collective failure.
        """
        lay = self.layout
        if isinstance(x, (list, tuple)):
            arrs = [_arr.as_array(a) for a in x]
            xp = _arr.namespace(*arrs) if arrs else np
            if len(arrs) != len(lay):
                raise LayoutError(f"got {len(arrs)} arrays, the communicator was built for {len(lay)}")
            for a, name, shape in zip(arrs, lay.names, lay.shapes):
                if tuple(a.shape) != shape:
                    raise LayoutError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
                if a.dtype.name not in DATA_DTYPES:
                    raise DTypeError(f"tensor {name!r} has unsupported dtype {a.dtype.name}; expected {lay.dtype.name}")
                if a.dtype != lay.dtype:
                    raise LayoutError(f"tensor {name!r} has dtype {a.dtype.name}, expected {lay.dtype.name}")
                if not a.flags.c_contiguous:
                    raise NonContiguousError(f"tensor {name!r} is not C-contiguous")
            flat = self._fused_buffer(xp)
            for v, a in zip(lay.views(flat), arrs):
                v[...] = a
            return xp, flat, arrs
        flat = _arr.as_array(x)
        xp = _arr.namespace(flat)
        if flat.ndim != 1 or flat.size != lay.total:
            raise LayoutError(f"expected a fused 1-D buffer of {lay.total} elements, got shape {tuple(flat.shape)}")
        if flat.dtype.name not in DATA_DTYPES:
            raise DTypeError(f"fused buffer has unsupported dtype {flat.dtype.name}; expected {lay.dtype.name}")
        if flat.dtype != lay.dtype:
            raise LayoutError(f"fused buffer has dtype {flat.dtype.name}, expected {lay.dtype.name}")
        if not flat.flags.c_contiguous:
            raise NonContiguousError("fused buffer is not C-contiguous")
        if self.residual is not None and _arr.namespace(self.residual) is not xp:
            raise TypeError(f"the communicator's state lives in {_arr.namespace(self.residual).__name__}, got {xp.__name__}")
        return xp, flat, None

    def _fused_buffer(self, xp):
        if self._fused is None or _arr.namespace(self._fused) is not xp:
            self._fused = xp.empty(self.layout.total, dtype=self.layout.dtype)
        return self._fused

    def _take_or_dummy(self, x):
        try:
            return (*self._take(x), None)
        except (SlambCommError, TypeError) as e:
            xp = np if self.residual is None else _arr.namespace(self.residual)
            return xp, xp.zeros(self.layout.total, self.layout.dtype), None, e

    def _fail(self, codes, problem, what, tensors=()):
        """Raise the right error on this rank, given every rank's status code."""
        if problem is not None:
            raise problem
        bad = [r for r, c in enumerate(codes) if c == _BAD_INPUT]
        if bad:
            raise PeerError(f"{what}: rank(s) {bad} rejected their input (see their error); nothing was changed", bad)
        nonfinite = [r for r, c in enumerate(codes) if c == _NON_FINITE]
        where = f" in tensor(s) {list(tensors)}" if tensors else ""
        if nonfinite:
            msg = f"{what}: non-finite values (NaN/Inf) from rank(s) {nonfinite}{where}; nothing was changed"
        else:
            msg = f"{what}: the sum over ranks overflowed to Inf{where}; nothing was changed"
        raise NonFiniteError(msg, nonfinite, tensors)

    def _check_sum(self, buf, problem, sent, idx, what):
        """After an allreduce whose last slot is 0 (ok) or NaN (a rank's problem): raise on every
        rank if anything is non-finite. One host read on the success path; ``sent()`` gives
        what this rank sent (or None if it flagged itself non-finite)."""
        xp = _arr.namespace(buf)
        finite = xp.isfinite(buf)
        if bool(finite.all()):
            return
        if problem is not None:
            code = _BAD_INPUT
        else:
            mine = sent()  # None: this rank already knows it is non-finite
            code = _OK if mine is not None and bool(xp.isfinite(mine).all()) else _NON_FINITE
        codes = self._codes(code)
        bad_pos = xp.nonzero(~finite[:-1])[0]
        if idx is not None:
            bad_pos = idx[bad_pos]
        self._fail(codes, problem, what, self._tensors_at(bad_pos) if bad_pos.size else ())

    def _codes(self, code):
        """Every rank's status code (used only on the failure path)."""
        mine = np.array([code], dtype=np.int32)
        everyone = np.zeros(self.size, dtype=np.int32)
        self.transport.allgather(mine, everyone)
        return everyone.tolist()

    def _tensors_at(self, positions):
        pos = np.unique(_arr.to_host(positions))
        starts = np.asarray(self.layout.offsets)
        hit = np.unique(np.searchsorted(starts, pos, side="right") - 1)
        return [self.layout.names[i] for i in hit]

    # ------------------------------------------------------------------ operations
    def masked_allreduce(self, x, step, local_nonfinite=False):
        """In place: ``x[M_t] = mean over ranks of x[M_t]`` for the shared mask of ``step``.

        Args:
            x: the fused buffer (or list of arrays) holding this rank's values.
            step: the 1-based step t that selects M_t (the same on every rank).
            local_nonfinite: set by a caller that found non-finite values this rank does
                not send now (e.g. elsewhere in its momentum); every rank then raises
                :class:`~slamb_comm.errors.NonFiniteError` naming this rank, and nothing changes.

        Returns:
            ``x``, and the positions M_t in the fused buffer (an int array, in payload order).
        """
        x, sel = self._masked_allreduce(x, step, local_nonfinite)
        return x, sel.index

    def _masked_allreduce(self, x, step, local_nonfinite):
        """:meth:`masked_allreduce`, returning the :class:`~slamb_comm.codecs.Selection` of M_t."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ConfigError(f"step must be an integer >= 1, got {step!r}")
        t0 = time.perf_counter()
        xp, flat, arrs, problem = self._take_or_dummy(x)
        sel = self.mask.select(step, xp=xp, flat=flat, transport=self.transport)
        m = sel.size
        buf = xp.empty(m + 1, dtype=self.value_dtype)
        sel.take(flat, out=buf[:m])
        buf[m] = np.nan if problem is not None or local_nonfinite else 0
        t1 = time.perf_counter()
        self.transport.allreduce(buf)
        t2 = time.perf_counter()
        self._check_sum(
            buf, problem, lambda: None if local_nonfinite else sel.take(flat, out=xp.empty(m, self.value_dtype)),
            sel.index,
            f"masked_allreduce at step {step}",
        )
        # Divide in the wider of the two dtypes: a float16 buffer's sum may exceed 65504, its mean not.
        vals = buf[:m].astype(np.promote_types(buf.dtype, flat.dtype), copy=False)
        if self.size > 1:
            vals *= vals.dtype.type(1.0 / self.size)
        sel.put(flat, vals)
        self._write_back(flat, arrs)
        t3 = time.perf_counter()
        payload = (m + 1) * self.value_dtype.itemsize
        dense = self.layout.total * self.layout.dtype.itemsize
        self.stats.record(
            "masked_allreduce",
            Traffic(1, payload, allreduce_wire(payload, self.size), dense, allreduce_wire(dense, self.size),
                    m, self.layout.total, t1 - t0, t2 - t1, t3 - t2),
        )
        return x, sel

    def sparse_allgather(self, x):
        """Top-k exchange with error feedback (ALGORITHM.md section 2).

        ``c = x + e``; send each tensor's ``k_elems`` largest ``|c|``; ``e = c - sent``;
        return the mean over ranks of every rank's decoded payload, identical on every
        rank. ``x`` itself is not modified.

        Returns:
            a fused buffer (if ``x`` was one) or a list of arrays shaped like the layout.
        """
        t0 = time.perf_counter()
        xp, flat, arrs, problem = self._take_or_dummy(x)
        w = self.wire
        e = self.residual if self.residual is not None else xp.zeros(self.layout.total, self.layout.dtype)
        c = flat + e
        send = w.empty(xp)
        status, _, val = w.parts(send)
        code = _BAD_INPUT if problem is not None else (_OK if bool(xp.isfinite(c).all()) else _NON_FINITE)
        pos = None
        if code == _OK:
            pos = w.encode(c, send)
            if not bool(xp.isfinite(val).all()):  # e.g. beyond +-65504 in a float16 payload
                code = _NON_FINITE
        status[0] = code
        t1 = time.perf_counter()
        recv = w.empty(xp, self.size)
        self.transport.allgather(send, recv)
        t2 = time.perf_counter()
        recv = recv.reshape(self.size, w.nbytes)
        codes = _arr.to_host(recv[:, :4].copy().view(np.int32)).ravel().tolist()
        if any(codes):
            self._fail(codes, problem, "sparse_allgather")
        # Sum float16 buffers in float32: the sum over ranks may exceed 65504, the mean does not.
        acc = np.promote_types(self.layout.dtype, np.float32)
        out = xp.zeros(self.layout.total, dtype=acc)
        for r in range(self.size):
            w.decode_add(recv[r], out)
        if self.size > 1:
            out *= out.dtype.type(1.0 / self.size)
        if acc != self.layout.dtype:
            out = out.astype(self.layout.dtype)
        c[pos] -= val.astype(c.dtype, copy=False)  # what was not sent (and rounding) stays
        self.residual = c
        t3 = time.perf_counter()
        payload = w.nbytes
        dense = self.layout.total * self.layout.dtype.itemsize
        self.stats.record(
            "sparse_allgather",
            Traffic(1, payload, allgather_wire(payload, self.size), dense, allreduce_wire(dense, self.size),
                    w.k_total, self.layout.total, t1 - t0, t2 - t1, t3 - t2),
        )
        if arrs is not None:
            return self.layout.views(out)
        return out

    def sync(self, x):
        """In place: ``x = mean over ranks of x`` in one fused allreduce, in ``x``'s own dtype.

        Used for SLAMB's periodic parameter sync and as the dense baseline.
        """
        t0 = time.perf_counter()
        xp, flat, arrs, problem = self._take_or_dummy(x)
        n = self.layout.total
        buf = xp.empty(n + 1, dtype=flat.dtype)
        buf[:n] = flat
        buf[n] = 0 if problem is None else np.nan
        t1 = time.perf_counter()
        self.transport.allreduce(buf)
        t2 = time.perf_counter()
        self._check_sum(buf, problem, lambda: flat, None, "sync")
        if self.size > 1:
            buf *= flat.dtype.type(1.0 / self.size)
        flat[...] = buf[:n]
        self._write_back(flat, arrs)
        t3 = time.perf_counter()
        payload = (n + 1) * flat.dtype.itemsize
        dense = n * self.layout.dtype.itemsize
        self.stats.record(
            "sync",
            Traffic(1, payload, allreduce_wire(payload, self.size), dense, allreduce_wire(dense, self.size),
                    n, n, t1 - t0, t2 - t1, t3 - t2),
        )
        return x

    def _write_back(self, flat, arrs):
        if arrs is not None:
            for a, v in zip(arrs, self.layout.views(flat)):
                a[...] = v

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """This rank's state: the error buffer (host copy) and the mask's seed and kind."""
        return {
            "residual": None if self.residual is None else _arr.to_host(self.residual).copy(),
            "seed": self.seed,
            "mask": self.mask.state_dict(),
            "digest": self._digest().hex(),
        }

    def load_state_dict(self, state, xp=np):
        """Restore :meth:`state_dict` output exactly (``xp``: where the error buffer lives)."""
        mine = self._digest().hex()
        if state.get("digest") != mine:
            raise LayoutMismatchError("the saved state was made for a different layout or options")
        if int(state["seed"]) != self.seed:
            self.seed = int(state["seed"])
            self.mask = make_mask(self.mask_kind, self.layout, self.ratio, self.seed, self.block)
        r = state["residual"]
        self.residual = None if r is None else xp.asarray(r).copy()
