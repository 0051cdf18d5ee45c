"""The top-k exchange with error feedback: the :class:`TopKExchange` part of the Communicator.

:meth:`TopKExchange.sparse_allgather` (docs/algorithm.md section 2) and its error buffer: the
compensated gradient ``c = x + e``, each tensor's largest ``|c|`` on the wire
(:class:`~slamb_comm.codecs.TopKWire`), the mean of every rank's decoded payload, and the
residual ``e = c - sent`` committed at once or later (:meth:`TopKExchange.commit_residual`).
A mixin of :class:`~slamb_comm.communicator.Communicator`, whose layout, transport, status words
and statistics it uses; kept apart so that each module holds one exchange.
"""

import time

import numpy as np

from . import arrays as _arr
from .codecs import LazyTensors, topk_indices
from .stats import Traffic, allgather_wire, allreduce_wire

__all__ = ["TopKExchange"]

_OK, _BAD_INPUT, _NON_FINITE = 0, 1, 2  # the status word of every payload (the Communicator's too)


class TopKExchange:
    """The Communicator's top-k exchange (a mixin: see the module docstring)."""

    def sparse_allgather(self, x, commit=True):
        """Top-k exchange with error feedback (docs/algorithm.md section 2).

        ``c = x + e``; send each tensor's ``k_elems`` largest ``|c|``; ``e = c - sent``;
        return the mean over ranks of every rank's decoded payload, identical on every
        rank. ``x`` itself is not modified. On a GPU every step works on the whole fused buffer
        at once (compensation, finiteness, the selection of :meth:`TopKWire.select`, the decode
        of every rank's payload, the error feedback): a constant number of device operations
        whatever the number of tensors (a list ``x`` is first fused with one ``concatenate``),
        scratch of one compensated copy of the buffer and the selection's two sorts, one host
        read (every rank's status word) and no copy to the device. On the CPU, where there are
        no launches to save, every step goes tensor by tensor (scratch: one tensor), with a
        linear-time top-k (:func:`~slamb_comm.codecs.topk_indices`).

        ``commit=False`` leaves the error buffer as it was until :meth:`commit_residual`
        (with ``x`` unchanged until then), so that a caller exchanging several buckets can
        keep them all or none without copying any error buffer.

        Returns:
            a fused buffer (if ``x`` was one) or a list of arrays shaped like the layout.
        """
        self._uncommitted = None
        t0 = time.perf_counter()
        xp, views, problem = self._take_or_problem(x)
        lay, w = self.layout, self.wire
        with _arr.device_scope(views[0] if views else np.zeros(0)):
            send = w.empty(xp)
            status, idx, val = w.parts(send)
            ok = True
            c = pos = entries = None
            flat = self._fused_input(x, views)
            if views is not None:
                res = self._residual(xp)  # None until the first exchange that succeeds: zeros
                if xp is np:  # tensor by tensor, in cache-sized temporaries
                    ok = self._encode_host(views, res, idx, val)
                else:  # whole-buffer operations
                    c = self._compensated(xp, flat, views, res)
                    ok = xp.isfinite(c).all()
                    if w.k_total:
                        entries = w.entries(xp)
                        pos, local = w.select(c, entries)
                        w.write(c, pos, local, idx, val)
                if w.k_total and val.dtype.itemsize < lay.dtype.itemsize:  # e.g. beyond +-65504 in float16
                    ok = (ok and bool(np.isfinite(val).all())) if xp is np else (ok & xp.isfinite(val).all())
            if problem is not None:
                status[...] = _BAD_INPUT
            elif xp is np:
                status[...] = _OK if ok else _NON_FINITE
            else:
                status[...] = xp.where(ok, _OK, _NON_FINITE)
            t1 = time.perf_counter()
            recv = w.empty(xp, self.size)
            self.transport.allgather(send, recv)
            t2 = time.perf_counter()
            recv = recv.reshape(self.size, w.nbytes)
            payload = w.nbytes
            dense = lay.total * lay.dtype.itemsize
            traffic = (lambda *times: Traffic(1, payload, allgather_wire(payload, self.size), dense,
                                              allreduce_wire(dense, self.size), w.k_total, lay.total, *times))
            codes = _arr.to_host(recv[:, :4].copy().view(np.int32)).ravel().tolist()  # the one host read
            if any(codes):
                with self.stats.failed("sparse_allgather", lambda: traffic(t1 - t0, t2 - t1, 0.0)):
                    self._fail(codes, problem, "sparse_allgather")
            # Sum float16 payloads in float32: the sum over ranks may exceed 65504, the mean does not.
            acc = np.promote_types(lay.dtype, np.float32)
            out = xp.zeros(lay.total, dtype=acc)
            w.decode_all(recv, out, None if entries is None else entries[1])
            if self.size > 1:
                out *= out.dtype.type(1.0 / self.size)
            if acc != lay.dtype:
                out = out.astype(lay.dtype)
            self._uncommitted = (xp, flat, views, send, pos)
            if commit:
                self._commit(c)
        t3 = time.perf_counter()
        self.stats.record("sparse_allgather", traffic(t1 - t0, t2 - t1, t3 - t2))
        if isinstance(x, (list, tuple)):
            return lay.views(out)
        return out

    def commit_residual(self, skip=()):
        """Apply the last :meth:`sparse_allgather`'s error feedback, ``e = x + e - sent`` (``x + e``
        recomputed: the same bits as what was sent from). Tensors in ``skip`` keep their error
        buffer as it was (a tensor that had no gradient on any rank)."""
        if self._uncommitted is None:
            raise RuntimeError("no sparse_allgather to commit")
        self._commit(None, skip)

    def _commit(self, c, skip=()):
        """The error feedback of the pending exchange, ``e = x + e - sent``, in place.

        On a device, on the whole fused error buffer: ``e = c`` (the compensated buffer the
        exchange sent from: the same bits as ``e + x``) or ``e += x`` (recomputed, for
        :meth:`commit_residual`), then ``e[sent positions] -= sent values`` (one indexed
        subtraction: the positions are unique); the error buffers of the tensors in ``skip`` are
        copied before and put back after (two operations per skipped tensor). On the CPU, tensor
        by tensor (no temporary of the buffer's size)."""
        xp, flat, views, send, pos = self._uncommitted
        self._uncommitted = None
        lay, w = self.layout, self.wire
        _, idx, val = w.parts(send)
        if xp is np:
            if self.residual is None:
                self.residual = np.zeros(lay.total, lay.dtype)
            for i, e in enumerate(lay.flat_views(self.residual)):
                if i in skip:
                    continue
                a, k = w.starts[i], w.counts[i]
                e += views[i]
                if k:
                    e[idx[a : a + k]] -= val[a : a + k].astype(e.dtype, copy=False)  # what was not sent stays
            return
        skipped = [i for i in range(len(lay)) if lay.sizes[i] and i in skip]
        with _arr.device_scope(send):
            if c is not None:  # right after the exchange, which passes no skip
                if self.residual is None:
                    self.residual = c + c.dtype.type(0)  # 0 + x, as the first e is zeros: -0.0 becomes 0.0
                else:
                    self.residual[...] = c
                e = self.residual
                kept = ()
            else:
                if self.residual is None:
                    self.residual = xp.zeros(lay.total, lay.dtype)
                e = self.residual
                kept = [(o, n, e[o : o + n].copy()) for o, n in (lay.segments()[i] for i in skipped)]
                if flat is not None:
                    e += flat
                elif len(lay):
                    e += xp.concatenate([views[i] for i in range(len(lay))])
            if w.k_total:
                e[pos] -= val.astype(e.dtype, copy=False)  # what was not sent stays
            for o, n, saved in kept:
                e[o : o + n] = saved

    def _residual(self, xp):
        """The error buffer on ``xp`` (moved there after a load), or None before the first exchange."""
        if self.residual is not None and self._residual_on_host:
            self.residual = self.residual if xp is np else xp.asarray(self.residual)
        self._residual_on_host = False
        return self.residual

    @staticmethod
    def _fused_input(x, views):
        """``x`` as one fused 1-D array where it is one (validated: ``views`` are its tensors), else None."""
        if views is None or isinstance(x, (list, tuple)) or isinstance(views, LazyTensors):
            return None
        return _arr.as_array(x)

    def _compensated(self, xp, flat, views, e):
        """On a device, ``c = x + e`` as one fused buffer (``x`` itself for a fused ``x`` and no
        ``e`` yet): one addition, after one ``concatenate`` for a list."""
        if flat is not None:
            return flat if e is None else flat + e
        lay = self.layout
        arrs = [views[i] for i in range(len(lay))]
        c = xp.concatenate(arrs) if arrs else xp.zeros(0, lay.dtype)
        if e is not None:
            c += e
        return c

    def _encode_host(self, views, e, idx, val):
        """On the CPU, per tensor: ``c = x + e`` (a tensor-sized temporary), its finiteness, its
        top-k (:func:`~slamb_comm.codecs.topk_indices`, linear time) into the payload. Returns
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
