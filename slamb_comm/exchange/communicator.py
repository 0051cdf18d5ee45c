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

import numpy as np

from .. import arrays as _arr
from ..wire.codecs import TopKWire, check_ratio
from ..wire.layout import Layout
from ..wire.masks import check_block, make_mask
from .onebit import OneBitExchange
from ..errors import (
    ConfigError,
    LayoutMismatchError,
    STATUS_BAD_INPUT,
    STATUS_OK,
    PeerError,
    SlambCommError,
)
from ..device import tables as _dev
from ..wire.layout import take
from ..wire.stats import Stats
from .masked import MaskedAllreduce
from .status import TEXT_WORDS, StatusWords, problem_words, rejected_at_construction
from .sync import DenseSync
from .topk import TopKExchange
from .transports import LocalTransport

__all__ = ["Communicator"]



class Communicator:
    """Sparse and dense exchanges of one fixed set of arrays among all ranks of a transport.

    Args:
        transport: an :class:`~slamb_comm.exchange.transports.MPITransport`,
            :class:`~slamb_comm.exchange.transports.NCCLTransport`, a Horovod transport, or
            ``None`` for a single process (:class:`~slamb_comm.exchange.transports.LocalTransport`).
        arrays: the arrays to exchange (only shapes and the dtype are used here), or a
            :class:`~slamb_comm.wire.layout.Layout`.
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
        problem: an error the caller found in its own arguments before building (an adapter's
            invalid option on this rank): this rank still takes part in the construction agreement,
            then raises it; the other ranks raise PeerError naming this rank and the error's text.

    Raises (on every rank, never on one only):
        ConfigError: ratio, mask or threshold out of range or unknown.
        DTypeError: unsupported array or payload dtype.
        LayoutMismatchError: ranks disagree on shapes, dtype, order or options.
        PeerError: another rank raised one of the above.
    """

    def __init__(self, transport, arrays, *, names=None, ratio=0.1, mask="cyclic", value_dtype=None, seed=None,
                 dense_threshold=None, block=1, bucket_bytes=32 << 20, topk_dense=False, problem=None):
        self.transport = transport if transport is not None else LocalTransport()
        self.stats = Stats()
        self._device = {}  # the layout's tiles and tables of addresses on a device (device_tables)
        self.bucket_bytes = int(bucket_bytes)
        digest = bytes(16)
        if problem is not None:  # the caller's own error: take part in the agreement, then raise it
            self._agree(problem, digest)
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
        # the exchanges, each a part with its own state, on this communicator's public names
        self._status = StatusWords(self.layout, self.transport)
        self._masked, self._dense, self._topk = MaskedAllreduce(self), DenseSync(self), TopKExchange(self)
        self._onebit = None  # made at first use (it needs a transport with alltoall)

    def device_tables(self, xp):
        """The layout's tiles and tables of addresses on the current device (built once)."""
        key = (xp.__name__, xp.cuda.Device().id)
        if self._device.get("key") != key:
            self._device = {"key": key, "tiles": _dev.Tiles(self.layout, xp), "tables": _dev.AddressTables(self.layout)}
        return self._device["tiles"], self._device["tables"]

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
        n = 4 + TEXT_WORDS  # status, digest, total, then the text of this rank's error (if any)
        mine = np.zeros(n, dtype=np.int64)
        mine[0] = STATUS_OK if problem is None else STATUS_BAD_INPUT
        mine[1:3] = np.frombuffer(digest, dtype=np.int64)
        if problem is None:
            mine[3] = self.layout.total
        mine[4:] = problem_words(problem)
        everyone = np.zeros(n * t.size, dtype=np.int64)
        t.allgather(mine, everyone)
        everyone = everyone.reshape(t.size, n)
        failed = [r for r in range(t.size) if everyone[r, 0] != STATUS_OK]
        if problem is not None:
            raise problem
        if failed:
            raise rejected_at_construction(failed, everyone[:, 4:])
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
                if self._topk.uncommitted:
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
    def take(self, x, state=None):
        """``(xp, views, None)``: ``x`` checked against the layout and viewed as its tensors
        (:func:`slamb_comm.wire.layout.take`); or ``(xp, None, error)`` for input this rank must reject
        (it still takes part in the collective, with zeros and a status flag). ``state``: an array of
        the exchange's state, whose library the input must match (None: any)."""
        try:
            xp, views = take(self.layout, x)
            if state is not None and _arr.namespace(state) is not xp:
                raise TypeError(f"the communicator's state lives in {_arr.namespace(state).__name__}, got {xp.__name__}")
            return xp, views, None
        except (SlambCommError, TypeError) as e:
            return (np if state is None else _arr.namespace(state)), None, e

    # ------------------------------------------------------------------ status words (:class:`StatusWords`)
    def reduce_checked(self, buf, problem, local_bad, what, spans=None, whole=True, sent=None, mine=None, present=0,
                       status_in_buffer=False):
        """Sum ``buf`` over ranks in place, its last slot the status word, and decide with one host read
        (:meth:`StatusWords.reduce_checked <slamb_comm.exchange.status.StatusWords.reduce_checked>`:
        every exchange that sums goes through here)."""
        return self._status.reduce_checked(buf, problem, local_bad, what, spans, whole, sent, mine, present,
                                           status_in_buffer)

    def failure(self, buf, problem, local_bad, what, spans=None, sent=None, mine=None):
        """The error every rank raises after a summed exchange that failed (:meth:`StatusWords.failure
        <slamb_comm.exchange.status.StatusWords.failure>`; collective)."""
        return self._status.failure(buf, problem, local_bad, what, spans, sent, mine)

    # ------------------------------------------------------------------ operations
    def select(self, step, xp=np, views=None):
        """M_t of ``step`` as a :class:`~slamb_comm.wire.masks.Selection` (for the topk mask a
        collective over ``views``, this rank's data: every rank must call it)."""
        return self._masked.select(step, xp, views)

    def masked_allreduce(self, x, step):
        """In place: ``x[M_t] = mean over ranks of x[M_t]`` for the shared mask of ``step``
        (:class:`~slamb_comm.exchange.masked.MaskedAllreduce`). Returns ``x`` and the positions M_t in the
        fused buffer (an int array, in payload order)."""
        return self._masked.masked_allreduce(x, step)

    def masked_traffic(self, payload_bytes, elements_sent, encode_s=0.0, comm_s=0.0, decode_s=0.0):
        """The :class:`~slamb_comm.wire.stats.Traffic` of one masked allreduce (see
        :meth:`MaskedAllreduce.traffic <slamb_comm.exchange.masked.MaskedAllreduce.traffic>`)."""
        return self._masked.traffic(payload_bytes, elements_sent, encode_s, comm_s, decode_s)

    def record_masked_allreduce(self, payload_bytes, elements_sent, encode_s=0.0, comm_s=0.0, decode_s=0.0):
        """Count one masked allreduce in :attr:`stats` (see :meth:`masked_traffic`)."""
        self._masked.record(payload_bytes, elements_sent, encode_s, comm_s, decode_s)

    def sync(self, x, written=None, bad=None):
        """In place: ``x = mean over ranks of x`` (:meth:`DenseSync.sync
        <slamb_comm.exchange.sync.DenseSync.sync>`: the periodic parameter sync, the dense baseline)."""
        return self._dense.sync(x, written, bad)

    def sparse_allgather(self, x, commit=True):
        """Top-k exchange with error feedback (:meth:`TopKExchange.sparse_allgather
        <slamb_comm.exchange.topk.TopKExchange.sparse_allgather>`, docs/algorithm.md section 2)."""
        return self._topk.sparse_allgather(x, commit)

    def commit_residual(self, skip=()):
        """Apply the last ``sparse_allgather(commit=False)``'s error feedback (:meth:`TopKExchange.commit_residual
        <slamb_comm.exchange.topk.TopKExchange.commit_residual>`)."""
        self._topk.commit_residual(skip)

    @property
    def residual(self):
        """The top-k exchange's error buffer (None before the first exchange)."""
        return self._topk.residual

    @property
    def onebit(self):
        """The 1-bit exchange of this communicator, with its error buffers (made at first use, then kept:
        every user of the communicator's 1-bit exchange shares them)."""
        if self._onebit is None:
            self._onebit = OneBitExchange(self)
        return self._onebit

    def onebit_allreduce(self, x):
        """In place: ``x`` (fused buffer or list of arrays) becomes the error-compensated 1-bit
        mean over ranks of 1-bit Adam/LAMB (docs/onebit_lamb.md section 1): signs packed 8 per
        byte and one scale per rank and per chunk, in an all-to-all and an allgather; the worker
        and server error buffers are this communicator's state. See :class:`OneBitExchange`."""
        return self.onebit.allreduce(x)

    # ------------------------------------------------------------------ state
    def state_dict(self):
        """This rank's state: the error buffers (host copies) and the mask's seed and kind."""
        out = {
            "residual": self._topk.state_dict(),
            "seed": self.seed,
            "mask": self.mask.state_dict(),
            "digest": self._digest().hex(),
        }
        if self._onebit is not None:
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
        self._topk.load_state_dict(state["residual"])
        if state.get("onebit") is not None:
            self.onebit.load_state_dict(state["onebit"])
        elif self._onebit is not None:
            self._onebit = None  # saved before any 1-bit exchange: its error buffers start at zero
