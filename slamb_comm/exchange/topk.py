"""The top-k exchange with error feedback: the :class:`TopKExchange` part of the Communicator.

:meth:`TopKExchange.sparse_allgather` (docs/algorithm.md section 2) and its error buffer: the
compensated gradient ``c = x + e``, each tensor's largest ``|c|`` on the wire
(:class:`~slamb_comm.wire.codecs.TopKWire`), the mean of every rank's decoded payload, and the
residual ``e = c - sent`` committed at once or later (:meth:`TopKExchange.commit_residual`).
On a device every step is a kernel of :mod:`slamb_comm.device.topk_kernels`; on the CPU, tensor by
tensor. A part that the :class:`~slamb_comm.exchange.communicator.Communicator` owns, with its own state
(the error buffer); it uses the communicator's public layout, transport, wire, status words and
statistics.
"""

import time
from typing import NamedTuple

import numpy as np

from .. import arrays as _arr
from ..errors import collective_error, LayoutError, STATUS_BAD_INPUT, STATUS_NON_FINITE, STATUS_OK
from ..wire.codecs import topk_indices
from ..wire.layout import fused_input
from ..wire.stats import Traffic, allgather_wire

__all__ = ["TopKExchange"]



class _Pending(NamedTuple):
    """An exchange whose error feedback is not committed yet."""

    xp: object
    views: object  # this rank's tensors (1-D), as the exchange took them
    send: object  # this rank's payload
    c: object  # on a device: the error buffer to commit, ``c - sent`` (None on the CPU)


