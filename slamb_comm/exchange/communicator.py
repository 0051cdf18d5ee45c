"""The communicator: layout agreement, masked allreduce, sparse allgather, sync.

A :class:`Communicator` is built once for a fixed list of arrays (shapes, one dtype,
order) and a transport. Construction is collective: the ranks check that they agree on
the layout and options, and share a random seed broadcast from rank 0. Then:

* :meth:`Communicator.masked_allreduce` -- ``x[M_t] = mean over ranks of x[M_t]``, in
  place, for the shared mask M_t of step t (SLAMB's momentum exchange);
* :meth:`Communicator.sparse_allgather` -- top-k with error feedback: returns the mean
  over ranks of every rank's decoded top-k of ``g + e`` (docs/algorithm.md section 2);
* :meth:`Communicator.sync` -- the dense mean of the whole buffer, in place (periodic
  parameter sync, and the dense baseline).

Each takes either one fused 1-D buffer of ``layout.total`` elements or a list of arrays
shaped like the layout, and works on them in place (no copy of the whole model is made).

Failure behaviour: every payload carries a status word. A rank whose input is bad
(wrong shape, dtype, contiguity, library) still takes part in the collective with a
dummy payload and then raises the specific error; every other rank raises
:class:`~slamb_comm.errors.PeerError` naming it. Non-finite values (NaN, Inf) are
detected before they reach any state: the exchange raises
:class:`~slamb_comm.errors.NonFiniteError` on every rank and changes nothing (no
momentum, parameter or error buffer is written). The check costs one pass over the
payload and, on a GPU, one host read per exchange.
"""

import math
import secrets
import time

import numpy as np

from .. import arrays as _arr
from ..wire.codecs import DATA_DTYPES, LazyTensors, Layout, TopKWire, check_ratio, k_elems
from ..wire.masks import BLOCK, check_block, make_mask
from .onebit import OneBitExchange
from ..errors import (
    collective_error,
    ConfigError,
    DTypeError,
    LayoutError,
    LayoutMismatchError,
    NonContiguousError,
    STATUS_BAD_INPUT,
    STATUS_NON_FINITE,
    STATUS_OK,
    PeerError,
    SlambCommError,
)
from ..wire.stats import Stats, Traffic, allreduce_wire
from .sync import ParameterSync
from .topk import TopKExchange
from .transports import LocalTransport

__all__ = ["Communicator"]



def _take(xp, sel, views, out):
    """``sel.take(views, out=out)``; on the CPU, into a payload of another dtype (float16),
    range by range through the arrays' own dtype and :func:`~slamb_comm.arrays.cast_into`
    instead of NumPy's element-wise float16 cast."""
    if xp is not np or not views or out.dtype == views[0].dtype:
        return sel.take(views, out=out)
    tmp = None
    for p, v, s, c in zip(sel.picks, views, sel.starts, sel.counts):
        if not c:
            continue
        v = v.reshape(-1)
        for r in p.ranges(BLOCK):
            a, b = p.span(r)
            if b > a:
                if tmp is None or tmp.size < b - a:
                    tmp = np.empty(b - a, v.dtype)
                _arr.cast_into(out[s + a : s + b], p.take(v, r, tmp[: b - a]))
    return out


