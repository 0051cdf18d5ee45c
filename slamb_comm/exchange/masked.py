"""The masked allreduce of a :class:`~slamb_comm.exchange.communicator.Communicator`:
``x[M_t] = mean over ranks of x[M_t]`` for the shared mask M_t (docs/algorithm.md section 1, step 3).

:class:`MaskedAllreduce` is a part that the ``Communicator`` owns; it uses the communicator's public
layout, mask, transport, value dtype, input checks, status words and statistics. It also writes the
statistics record of every masked exchange, whoever runs it (SLAMB's steps, an adapter's own
collectives).
"""

import time

import numpy as np

from .. import arrays as _arr
from ..errors import ConfigError
from ..wire.codecs import k_elems
from ..wire.masks import BLOCK
from ..wire.stats import Traffic, allreduce_wire

__all__ = ["MaskedAllreduce"]


class MaskedAllreduce:
    """The masked allreduce of the communicator ``comm`` (see the module docstring)."""

    def __init__(self, comm):
        self.comm = comm

    def select(self, step, xp=np, views=None):
        """M_t of ``step`` as a :class:`~slamb_comm.wire.masks.Selection` (for the topk mask a
        collective over ``views``, this rank's data: every rank must call it)."""
        comm = self.comm
        if comm.mask_kind == "topk":
            if views is None:  # a rank that rejected its input still takes part, with dummy picks
                local = {i: xp.arange(k_elems(comm.ratio, comm.layout.sizes[i]), dtype=np.int64)
                         for i in comm.layout.compressible}
                return comm.mask.union(xp, local, comm.transport)
            return comm.mask.select(step, xp, views, comm.transport)
        return comm.mask.select(step, xp)

    def masked_allreduce(self, x, step):
        """In place: ``x[M_t] = mean over ranks of x[M_t]`` for the shared mask of ``step``.

        One allreduce of the |M_t| masked values (plus a status slot) and one host read.

        Args:
            x: the fused buffer (or list of arrays) holding this rank's values.
            step: the 1-based step t that selects M_t (the same on every rank).

        Returns:
            ``x``, and the positions M_t in the fused buffer (an int array, in payload order).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ConfigError(f"step must be an integer >= 1, got {step!r}")
        comm = self.comm
        vdt = comm.value_dtype
        t0 = time.perf_counter()
        xp, views, problem = comm.take(x)
        with _arr.device_scope(views[0] if views else np.zeros(0)):
            sel = self.select(step, xp, views)
            m = sel.size
            buf = xp.empty(m + 1, dtype=vdt)
            if views is None:
                buf[:m] = 0
            else:
                _take(xp, sel, views, buf[:m])
            t1 = time.perf_counter()
            payload = (m + 1) * vdt.itemsize
            with comm.stats.failed("masked_allreduce", lambda: self.traffic(payload, m, t1 - t0,
                                                                             time.perf_counter() - t1)):
                comm.reduce_checked(buf, problem, False, f"masked_allreduce at step {step}", (sel.starts, sel.counts),
                                    sent=lambda: _take(xp, sel, views, xp.empty(m, vdt)))
            t2 = time.perf_counter()
            self._put_means(buf, sel, views)
        self.record(payload, m, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return x, sel.index

    def _put_means(self, buf, sel, views):
        """The summed payload's means into the tensors, divided in the wider of the payload's and the
        tensors' dtypes (a float16 buffer's sum may exceed 65504, its mean not)."""
        size = self.comm.size
        wide = np.promote_types(self.comm.value_dtype, self.comm.layout.dtype)
        for i, (p, s, c) in enumerate(zip(sel.picks, sel.starts, sel.counts)):
            if c:
                vals = _arr.cast(buf[s : s + c], wide, copy=False)
                if size > 1:
                    vals *= vals.dtype.type(1.0 / size)
                p.put(views[i], None, vals)

    def traffic(self, payload_bytes, elements_sent, encode_s=0.0, comm_s=0.0, decode_s=0.0):
        """The :class:`~slamb_comm.wire.stats.Traffic` of one masked allreduce of ``payload_bytes`` (its
        status words included) carrying ``elements_sent`` values, against a dense allreduce of the
        layout (docs/algorithm.md section 4): every masked exchange's record, whoever runs it (this
        communicator, SLAMB's steps, an adapter's own collectives)."""
        lay, size = self.comm.layout, self.comm.size
        return Traffic.one_call(
            payload_bytes=payload_bytes, wire_bytes=allreduce_wire(payload_bytes, size),
            dense_bytes=lay.total * lay.dtype.itemsize, size=size, elements_sent=elements_sent,
            elements_total=lay.total, encode_s=encode_s, comm_s=comm_s, decode_s=decode_s)

    def record(self, payload_bytes, elements_sent, encode_s=0.0, comm_s=0.0, decode_s=0.0):
        """Count one masked allreduce in the communicator's statistics (see :meth:`traffic`)."""
        self.comm.stats.record("masked_allreduce", self.traffic(payload_bytes, elements_sent, encode_s, comm_s,
                                                                decode_s))


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
