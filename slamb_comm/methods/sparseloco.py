"""SparseLoCo on the core, and two variants whose exchange is an allreduce (docs/algorithm.md section 14).

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
  float32 scale per chunk (:class:`~slamb_comm.wire.chunk_topk.ChunkTopK`). Every rank picks its own positions, so the
  payloads travel in one all-gather of ``ChunkTopK.nbytes`` bytes per rank: the wire per link
  is ``(P - 1) * nbytes`` and grows with the number of ranks.
* :class:`SharedMaskSparseLoCo`: TopK is replaced by the shared cyclic mask M_j of outer step
  j (:class:`~slamb_comm.wire.masks.CyclicMask`, docs/algorithm.md section 1 step 2), the same
  positions on every rank, so the exchange is ONE allreduce of the ``|M_j|`` values (in
  ``value_dtype``, float16 by default) whatever P: wire ``2 (P - 1)/P * (|M_j| + 1) * itemsize``.
  No b-bit code is sent there: a sum of P codes needs ``b + log2 P`` bits and the ranks' scales
  differ, so b-bit values cannot stay b bits through a ring's partial sums. Each rank rounds its
  values to float16 (the error buffer keeps the rounding) and the float16 sums are checked.
* :class:`SharedTopKSparseLoCo`: the positions are ONE rank's chunk-wise top-k, the leader's,
  which takes turns ((j - 1) mod P); it broadcasts its offsets (no values) and every rank sends
  its e there in one allreduce, as above. The wire per link is the offsets once plus the
  allreduce: flat in P, as for the shared mask, with positions chosen by magnitude.

**An index costs ceil(log2 chunk) bits on the wire, 12 at the default chunk of 4096.** Every
chunk sends exactly ``topk`` entries (the shorter last chunk ``ceil(topk L / chunk)`` of its L),
so an entry's chunk is implied by its place in the payload and only its offset within the chunk
travels, packed with its b-bit value code into one field of ``ceil(log2 chunk) + bits`` bits.
The width is fixed so that every rank's payload has the same, known size (an all-gather needs
it) and decoding is shifts and masks; an entropy code of the sorted offsets would need about
log2 C(4096, 64) / 64 = 7.4 bits per index and is not done. At the defaults (chunk 4096,
topk 64, 2 bits) a chunk costs 64 x 14 bits + a 4-byte scale = 116 bytes for 16,384 bytes of
float32: 0.71% of a dense step's payload per outer step, 0.014% per inner step at H = 50.

The three classes share :mod:`slamb_comm.methods.periodic`'s construction (collective agreement on arrays and
options, x broadcast from rank 0), state (``anchor``, equal on every rank; ``error``, per rank)
and checks: a rank with bad input or a non-finite accumulator flags its status word, and every
rank raises (PeerError, the rank's own error, or NonFiniteError) with nothing changed.
"""

import time

import numpy as np

from .. import arrays as _arr
from ..wire.chunk_topk import ChunkTopK, int_in, pack_bits, pad8, unpack_bits
from ..wire.codecs import check_ratio
from ..wire.layout import Layout
from ..exchange.communicator import Communicator
from ..errors import (
    collective_error,
    STATUS_BAD_INPUT,
    STATUS_NON_FINITE,
    STATUS_OK,
    ConfigError,
    DTypeError,
    SlambCommError,
)
from .periodic import DEFAULT_INTERVAL, check_number, host_copy, Periodic, check_interval
from ..wire.stats import Traffic, allgather_wire, allreduce_wire, broadcast_wire