class Communicator(ParameterSync, TopKExchange):
    """Sparse and dense exchanges of one fixed set of arrays among all ranks of a transport.

    Args:
        transport: an :class:`~slamb_comm.exchange.transports.MPITransport`,
            :class:`~slamb_comm.exchange.transports.NCCLTransport`, a Horovod transport, or
            ``None`` for a single process (:class:`~slamb_comm.exchange.transports.LocalTransport`).
        arrays: the arrays to exchange (only shapes and the dtype are used here), or a
            :class:`~slamb_comm.wire.codecs.Layout`.
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
            whole by the masked allreduce (default 9000). ``names`` and ``dense_threshold``
            are for a list of arrays; a :class:`Layout` carries its own (ConfigError if given
            beside one).
        block: run length of the cyclic mask. 1 (default) permutes single elements, as
            docs/algorithm.md section 1 says; a larger value (e.g. 256) permutes runs of that
            many contiguous elements, so the masked allreduce's gather and scatter copy
            whole runs instead of scattered elements (see :class:`~slamb_comm.wire.masks.CyclicMask`).
        bucket_bytes: the most scratch :meth:`sync` uses (default 32 MiB): arrays larger
            than that are averaged in several allreduces.
        topk_dense: if True, :meth:`sparse_allgather` sends the always-dense tensors (see
            ``dense_threshold``) whole; by default every tensor sends its top-k, as
            docs/algorithm.md section 2 says.

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
        dense_threshold=None,
        block=1,
        bucket_bytes=32 << 20,
        topk_dense=False,
    ):
        self.transport = transport if transport is not None else LocalTransport()
        self.stats = Stats()
        self.residual = None  # error-feedback buffer of sparse_allgather, allocated on first use
        self._device = {}  # the layout's tiles and tables of addresses on a device (sync of a list)
        self._residual_on_host = False  # restored by load_state_dict, not yet moved to a device
        self._uncommitted = None  # a sparse_allgather(commit=False) waiting for commit_residual()
        self.bucket_bytes = int(bucket_bytes)
        problem = None
        digest = bytes(16)
        try:
            self.ratio = check_ratio(ratio)
            if isinstance(arrays, Layout):
                if names is not None or dense_threshold is not None:
                    raise ConfigError("names and dense_threshold belong to the Layout when one is given: pass "
                                      "Layout(shapes, dtype, names=..., dense_threshold=...), or pass the arrays "
                                      "themselves with names= and dense_threshold=")
                self.layout = arrays
            else:
                arrs = [_arr.as_array(a) for a in arrays]
                self.layout = Layout.from_arrays(arrs, names=names,
                                                 dense_threshold=9000 if dense_threshold is None else dense_threshold)
            self.value_dtype = _arr.value_dtype(self.layout.dtype if value_dtype is None else value_dtype)
            if mask not in ("cyclic", "bernoulli", "topk"):
                raise ConfigError(f"unknown mask {mask!r}; choose one of ['bernoulli', 'cyclic', 'topk']")
            self.mask_kind = mask
            self.block = check_block(block)
            self.topk_dense = bool(topk_dense)
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
        self.wire = TopKWire(self.layout, self.ratio, self.value_dtype, whole_dense=self.topk_dense)

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
        mine[0] = STATUS_OK if problem is None else STATUS_BAD_INPUT
        mine[1:3] = np.frombuffer(digest, dtype=np.int64)
        if problem is None:
            mine[3] = self.layout.total
        everyone = np.zeros(4 * t.size, dtype=np.int64)
        t.allgather(mine, everyone)
        everyone = everyone.reshape(t.size, 4)
        failed = [r for r in range(t.size) if everyone[r, 0] != STATUS_OK]
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

    def _digest(self, ratio=None):
        """Layout plus the options every rank must share (block only when it is not 1)."""
        extra = (() if self.block == 1 else (("block", self.block),)) + ((("topk_dense", True),) if self.topk_dense else ())
        return self.layout.digest(self.ratio if ratio is None else ratio, self.mask_kind, self.value_dtype.name, *extra)

    def set_ratio(self, ratio, step, problem=None):
        """Change k to ``ratio`` for the steps after ``step`` (a ratio schedule, e.g. denser
        first). Collective: every rank calls it with the same ``ratio`` and ``step`` (one
        3-word allgather); the masks and the top-k wire follow the new ratio. The cyclic mask
        starts a new permutation of ``ceil(1/ratio)`` chunks, cycled from step ``step + 1``,
        so the staleness bound holds for the new ratio from the change on; elements keep the
        freshness they had (see :meth:`CyclicMask.rebased`). Error-feedback residuals carry over.

        ``problem``: a local error to raise instead (the other ranks raise PeerError).

        Raises:
            ConfigError: on the ranks whose ratio is invalid, or that change it while another
                rank asks for something else (the others raise PeerError naming them);
                nothing changes on any rank.
        """
        try:
            if problem is None:
                new = check_ratio(ratio)
                if self._uncommitted is not None:
                    raise ConfigError("set_ratio() between sparse_allgather(commit=False) and commit_residual()")
        except ConfigError as e:
            problem = e
        t = self.transport
        mine = np.array([problem is None, math.nan if problem is not None else new, step], dtype=np.float64)
        rows = np.zeros(3 * t.size, dtype=np.float64)
        t.allgather(mine, rows)
        rows = rows.reshape(t.size, 3)
        failed = [r for r in range(t.size) if rows[r, 0] != 1]
        if problem is not None:
            raise problem
        if failed:
            raise PeerError(f"rank(s) {failed} rejected a change of the ratio (see their error); nothing changed", failed)
        if not (np.all(rows[:, 1] == rows[0, 1]) and np.all(rows[:, 2] == rows[0, 2])):
            changers = [r for r in range(t.size) if rows[r, 1] != self.ratio]
            asked = {r: (float(rows[r, 1]), int(rows[r, 2])) for r in range(t.size)}
            if t.rank in changers or not changers:
                raise ConfigError(f"the ratio must change on every rank alike, at the same step: (ratio, step) per "
                                  f"rank {asked}, current ratio {self.ratio}; nothing changed")
            raise PeerError(f"rank(s) {changers} changed the ratio and this rank did not (see their error); "
                            "nothing changed", changers)
        if new == self.ratio:
            return
        if self.mask_kind == "cyclic":
            self.mask = self.mask.rebased(new, step)
        else:
            self.mask = make_mask(self.mask_kind, self.layout, new, self.seed, self.block)
        self.ratio = new
        self.wire = TopKWire(self.layout, new, self.value_dtype, whole_dense=self.topk_dense)

    # ------------------------------------------------------------------ inputs
    def _take(self, x):
        """Validate ``x`` locally; return ``(xp, views)``, where ``views[i]`` is tensor i as a 1-D
        array on the caller's memory (no copy).

        ``x`` is a fused 1-D buffer, a list or tuple of arrays shaped like the layout, or any
        other sequence, which is read lazily, item by item, and trusted to hold arrays of the
        layout's shapes and dtype (the torch adapters pass their 16-bit parameters that way,
        converted one tensor at a time). Raises LayoutError/NonContiguousError/DTypeError/
        TypeError on bad input; the caller turns that into a collective failure.
        """
        lay = self.layout
        if isinstance(x, (list, tuple)):
            arrs = [_arr.as_array(a) for a in x]
            if len(arrs) != len(lay):
                raise LayoutError(f"got {len(arrs)} arrays, the communicator was built for {len(lay)}")
            xp = _arr.namespace(*arrs) if arrs else np
            for a, name, shape in zip(arrs, lay.names, lay.shapes):
                if tuple(a.shape) != shape:
                    raise LayoutError(f"tensor {name!r} has shape {tuple(a.shape)}, expected {shape}")
                if a.dtype.name not in DATA_DTYPES:
                    raise DTypeError(f"tensor {name!r} has unsupported dtype {a.dtype.name}; expected {lay.dtype.name}")
                if a.dtype != lay.dtype:
                    raise LayoutError(f"tensor {name!r} has dtype {a.dtype.name}, expected {lay.dtype.name}")
                if not a.flags.c_contiguous:
                    raise NonContiguousError(f"tensor {name!r} is not C-contiguous")
            views = [a.reshape(-1) for a in arrs]
        elif hasattr(x, "shape") or hasattr(x, "__dlpack__"):
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
            views = lay.flat_views(flat)
        else:
            if len(x) != len(lay):
                raise LayoutError(f"got {len(x)} arrays, the communicator was built for {len(lay)}")
            views = LazyTensors(x)
            xp = _arr.namespace(views[0]) if len(lay) else np
        if self.residual is not None and _arr.namespace(self.residual) is not xp and not self._residual_on_host:
            raise TypeError(f"the communicator's state lives in {_arr.namespace(self.residual).__name__}, "
                            f"got {xp.__name__}")
        return xp, views

    def _take_or_problem(self, x):
        """``(xp, views, None)``, or ``(xp, None, error)`` for input this rank must reject (it
        still takes part in the collective, with zeros and a status flag)."""
        try:
            return (*self._take(x), None)
        except (SlambCommError, TypeError) as e:
            xp = np if self.residual is None or self._residual_on_host else _arr.namespace(self.residual)
            return xp, None, e

    # ------------------------------------------------------------------ failures
    def _codes(self, code):
        """Every rank's status code (used only on the failure path)."""
        mine = np.array([code], dtype=np.int32)
        everyone = np.zeros(self.size, dtype=np.int32)
        self.transport.allgather(mine, everyone)
        return everyone.tolist()

    def reduce_checked(self, buf, problem, local_bad, what, spans=None, whole=True, sent=None, mine=None, present=0,
                       status_in_buffer=False):
        """Sum ``buf`` over ranks in place, its last slot being the status word: 0, or NaN from a
        rank that rejected its input (``problem``, an exception) or found non-finite values of
        its own (``local_bad``: a bool, a 0-d device array, or a callable returning one, so that
        nothing is read back before sending). Then one host read decides: if any rank flagged, or (``whole``) any
        summed value is not finite, every rank raises and the caller must change nothing.

        ``spans``, ``(starts, counts)`` of each tensor's slice of the payload, names the tensors
        whose sums are not finite; ``sent()``, called on the failure path only, recomputes what
        this rank sent, to tell whether it was this rank's values that were not finite; and
        ``mine()``, also on the failure path only, flags per tensor where this rank's values
        were not finite (the ranks then agree on the union). Every exchange that sums goes
        through here.

        ``status_in_buffer``: the caller (a device kernel) already wrote the status word(s) into
        ``buf``; ``local_bad`` is then read only on the failure path.

        ``present``: what a rank that is fine puts in the status word (default 0). With
        ``whole=False`` the summed status word is returned (its one host read), so a caller
        that puts a nonzero ``present`` learns how many ranks took part: under Horovod's
        ``join()`` the ranks that joined contribute zeros.
        """
        xp = _arr.namespace(buf)
        if problem is not None:
            buf[-1] = np.nan
        elif status_in_buffer:
            pass
        elif isinstance(local_bad, (bool, np.bool_)):
            buf[-1] = np.nan if local_bad else present
        else:
            buf[-1:] = xp.where(local_bad, np.nan, present).astype(buf.dtype)
        self.transport.allreduce(buf)
        if whole:
            word = None
            ok = bool(xp.isfinite(xp.sum(buf, dtype=np.float64)))  # NaN and Inf survive a sum
        else:
            word = float(_arr.to_host(buf[-1:])[0])
            ok = np.isfinite(word)
        if ok:
            return word
        raise self.failure(buf, problem, local_bad, what, spans, sent, mine)

    def failure(self, buf, problem, local_bad, what, spans=None, sent=None, mine=None):
        """The error every rank raises after a summed exchange that failed (:meth:`reduce_checked`'s
        failure path, or a caller that decided on the device and reads the verdict later): who flagged
        (one small allgather, so every rank calls it for the same exchange) and where the sums in ``buf``
        are not finite. Host reads are fine here. ``local_bad``: a bool, a 0-d device array, or a callable
        returning one."""
        xp = _arr.namespace(buf)
        if problem is not None:
            code = STATUS_BAD_INPUT
        elif bool(local_bad() if callable(local_bad) else local_bad) or (
                sent is not None and not bool(xp.isfinite(sent()).all())):
            code = STATUS_NON_FINITE
        else:
            code = STATUS_OK
        codes = self._codes(code)
        tensors = ()
        if mine is not None:
            flags = np.zeros(len(self.layout), np.int32) if problem is not None else np.asarray(mine(), np.int32)
            self.transport.allreduce(flags)
            tensors = tuple(n for n, f in zip(self.layout.names, flags) if f)
        elif spans is not None:
            bad = _arr.to_host(~xp.isfinite(buf[:-1]))
            tensors = tuple(self.layout.names[i] for i, (s, c) in enumerate(zip(*spans))
                            if c and bad[s : s + c].any())
        return collective_error(codes, problem, what, tensors)

    # ------------------------------------------------------------------ operations
    def select(self, step, xp=np, views=None):
        """M_t of ``step`` as a :class:`~slamb_comm.wire.masks.Selection` (for the topk mask a
        collective over ``views``, this rank's data: every rank must call it)."""
        if self.mask_kind == "topk":
            if views is None:  # a rank that rejected its input still takes part, with dummy picks
                local = {i: xp.arange(k_elems(self.ratio, self.layout.sizes[i]), dtype=np.int64)
                         for i in self.layout.compressible}
                return self.mask.union(xp, local, self.transport)
            return self.mask.select(step, xp, views, self.transport)
        return self.mask.select(step, xp)

    def masked_allreduce(self, x, step):
        """In place: ``x[M_t] = mean over ranks of x[M_t]`` for the shared mask of ``step``.

        One allreduce of the |M_t| masked values (plus a status slot) and one host read.

        Args:
            x: the fused buffer (or list of arrays) holding this rank's values.
            step: the 1-based step t that selects M_t (the same on every rank).

        Returns:
            ``x``, and the positions M_t in the fused buffer (an int array, in payload order).
        """
        x, sel = self._masked_allreduce(x, step)
        return x, sel.index

    def masked_traffic(self, payload_bytes, elements_sent, encode_s=0.0, comm_s=0.0, decode_s=0.0):
        """The :class:`~slamb_comm.wire.stats.Traffic` of one masked allreduce of ``payload_bytes`` (its
        status words included) carrying ``elements_sent`` values, against a dense allreduce of the
        layout (docs/algorithm.md section 4): every masked exchange's record, whoever runs it (this
        communicator, SLAMB's steps, an adapter's own collectives)."""
        return Traffic.one_call(
            payload_bytes=payload_bytes, wire_bytes=allreduce_wire(payload_bytes, self.size),
            dense_bytes=self.layout.total * self.layout.dtype.itemsize, size=self.size, elements_sent=elements_sent,
            elements_total=self.layout.total, encode_s=encode_s, comm_s=comm_s, decode_s=decode_s)

    def record_masked_allreduce(self, payload_bytes, elements_sent, encode_s=0.0, comm_s=0.0, decode_s=0.0):
        """Count one masked allreduce in :attr:`stats` (see :meth:`masked_traffic`)."""
        self.stats.record("masked_allreduce", self.masked_traffic(payload_bytes, elements_sent, encode_s, comm_s,
                                                                  decode_s))

    def _masked_allreduce(self, x, step):
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ConfigError(f"step must be an integer >= 1, got {step!r}")
        t0 = time.perf_counter()
        xp, views, problem = self._take_or_problem(x)
        with _arr.device_scope(views[0] if views else np.zeros(0)):
            sel = self.select(step, xp, views)
            m = sel.size
            buf = xp.empty(m + 1, dtype=self.value_dtype)
            if views is None:
                buf[:m] = 0
            else:
                _take(xp, sel, views, buf[:m])
            t1 = time.perf_counter()
            payload = (m + 1) * self.value_dtype.itemsize
            with self.stats.failed("masked_allreduce", lambda: self.masked_traffic(
                    payload, m, t1 - t0, time.perf_counter() - t1)):
                self.reduce_checked(buf, problem, False, f"masked_allreduce at step {step}",
                                    (sel.starts, sel.counts),
                                    sent=lambda: _take(xp, sel, views, xp.empty(m, self.value_dtype)))
            t2 = time.perf_counter()
            # Divide in the wider of the two dtypes: a float16 buffer's sum may exceed 65504, its mean not.
            wide = np.promote_types(self.value_dtype, self.layout.dtype)
            for i, (p, s, c) in enumerate(zip(sel.picks, sel.starts, sel.counts)):
                if c:
                    vals = _arr.cast(buf[s : s + c], wide, copy=False)
                    if self.size > 1:
                        vals *= vals.dtype.type(1.0 / self.size)
                    p.put(views[i], None, vals)
        self.record_masked_allreduce(payload, m, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return x, sel

    def onebit_allreduce(self, x):
        """In place: ``x`` (fused buffer or list of arrays) becomes the error-compensated 1-bit
        mean over ranks of 1-bit Adam/LAMB (docs/onebit_lamb.md section 1): signs packed 8 per
        byte and one scale per rank and per chunk, in an all-to-all and an allgather; the worker
        and server error buffers are this communicator's state. See :class:`OneBitExchange`."""
        return OneBitExchange.of(self).allreduce(x)

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """This rank's state: the error buffers (host copies) and the mask's seed and kind."""
        out = {
            "residual": None if self.residual is None else _arr.to_host(self.residual).copy(),
            "seed": self.seed,
            "mask": self.mask.state_dict(),
            "digest": self._digest().hex(),
        }
        if vars(self).get("_onebit") is not None:
            out["onebit"] = self._onebit.state_dict()
        return out

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly. The error buffer is kept on the host until
        the next exchange, which moves it to the device of that exchange's arrays."""
        saved = state.get("mask") or {}
        ratio = check_ratio(saved.get("ratio", self.ratio))  # a ratio schedule may have changed it
        if state.get("digest") != self._digest(ratio).hex():
            raise LayoutMismatchError("the saved state was made for a different layout or options")
        schedule = [(float(k), int(o)) for k, o in saved.get("schedule") or ()]
        mine = [tuple(x) for x in self.mask.state_dict().get("schedule") or ()]
        if int(state["seed"]) != self.seed or ratio != self.ratio or schedule != mine:
            self.seed, self.ratio = int(state["seed"]), ratio
            self.mask = make_mask(self.mask_kind, self.layout, ratio, self.seed, self.block, schedule)
            self.wire = TopKWire(self.layout, ratio, self.value_dtype, whole_dense=self.topk_dense)
        r = state["residual"]
        if r is not None and np.shape(r) != (self.layout.total,):
            raise LayoutError(f"saved residual has shape {np.shape(r)}, expected ({self.layout.total},)")
        self.residual = None if r is None else np.array(_arr.to_host(r), dtype=self.layout.dtype, copy=True)
        self._residual_on_host = r is not None
        if state.get("onebit") is not None:
            OneBitExchange.of(self).load_state_dict(state["onebit"])
        elif vars(self).get("_onebit") is not None:
            self._onebit = None  # saved before any 1-bit exchange: its error buffers start at zero