class TopKExchange:
    """The top-k exchange of the communicator ``comm`` and its error buffer (see the module docstring)."""

    def __init__(self, comm):
        self.comm = comm
        self.layout, self.transport, self.stats, self.size = comm.layout, comm.transport, comm.stats, comm.size
        self.residual = None  # the error buffer, allocated at the first exchange
        self._residual_on_host = False  # restored by load_state_dict, not yet moved to a device
        self._uncommitted = None  # a sparse_allgather(commit=False) waiting for commit_residual()

    @property
    def wire(self):
        """The communicator's top-k wire (it follows a change of the ratio)."""
        return self.comm.wire

    @property
    def uncommitted(self):
        """Whether a ``sparse_allgather(commit=False)`` waits for :meth:`commit_residual`."""
        return self._uncommitted is not None

    def state(self):
        """The library the input must match (the error buffer's, once on a device), for ``comm.take``."""
        return None if self.residual is None or self._residual_on_host else self.residual

    def state_dict(self):
        return None if self.residual is None else _arr.to_host(self.residual).copy()

    def load_state_dict(self, r):
        """The saved error buffer ``r`` (or None), kept on the host until the next exchange moves it."""
        lay = self.layout
        if r is not None and np.shape(r) != (lay.total,):
            raise LayoutError(f"saved residual has shape {np.shape(r)}, expected ({lay.total},)")
        self.residual = None if r is None else np.array(_arr.to_host(r), dtype=lay.dtype, copy=True)
        self._residual_on_host = r is not None

    def sparse_allgather(self, x, commit=True):
        """Top-k exchange with error feedback (docs/algorithm.md section 2).

        ``c = x + e``; send each tensor's ``k_elems`` largest ``|c|``; ``e = c - sent``;
        return the mean over ranks of every rank's decoded payload, identical on every
        rank. ``x`` itself is not modified. On a GPU, the kernels of
        :mod:`slamb_comm.device.topk_kernels`, every tensor at once (a list ``x`` is read where it is):
        the compensation, the exact radix select and the payload (float32: 4 kernels), the
        allgather, one host read (every rank's status word), one kernel writing the mean: 8
        device operations and about 30 bytes per element (17 where every tensor fits in 32 KB),
        whatever the number of tensors; no copy to the device after the first call (but of a
        list's addresses when they are new); scratch: ``c``, which becomes the error buffer. On
        the CPU, where there are no launches to save, every step goes tensor by tensor (scratch:
        one tensor), with a linear-time top-k (:func:`~slamb_comm.wire.codecs.topk_indices`).

        ``commit=False`` leaves the error buffer as it was until :meth:`commit_residual`
        (with ``x`` unchanged until then), so that a caller exchanging several buckets can
        keep them all or none without copying any error buffer.

        Returns:
            a fused buffer (if ``x`` was one) or a list of arrays shaped like the layout.
        """
        self._uncommitted = None
        t0 = time.perf_counter()
        xp, views, problem = self.comm.take(x, self.state())
        lay, w = self.layout, self.wire
        with _arr.device_scope(views[0] if views else np.zeros(0)):
            send = w.empty(xp)
            c = self._encode(xp, x, views, problem, send)
            t1 = time.perf_counter()
            recv = xp.empty(w.nbytes * self.size, np.uint8)  # the allgather writes all of it
            self.transport.allgather(send, recv)
            t2 = time.perf_counter()
            recv = recv.reshape(self.size, w.nbytes)
            codes = _arr.to_host(recv[:, :4].copy().view(np.int32)).ravel().tolist()  # the one host read
            if any(codes):
                with self.stats.failed("sparse_allgather", lambda: self._topk_traffic(t1 - t0, t2 - t1, 0.0)):
                    raise collective_error(codes, problem, "sparse_allgather")
            out = self._decode_host(recv) if xp is np else w.device(xp).decode(recv, self.size)
            self._uncommitted = _Pending(xp, views, send, c)
            if commit:
                self._commit()
        self.stats.record("sparse_allgather", self._topk_traffic(t1 - t0, t2 - t1, time.perf_counter() - t2))
        if isinstance(x, (list, tuple)):
            return lay.views(out)
        return out

    def _encode(self, xp, x, views, problem, send):
        """This rank's payload into ``send``: its status word, and each tensor's top-k of ``c = x +
        e``. Returns the device path's ``c - sent`` (the next error buffer), None on the CPU."""
        lay, w = self.layout, self.wire
        status, idx, val = w.parts(send)
        if problem is not None:
            status[...] = STATUS_BAD_INPUT
            return None
        if xp is np:  # tensor by tensor, in cache-sized temporaries
            ok = self._encode_host(views, self._residual(xp), idx, val)
            if ok and w.k_total and val.dtype.itemsize < lay.dtype.itemsize:  # e.g. beyond +-65504 in float16
                ok = bool(np.isfinite(val).all())
            status[...] = STATUS_OK if ok else STATUS_NON_FINITE
            return None
        flat = fused_input(lay, x, views)  # the kernels, every tensor at once; they write the status word
        arrays = [views[i] for i in range(len(lay))] if flat is None else flat
        return w.device(xp).encode(arrays, self._residual(xp), idx, val, status, True)

    def _topk_traffic(self, encode_s, comm_s, decode_s):
        """One top-k exchange's :class:`~slamb_comm.wire.stats.Traffic` (an allgather of the wire)."""
        lay, w = self.layout, self.wire
        return Traffic.one_call(payload_bytes=w.nbytes, wire_bytes=allgather_wire(w.nbytes, self.size),
                                dense_bytes=lay.total * lay.dtype.itemsize, size=self.size, elements_sent=w.k_total,
                                elements_total=lay.total, encode_s=encode_s, comm_s=comm_s, decode_s=decode_s)

    def commit_residual(self, skip=()):
        """Apply the last :meth:`sparse_allgather`'s error feedback, ``e = x + e - sent`` (on the
        CPU ``x + e`` recomputed, on a device the exchange's own ``c - sent``: the same bits, as
        ``x`` is unchanged). Tensors in ``skip`` keep their error buffer as it was (a tensor that
        had no gradient on any rank)."""
        if self._uncommitted is None:
            raise RuntimeError("no sparse_allgather to commit")
        self._commit(skip)

    def _commit(self, skip=()):
        """The error feedback of the pending exchange, ``e = x + e - sent``.

        On a device the exchange's kernels already made ``c - sent`` (the same bits as ``e + x -
        sent``; ``0 + x - sent`` at the first exchange): it becomes the error buffer, no
        operation, but one copy per tensor in ``skip`` (its old error buffer, or zeros). On the
        CPU, tensor by tensor, in place (no temporary of the buffer's size)."""
        xp, views, send, c = self._uncommitted
        self._uncommitted = None
        lay, w = self.layout, self.wire
        if xp is not np:
            with _arr.device_scope(send):
                for i in skip:
                    o, n = lay.offsets[i], lay.sizes[i]
                    if n:
                        c[o : o + n] = 0 if self.residual is None else self.residual[o : o + n]
                self.residual = c
            return
        _, idx, val = w.parts(send)
        if self.residual is None:
            self.residual = np.zeros(lay.total, lay.dtype)
        for i, e in enumerate(lay.flat_views(self.residual)):
            if i in skip:
                continue
            a, k = w.starts[i], w.counts[i]
            e += views[i]
            if k:
                e[idx[a : a + k]] -= val[a : a + k].astype(e.dtype, copy=False)  # what was not sent stays

    def _decode_host(self, recv):
        """On the CPU: the mean of every rank's payload, summed in float32 or wider (the sum over
        ranks may exceed float16's 65504, the mean does not), times 1/P, cast back."""
        lay, w = self.layout, self.wire
        out = np.zeros(lay.total, dtype=np.promote_types(lay.dtype, np.float32))
        w.decode_all(recv, out)
        if self.size > 1:
            out *= out.dtype.type(1.0 / self.size)
        return out.astype(lay.dtype, copy=False)

    def _residual(self, xp):
        """The error buffer on ``xp`` (moved there after a load), or None before the first exchange."""
        if self.residual is not None and self._residual_on_host:
            self.residual = self.residual if xp is np else xp.asarray(self.residual)
        self._residual_on_host = False
        return self.residual

    def _encode_host(self, views, e, idx, val):
        """On the CPU, per tensor: ``c = x + e`` (a tensor-sized temporary), its finiteness, its
        top-k (:func:`~slamb_comm.wire.codecs.topk_indices`, linear time) into the payload. Returns
        whether every tensor was finite; stops at the first that is not (the exchange then
        fails on every rank and its payload is not read)."""
        lay, w = self.layout, self.wire
        for i, (o, n, a, k) in enumerate(zip(lay.offsets, lay.sizes, w.starts, w.counts)):
            if not k:
                continue
            v = views[i]
            c = v if e is None else v + e[o : o + n]
            if not np.isfinite(c).all():  # the fast top-k needs finite input
                return False
            loc = topk_indices(c, k)
            idx[a : a + k] = loc
            val[a : a + k] = c[loc]
        return True