__all__ = ["SparseLoCo", "SharedMaskSparseLoCo", "SharedTopKSparseLoCo"]

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

    def init(self, transport, x, names, check, options, value_dtype, bucket_bytes, outer):
        """Set up for the variant that calls it: its ``outer`` options ``(sync_interval, outer_lr, beta)``
        checked, then :meth:`~slamb_comm.methods.periodic.Periodic.setup`, the anchor and the error."""
        H, lr, beta = outer

        def checks():
            _dtype_of(x)
            self.sync_interval = check_interval("sync_interval", H, f"the paper uses 15 to 250; "
                                                f"this library's default is {DEFAULT_INTERVAL}")
            self.outer_lr = check_number("outer_lr", lr, lambda v: v > 0, "a finite number > 0",
                                          "1 applies the mean of the sparse updates as it is")
            self.beta = check_number("beta", beta, lambda v: 0 <= v <= 1, "a number in [0, 1]",
                                      "the error feedback's decay; 0.95 is the default")
            check()

        def all_options():
            return dict(options(), sync_interval=self.sync_interval, outer_lr=self.outer_lr, beta=self.beta)

        xp, views, flat = self.setup(transport, x, names, all_options, checks, value_dtype, bucket_bytes)
        with _arr.device_scope(views[0]):
            self.anchor = flat.copy() if flat is not None else xp.concatenate(views)
            self.error = xp.zeros_like(self.anchor)

    def due(self):
        """Whether the next :meth:`step` is an outer step (it then needs x)."""
        return (self.t + 1) % self.sync_interval == 0

    def local(self, x):
        """``(xp, views, flat, None)`` of this rank's x, or ``(xp, None, None, error)`` for input this
        rank must reject (it still takes part in the exchange, flagged)."""
        try:
            if x is None:
                raise ConfigError(f"{self.kind} step {self.t} is an outer step: pass x to step()")
            return (*self.views(x), None)
        except (SlambCommError, TypeError) as e:
            return _arr.namespace(self.anchor), None, None, e

    def fold(self, xp, views, flat):
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

    def decrement(self, summed):
        """The anchor's decrement from an allreduced sum of the sent values (in the payload's
        dtype): widened to the arrays' dtype before dividing by P (it may exceed float16), times
        outer_lr."""
        mean = _arr.cast(summed, self.dtype)
        if self.transport.size > 1:
            mean *= self.dtype.type(1.0 / self.transport.size)
        mean *= self.dtype.type(self.outer_lr)
        return mean

    def apply_anchor(self, views, flat):
        """x = anchor on this rank (in place)."""
        if flat is not None:
            flat[...] = self.anchor
        else:
            for v, o, n in zip(views, self.layout.offsets, self.layout.sizes):
                v[...] = self.anchor[o : o + n]

    def state_dict(self):
        """The step count, the anchor (equal on every rank) and this rank's error accumulator
        (host copies); loading it back on the same rank continues bitwise."""
        return dict(self.base_state(), anchor=host_copy(self.anchor), error=host_copy(self.error))

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly (onto the device of the current anchor)."""
        self.load_arrays(state, ("anchor", "error"))


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
        names, bucket_bytes: as :class:`~slamb_comm.methods.periodic.DiLoCo`.

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
        def check():
            n = sum(int(np.prod(np.shape(a))) for a in x) if isinstance(x, (list, tuple)) else int(np.size(x))
            self.codec = ChunkTopK(n, chunk, topk, bits)

        def options():
            c = self.codec
            return {"chunk": c.s, "topk": c.k, "bits": c.bits}

        self.init(transport, x, names, check, options, None, bucket_bytes, (sync_interval, outer_lr, beta))

    def step(self, x=None):
        """Count one inner step; at an outer step (see :meth:`due`) run it on ``x`` in place and
        return True. Collective at outer steps. Raises on every rank with nothing changed but the
        count: NonFiniteError (a non-finite accumulator or scale), PeerError / LayoutError."""
        self.t += 1
        if self.t % self.sync_interval:
            return False
        t0 = time.perf_counter()
        xp, views, flat, problem = self.local(x)
        codec, lay, P = self.codec, self.layout, self.transport.size
        with _arr.device_scope(self.anchor):
            send = xp.zeros(codec.nbytes, np.uint8)
            status = codec.parts(send)[0]
            status[...] = STATUS_BAD_INPUT
            if problem is None:
                e, ok = self.fold(xp, views, flat)
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
            self.apply_anchor(views, flat)
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
        def check():
            self.ratio = check_ratio(ratio)
            self.seed = int_in("seed", seed, 0, (1 << 62) - 1)
            self.dense_threshold = int_in("dense_threshold", dense_threshold, 0, 1 << 62)
            if value_dtype is not None:
                _arr.value_dtype(value_dtype)  # DTypeError naming the choices

        def options():
            return {"ratio": self.ratio, "seed": self.seed, "dense_threshold": self.dense_threshold}

        self.init(transport, x, names, check, options, value_dtype, bucket_bytes, (sync_interval, outer_lr, beta))
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
        xp, views, flat, problem = self.local(x)
        lay, P, vd = self.layout, self.transport.size, self.value_dtype
        with _arr.device_scope(self.anchor):
            sel = self.comm.select(j, xp)
            m = sel.size
            buf = xp.zeros(m + 1, vd)
            bad, sent = False, None
            if problem is None:
                e, ok = self.fold(xp, views, flat)
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
            mean = self.decrement(buf[:m])
            vals -= _arr.cast(sent, self.dtype)
            sel.put(e, vals)
            a = sel.take(self.anchor)
            a -= mean
            sel.put(self.anchor, a)
            self.error = e
            self.apply_anchor(views, flat)
        self.stats.record("sparseloco_allreduce", traffic(t1 - t0, t2 - t1, time.perf_counter() - t2))
        return True


class SharedTopKSparseLoCo(_SparseOuter):
    """SparseLoCo whose top-k positions are shared: at outer step j every rank sends its e on the
    positions of ONE rank's chunk-wise top-k, that of the leader ``(j - 1) mod P``, which takes
    turns (docs/algorithm.md section 14.7). Two collectives per outer step, neither growing with P:

        pos_j    = TopK(e_leader)                     # broadcast from the leader: offsets only
        s_r      = round_to(value_dtype, e_r[pos_j])  # sent by every rank
        e_r[pos_j]    = e_r[pos_j] - s_r
        anchor[pos_j] = anchor[pos_j] - outer_lr * (1/P) sum_r s_r   # ONE allreduce
        x_r      = anchor

    The leader's offsets travel as ``ceil(log2 chunk)``-bit fields (12 bits at 4096), chunk by
    chunk as in :class:`ChunkTopK` (an entry's chunk is implied by its place), behind an 8-byte
    header holding the leader's status word; the values go in ``value_dtype`` (float16 by default)
    through :meth:`~slamb_comm.exchange.communicator.Communicator.reduce_checked`, as in
    :class:`SharedMaskSparseLoCo`. Against SparseLoCo's all-gather (``(P - 1)`` payloads on each
    link), the wire per link is ``index_bytes`` (a pipelined broadcast) plus
    ``2 (P - 1)/P * value_bytes`` at any P.

    Args: as :class:`SparseLoCo` (``chunk``, ``topk``; no ``bits``) plus ``value_dtype``
    ('float16', 'float32', or None for the arrays' dtype) of :class:`SharedMaskSparseLoCo`.

    Costs of an outer step: the new accumulator, the leader's argpartition and packing, one
    broadcast of :attr:`index_bytes`, one allreduce of ``K + 1`` values, two host reads (the
    leader's status word, then the allreduce's). Memory kept: ``anchor`` and ``error``.
    """

    kind = "SharedTopKSparseLoCo"

    def __init__(self, transport, x, *, sync_interval=DEFAULT_INTERVAL, outer_lr=1.0, beta=0.95, chunk=4096,
                 topk=64, value_dtype="float16", names=None, bucket_bytes=32 << 20):
        def check():
            n = sum(int(np.prod(np.shape(a))) for a in x) if isinstance(x, (list, tuple)) else int(np.size(x))
            self.codec = ChunkTopK(n, chunk, topk, 32)  # the geometry and the selection; values go apart
            if value_dtype is not None:
                _arr.value_dtype(value_dtype)  # DTypeError naming the choices

        def options():
            return {"chunk": self.codec.s, "topk": self.codec.k}

        self.init(transport, x, names, check, options, value_dtype, bucket_bytes, (sync_interval, outer_lr, beta))
        self.index_bytes = 8 + pad8(-(-self.codec.K * self.codec.index_bits // 8))

    def leader(self, j):
        """The rank whose top-k positions outer step ``j`` (1-based) uses."""
        return (j - 1) % self.transport.size

    def _positions(self, xp, e, ok, problem, root):
        """Broadcast the leader's chunk-wise top-k offsets; every rank returns the positions in the
        fused buffer (int64 [K]). ``ok``: whether the leader's e is finite (from the fold). Raises on
        every rank, nothing changed, if the leader flagged."""
        codec = self.codec
        buf = xp.zeros(self.index_bytes, np.uint8)
        status = buf[:4].view(np.int32)
        if self.transport.rank == root:
            status[...] = STATUS_BAD_INPUT
            if problem is None:
                offs, _ = codec.select(e)
                pack_bits(offs.astype(np.uint64), codec.index_bits, buf[8:])
                status[...] = xp.where(ok, STATUS_OK, STATUS_NON_FINITE)
        self.transport.broadcast(buf, root=root)
        code = int(_arr.to_host(buf[:4].copy().view(np.int32))[0])  # the first host read
        if code:
            codes = [code if r == root else STATUS_OK for r in range(self.transport.size)]
            raise collective_error(codes, problem if self.transport.rank == root else None,
                                   f"SharedTopKSparseLoCo outer step at t = {self.t} (leader rank {root})",
                                   nonfinite="non-finite pseudo-gradient or accumulator (NaN/Inf)")
        return codec.positions(unpack_bits(buf[8:], codec.index_bits, codec.K).astype(np.int64))

    def step(self, x=None):
        """As :meth:`SparseLoCo.step`, through one broadcast of the leader's offsets and one allreduce."""
        self.t += 1
        if self.t % self.sync_interval:
            return False
        t0 = time.perf_counter()
        j = self.t // self.sync_interval
        xp, views, flat, problem = self.local(x)
        lay, P, vd, K = self.layout, self.transport.size, self.value_dtype, self.codec.K
        payload, dense = self.index_bytes + (K + 1) * vd.itemsize, lay.total * self.dtype.itemsize
        traffic = (lambda enc, comm, dec: Traffic.one_call(
            payload_bytes=payload, dense_bytes=dense, size=P, elements_sent=K, elements_total=lay.total,
            wire_bytes=broadcast_wire(self.index_bytes, P) + allreduce_wire((K + 1) * vd.itemsize, P),
            encode_s=enc, comm_s=comm, decode_s=dec))
        with _arr.device_scope(self.anchor):
            e, ok = self.fold(xp, views, flat) if problem is None else (self.error, False)
            with self.stats.failed("sparseloco_shared_topk", lambda: traffic(0.0, time.perf_counter() - t0, 0.0)):
                pos = self._positions(xp, e, ok, problem, self.leader(j))
                t1 = time.perf_counter()
                buf = xp.zeros(K + 1, vd)
                vals = e[pos]
                sent = _arr.cast(vals, vd)
                buf[:K] = sent
                self.comm.reduce_checked(buf, problem, False if problem is not None else
                                         (~ok if xp is not np else not bool(ok)),
                                         f"SharedTopKSparseLoCo outer step {j} (t = {self.t})", sent=lambda: sent)
            t2 = time.perf_counter()
            e[pos] = vals - _arr.cast(sent, self.dtype)
            self.anchor[pos] -= self.decrement(buf[:K])
            self.error = e
            self.apply_anchor(views, flat)
        self.stats.record("sparseloco_shared_topk", traffic(t1 - t0, t2 - t1, time.perf_counter() - t2))
        return True
