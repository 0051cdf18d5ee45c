"""The dense parameter sync of a :class:`~slamb_comm.exchange.communicator.Communicator`
(docs/algorithm.md section 3): SLAMB's periodic average and the dense baseline.

:class:`DenseSync` is a part that the ``Communicator`` owns and hands its :meth:`sync` to; it uses
the communicator's public layout, transport, statistics, input checks and status words.
"""

import time

import numpy as np

from .. import arrays as _arr
from ..device import tables as _dev
from ..wire.layout import LazyTensors, fused_input
from ..wire.stats import Traffic, allreduce_wire

__all__ = ["DenseSync"]


class DenseSync:
    """``sync``: the in-place dense mean over ranks of a fused buffer or a list of arrays, for the
    communicator ``comm`` (its part: see the module docstring)."""

    def __init__(self, comm):
        self.comm = comm
        self.layout, self.transport, self.stats, self.size = comm.layout, comm.transport, comm.stats, comm.size

    def sync(self, x, written=None, bad=None):
        """In place: ``x = mean over ranks of x``, in ``x``'s own dtype.

        Used for SLAMB's periodic parameter sync and as the dense baseline. The status word goes
        first, alone, and is checked with one host read before anything is written: a rank with
        bad input or non-finite ``x`` makes every rank raise, with nothing changed. It also counts
        the ranks that took part: where some contributed zeros instead (ranks that called
        Horovod's ``join()``), the mean is over the others, so the parameters are not shrunk towards
        zero. Then each rank sends ``x / P`` (so no sum can overflow; exact for P a power of two), in
        allreduces of at most ``bucket_bytes``: a fused buffer in place (no copy of it is made), a
        list of arrays through a buffer of that size (on a device two copy kernels per allreduce,
        whatever the number of tensors; on the CPU, or for a lazily read sequence, tensor by tensor).

        ``written(i)``, if given, is called once tensor i has been written (for lazily converted
        inputs; see :func:`slamb_comm.wire.layout.take`). ``bad``: the caller's word that ``x`` is not finite on this
        rank (a bool, or a 0-d device array whose nonzero value says so, as a kernel's flag word),
        which saves reading all of ``x`` once more (and, for a lazy sequence, converting it all).
        """
        t0 = time.perf_counter()
        xp, views, problem = self.comm.take(x)
        lay = self.layout
        with _arr.device_scope(views[0] if views else np.zeros(0)):
            if bad is None:
                bad = False if views is None else self._not_finite(xp, views)
            c0 = time.perf_counter()
            fix = self._sync_status(xp.zeros(1, lay.dtype), problem, bad, views, xp)
            comm_s = time.perf_counter() - c0
            flat = fused_input(self.layout, x, views)
            if flat is not None:
                comm_s += self._sync_in_place(flat, fix)
            else:
                comm_s += self._sync_list(xp, views, fix, written)
            if written is not None and (flat is not None or not isinstance(views, LazyTensors)):
                for i in range(len(lay)):
                    written(i)
        n, dt, P = lay.total, lay.dtype, self.size
        payload, dense = (n + 1) * dt.itemsize, n * dt.itemsize
        self.stats.record("sync", Traffic.one_call(
            payload_bytes=payload, wire_bytes=allreduce_wire(payload, P), dense_bytes=dense, size=P,
            elements_sent=n, elements_total=n, comm_s=comm_s, decode_s=time.perf_counter() - t0 - comm_s))
        return x

    def _not_finite(self, xp, views):
        """Whether some tensor of this rank's ``views`` is not finite (a bool, or a 0-d device array)."""
        bad = False
        for i in range(len(self.layout)):
            v = views[i]
            if v.size:
                fin = xp.isfinite(v.max()) & xp.isfinite(v.min())
                bad = (bad or not bool(fin)) if xp is np else (bad | ~fin)
        return bad

    def _sync_status(self, buf, problem, bad, views, xp):
        """The sync's status word ``buf`` (one element), summed and checked with one host read;
        returns ``P / ranks that took part`` where that is not 1 (in the dtype), else None."""
        P, dt, lay = self.size, self.layout.dtype, self.layout
        c0 = time.perf_counter()
        dense = lay.total * dt.itemsize
        with self.stats.failed("sync", lambda: Traffic.one_call(
                payload_bytes=dt.itemsize, wire_bytes=allreduce_wire(dt.itemsize, P), dense_bytes=dense, size=P,
                elements_sent=0, elements_total=lay.total, comm_s=time.perf_counter() - c0)):
            word = self.comm.reduce_checked(buf, problem, bad, "sync", whole=False, present=dt.type(1.0 / P),
                                       mine=lambda: [not bool(xp.isfinite(views[i]).all()) for i in range(len(lay))])
        took_part = round(word * P)
        return dt.type(P / took_part) if 0 < took_part < P else None

    def _cap(self):
        return max(1, min(self.layout.total, self.comm.bucket_bytes // self.layout.dtype.itemsize))

    def _sync_in_place(self, flat, fix):
        """A fused buffer: ``flat /= P`` and its allreduce in place, in slices of at most
        ``bucket_bytes``. Returns the seconds spent in the collectives."""
        P, dt, cap = self.size, self.layout.dtype, self._cap()
        if P > 1:
            flat *= dt.type(1.0 / P)
        c0 = time.perf_counter()
        for lo in range(0, flat.size, cap):
            self.transport.allreduce(flat[lo : lo + cap])
        comm_s = time.perf_counter() - c0
        if fix is not None:
            flat *= fix
        return comm_s

    def _sync_list(self, xp, views, fix, written):
        """A list of arrays through a buffer of at most ``bucket_bytes``. Returns the seconds spent in
        the collectives."""
        lay, P, dt, cap = self.layout, self.size, self.layout.dtype, self._cap()
        buf = xp.empty(cap, dtype=dt)
        scale = dt.type(1.0 / P) if P > 1 else None
        device = xp is not np and not isinstance(views, LazyTensors)
        if device:
            tiles, tables = self.comm.device_tables(xp)
            table = tables.table(xp, "sync", views)
        comm_s = 0.0
        for lo in range(0, lay.total, cap):
            hi = min(lay.total, lo + cap)
            b = buf[: hi - lo]
            if device:
                _dev.copy_range(xp, tiles, table, lo, hi, b, 1.0 if scale is None else scale, False)
            else:
                self._copy_pieces(views, lo, hi, b, into_tensors=False)
                if scale is not None:
                    b *= scale
            c0 = time.perf_counter()
            self.transport.allreduce(b)
            comm_s += time.perf_counter() - c0
            if device:
                _dev.copy_range(xp, tiles, table, lo, hi, b, 1.0 if fix is None else fix, True)
            else:
                if fix is not None:
                    b *= fix
                self._copy_pieces(views, lo, hi, b, into_tensors=True,
                                  written=written if isinstance(views, LazyTensors) else None)
        return comm_s

    def _copy_pieces(self, views, lo, hi, buf, into_tensors, written=None):
        """Fused elements ``[lo, hi)`` between the tensors ``views`` and ``buf``, tensor by tensor (a
        lazy sequence converts a tensor when it is first reached); ``written(i)`` once tensor i is
        complete."""
        lay = self.layout
        for i in range(len(lay)):
            o, n = lay.offsets[i], lay.sizes[i]
            a, b = max(o, lo), min(o + n, hi)
            if a >= b:
                continue
            if into_tensors:
                views[i][a - o : b - o] = buf[a - lo : b - lo]
                if written is not None and b == o + n:
                    written(i)
            else:
                buf[a - lo : b - lo] = views[i][a - o : b - o]
