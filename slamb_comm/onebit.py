"""The error-compensated 1-bit allreduce of 1-bit Adam/LAMB (docs/onebit_lamb.md section 1).

:class:`OneBitExchange` averages one fused buffer over the ranks at 1 bit per element plus
one scale per rank and per chunk, in two phases, as DeepSpeed's ``compressed_allreduce``:

1. each rank compensates ``c = x + e`` (its worker error, padded to N' elements), sends the
   signs of c, packed 8 per byte, chunk k to rank k (one all-to-all) together with its scale
   ``s = ||c|| / sqrt(N')``, and keeps ``e = c - s sgn(c)``;
2. rank k, the "server" of chunk k, averages the P decoded chunks, adds its server error,
   compresses again (``σ = ||u|| / sqrt(N'/P)``, ``ē = u - σ sgn(u)``) and every rank gathers
   every server's signs and scale (one allgather); the result, ``σ_k sgn(u_k)`` on chunk k,
   is the same on every rank.

It is built on a :class:`~slamb_comm.Communicator` (its transport, layout, value dtype and
statistics) and needs a transport with ``alltoall``. :meth:`OneBitExchange.of` gives the one
exchange of a communicator (made at first use and kept on it), so a communicator method is one
line, and shares its error buffers with :class:`~slamb_comm.onebit_lamb.OneBitLamb`::

    def onebit_allreduce(self, x):
        return OneBitExchange.of(self).allreduce(x)

Costs: 1/32 of a dense fp32 allreduce's bytes on the links (plus 16 bytes of header per block);
the worker error (N' elements) and the server error (N'/P) in ``promote(dtype, float32)``;
scratch of one compensated copy of the buffer per call; one host read per call on a GPU, and a
constant number of device operations (whole-buffer operations, a few per rank) plus, where ``x``
is a list of arrays rather than one fused buffer, one copy per tensor back into the caller's arrays
(the copy in is one ``concatenate``).

Failure behaviour, as for the communicator's other exchanges: every block carries a status
word, and a rank with bad input or a non-finite compensated buffer or scale makes every rank
raise (:class:`~slamb_comm.errors.PeerError` / :class:`~slamb_comm.errors.NonFiniteError`)
after the same two collectives; neither the buffer nor the error buffers change.
"""

import math
import time

import numpy as np

from . import arrays as _arr
from .codecs import LazyTensors
from .errors import ConfigError, LayoutError, LayoutMismatchError, NonFiniteError
from .stats import Traffic, allgather_wire, allreduce_wire, alltoall_wire

__all__ = ["OneBitExchange", "pack_signs", "unpack_signs", "padded_size"]

_BAD_INPUT, _NON_FINITE = 1, 2  # the communicator's status codes (Communicator._fail reads them)
_WEIGHTS = np.array([128, 64, 32, 16, 8, 4, 2, 1], np.uint8)  # most significant bit first, as np.packbits
_SHIFTS = np.array([7, 6, 5, 4, 3, 2, 1, 0], np.uint8)


def _const(xp, host, cache={}):  # noqa: B006 -- a cache of two tiny constants per library and device
    key = (xp.__name__, id(host), None if xp is np else xp.cuda.Device().id)
    a = cache.get(key)
    if a is None:
        a = cache[key] = host if xp is np else xp.asarray(host)
    return a


def pack_signs(bits):
    """``numpy.packbits`` of a 1-D bool array whose size is a multiple of 8 (most significant bit
    first), for NumPy and CuPy arrays; uses the library's own ``packbits`` where it has one."""
    xp = _arr.namespace(bits)
    if bits.size % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 bits, got {bits.size}")
    native = getattr(xp, "packbits", None)
    if native is not None:
        return native(bits)
    b = bits.reshape(-1, 8).astype(np.uint8)
    b *= _const(xp, _WEIGHTS)
    return b.sum(axis=1, dtype=np.uint8)


def unpack_signs(packed):
    """``numpy.unpackbits`` of a 1-D uint8 array (most significant bit first): uint8 zeros and
    ones, 8 per byte, for NumPy and CuPy arrays."""
    xp = _arr.namespace(packed)
    native = getattr(xp, "unpackbits", None)
    if native is not None:
        return native(packed)
    return ((packed.reshape(-1, 1) >> _const(xp, _SHIFTS)) & 1).reshape(-1)


def padded_size(n, size):
    """N': the smallest multiple of ``size * lcm(size, 8)`` that is >= ``n`` (at least one such
    multiple), DeepSpeed's padding of the fused buffer; every chunk ``N' / size`` is whole bytes."""
    q = size * (size * 8 // math.gcd(size, 8))
    return max(1, -(-int(n) // q)) * q


def _round8(n):
    return -(-n // 8) * 8


class OneBitExchange:
    """The 1-bit compressed allreduce of ``comm.layout``'s fused buffer, with its error buffers.

    Args:
        comm: a :class:`~slamb_comm.Communicator`; its transport must have ``alltoall``
            (:class:`~slamb_comm.MPITransport`, :class:`~slamb_comm.NCCLTransport`,
            :class:`~slamb_comm.LocalTransport`, the Horovod transport). Scales travel in
            ``comm.value_dtype``; the error buffers are kept in ``promote(dtype, float32)``.

    Attributes:
        padded: N', the padded length (a multiple of ``P * lcm(P, 8)``).
        chunk: N' / P, the elements each rank serves.
        worker_error, server_error: this rank's error buffers (``None`` before the first exchange
            that succeeded, which counts as zeros).

    Block layout, phase 1 (one block per destination) and phase 2 (one per rank): a 16-byte
    header (int32 status, 4 bytes padding, the scale in ``value_dtype``, zero padding), then
    the chunk's packed signs, then zeros up to a multiple of 8 bytes.
    """

    HEADER = 16
    KIND = "onebit_allreduce"

    def __init__(self, comm):
        t = comm.transport
        if not callable(getattr(t, "alltoall", None)):
            raise ConfigError(f"the 1-bit exchange needs a transport with alltoall; {type(t).__name__} has none")
        self.comm = comm
        self.layout = comm.layout
        self.size = comm.size
        self.rank = comm.rank
        self.value_dtype = np.dtype(comm.value_dtype)
        self.acc_dtype = np.promote_types(self.layout.dtype, np.float32)
        self.padded = padded_size(self.layout.total, self.size)
        self.chunk = self.padded // self.size
        self.chunk_bytes = self.chunk // 8
        self.block = self.HEADER + _round8(self.chunk_bytes)
        self.worker_error = None
        self.server_error = None
        self._on_host = False  # restored by load_state_dict, not yet moved to a device

    @classmethod
    def of(cls, comm):
        """The exchange of ``comm``: made at the first call and kept on the communicator (as
        ``comm._onebit``), so that every user of the communicator's 1-bit exchange shares one
        pair of error buffers."""
        ex = vars(comm).get("_onebit")
        if ex is None:
            ex = comm._onebit = cls(comm)
        return ex

    # ------------------------------------------------------------------ state
    def _state_xp(self):
        a = self.worker_error if self.worker_error is not None else self.server_error
        if a is None or self._on_host:
            return None
        return _arr.namespace(a)

    def _errors(self, xp):
        """The error buffers on ``xp`` (moved there after a load), or ``(None, None)`` before the
        first exchange."""
        if self._on_host and xp is not np:
            self.worker_error = None if self.worker_error is None else xp.asarray(self.worker_error)
            self.server_error = None if self.server_error is None else xp.asarray(self.server_error)
        self._on_host = False
        return self.worker_error, self.server_error

    def _digest(self):
        return self.layout.digest("onebit", self.value_dtype.name, self.size).hex()

    def state_dict(self):
        """This rank's state: host copies of the worker and server errors (``None`` before the
        first exchange), with the rank, the number of ranks and N' they belong to."""
        host = (lambda a: None if a is None else _arr.to_host(a).copy())
        return {
            "worker_error": host(self.worker_error),
            "server_error": host(self.server_error),
            "rank": self.rank,
            "size": self.size,
            "padded": self.padded,
            "digest": self._digest(),
        }

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly. The buffers stay on the host until the next
        exchange, which moves them to the device of its arrays.

        Raises:
            LayoutMismatchError: the state was saved by another rank, for another number of
                ranks, or for another layout or value dtype (a server error belongs to one
                rank's chunk: it cannot move to another rank or another P).
        """
        if "resized_from" in state:
            return self._load_resized(state)
        if state.get("digest") != self._digest() or int(state.get("size", -1)) != self.size \
                or int(state.get("padded", -1)) != self.padded:
            raise LayoutMismatchError("the saved 1-bit exchange state was made for another layout, value dtype "
                                      f"or number of ranks (this is {self.size} ranks, N'={self.padded})")
        if int(state.get("rank", -1)) != self.rank:
            raise LayoutMismatchError(f"the saved 1-bit exchange state is rank {state.get('rank')}'s; this is rank "
                                      f"{self.rank} (every rank must load its own)")
        we, se = state.get("worker_error"), state.get("server_error")
        if (we is None) != (se is None):
            raise LayoutError("saved worker and server errors must both be present or both None")
        if we is not None and (np.shape(we) != (self.padded,) or np.shape(se) != (self.chunk,)):
            raise LayoutError(f"saved errors have shapes {np.shape(we)} and {np.shape(se)}, expected "
                              f"({self.padded},) and ({self.chunk},)")
        cast = (lambda a: None if a is None else np.array(_arr.to_host(a), dtype=self.acc_dtype, copy=True))
        self.worker_error, self.server_error = cast(we), cast(se)
        self._on_host = we is not None

    def _load_resized(self, state):
        """A state :func:`slamb_comm.resize.resize` made from P other ranks' (docs/algorithm.md
        section 10): the averaged worker errors padded to this N', and this rank's chunk of the
        concatenated server errors, cut for this number of ranks."""
        old = int(state["resized_from"])
        if state.get("old_digest") != self.layout.digest("onebit", self.value_dtype.name, old).hex():
            raise LayoutMismatchError("the resized 1-bit exchange state was made for another layout or value dtype")
        if int(state["rank"]) != self.rank or int(state["size"]) != self.size:
            raise LayoutMismatchError(f"the resized 1-bit exchange state is for rank {state['rank']} of {state['size']}; "
                                      f"this is rank {self.rank} of {self.size}")
        we, se = state.get("worker_error_full"), state.get("server_error_full")
        if we is None:
            self.worker_error = self.server_error = None
            self._on_host = False
            return
        n = self.layout.total
        w = np.zeros(self.padded, self.acc_dtype)
        full = np.zeros(max(self.padded, n), self.acc_dtype)
        w[:n] = np.asarray(we)[:n]
        full[:n] = np.asarray(se)[:n]
        self.worker_error = w
        self.server_error = full[self.rank * self.chunk:(self.rank + 1) * self.chunk].copy()
        self._on_host = True

    # ------------------------------------------------------------------ the exchange
    def _header(self, xp, status, scale):
        """The 16-byte block header: int32 ``status`` (an int, or a 0-d device array) and the
        scale as ``value_dtype`` (a 0-d array)."""
        h = xp.zeros(self.HEADER, np.uint8)
        h[0:4].view(np.int32)[...] = status
        h[8 : 8 + self.value_dtype.itemsize].view(self.value_dtype)[...] = scale
        return h

    def _scale(self, xp, a, n):
        """``||a|| / sqrt(n)`` summed in float64, as ``value_dtype`` (0-d array), and whether it
        is finite (bool on the host, 0-d array on a device). A NaN or Inf in ``a`` makes it NaN/Inf."""
        sq = xp.sum(xp.square(a, dtype=np.float64))
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported as non-finite instead
            s = (xp.sqrt(sq) / math.sqrt(n)).astype(self.value_dtype)
        fin = xp.isfinite(s)
        return s, (bool(fin) if xp is np else fin)

    def allreduce(self, x):
        """In place: ``x`` becomes the 1-bit compressed mean over ranks (docs/onebit_lamb.md
        section 1), the same on every rank; the error buffers are updated. Returns ``x``.

        ``x`` is the fused buffer (``layout.total`` elements) or a list of arrays shaped like the
        layout, of the layout's dtype. Two collectives (an all-to-all, an allgather) and, on a
        GPU, one host read.

        Raises (on every rank alike; nothing changes): PeerError where another rank rejected
        its input; LayoutError/DTypeError/NonContiguousError/TypeError on the rank whose input
        was bad; NonFiniteError where a rank's ``x + e`` or a scale is not finite.
        """
        t0 = time.perf_counter()
        comm, lay = self.comm, self.layout
        P, Np, nc, cb, B = self.size, self.padded, self.chunk, self.chunk_bytes, self.block
        acc, vdt = self.acc_dtype, self.value_dtype
        xp, views, problem = comm._take_or_problem(x)
        if isinstance(views, LazyTensors):  # items converted on the fly: writing into them would be lost
            views, problem = None, TypeError("the 1-bit exchange writes its result in place: pass a fused buffer "
                                             "or a list of arrays, not a lazily converted sequence")
        sxp = self._state_xp()
        if problem is None and sxp is not None and xp is not sxp:
            views, problem = None, TypeError(f"the 1-bit exchange's state lives in {sxp.__name__}, got {xp.__name__}")
        if views is None:
            xp = sxp or np
        like = views[0] if views is not None and len(lay) else (self.worker_error if sxp is not None else np.zeros(0))
        with _arr.device_scope(like):
            # ---- worker: compensate, scale, signs
            c = xp.zeros(Np, acc)
            ew, es = self._errors(xp) if views is not None else (None, None)
            flat = None if views is None else comm._fused_input(x, views)
            if views is not None:
                self._gather(xp, flat, views, c[: lay.total])
                if ew is not None:
                    c += ew
            s, ok = self._scale(xp, c, Np)
            bits = c >= 0
            if problem is not None:
                status = _BAD_INPUT
            elif xp is np:
                status = 0 if ok else _NON_FINITE
            else:
                status = xp.where(ok, 0, _NON_FINITE).astype(np.int32)
            send = xp.zeros((P, B), np.uint8)
            send[:, : self.HEADER] = self._header(xp, status, s)
            send[:, self.HEADER : self.HEADER + cb] = pack_signs(bits).reshape(P, cb)
            t1 = time.perf_counter()
            # ---- phase 1: chunk k of every rank's signs (and every rank's scale) to rank k
            recv = xp.empty((P, B), np.uint8)
            comm.transport.alltoall(send.reshape(-1), recv.reshape(-1))
            t2 = time.perf_counter()
            # ---- server: average the P decoded chunks, add the server error, compress again
            scales = recv[:, 8 : 8 + vdt.itemsize].copy().view(vdt).reshape(P).astype(acc)
            scales *= acc.type(1.0 / P)
            signs = unpack_signs(recv[:, self.HEADER : self.HEADER + cb].copy().reshape(-1)).reshape(P, nc)
            u = xp.zeros(nc, acc)
            for j in range(P):
                sj = signs[j].astype(acc)
                sj *= 2
                sj -= 1
                sj *= scales[j]
                u += sj
            if es is not None:
                u += es
            sigma, ok2 = self._scale(xp, u, nc)
            ubits = u >= 0
            status2 = (0 if ok2 else _NON_FINITE) if xp is np else xp.where(ok2, 0, _NON_FINITE).astype(np.int32)
            send2 = xp.zeros(B, np.uint8)
            send2[: self.HEADER] = self._header(xp, status2, sigma)
            send2[self.HEADER : self.HEADER + cb] = pack_signs(ubits)
            t3 = time.perf_counter()
            # ---- phase 2: every server's signs and scale to every rank
            recv2 = xp.empty((P, B), np.uint8)
            comm.transport.allgather(send2, recv2.reshape(-1))
            t4 = time.perf_counter()
            # ---- one host read: both phases' status words
            words = xp.concatenate((recv[:, :4].copy().view(np.int32).reshape(-1),
                                    recv2[:, :4].copy().view(np.int32).reshape(-1)))
            codes = _arr.to_host(words).tolist()
            codes1, codes2 = codes[:P], codes[P:]
            with comm.stats.failed(self.KIND, lambda: self._traffic(t1 - t0 + t3 - t2, t2 - t1 + t4 - t3, 0.0)):
                if any(codes1) or problem is not None:
                    comm._fail(codes1, problem, "onebit_allreduce")
                if any(codes2):
                    bad = [r for r, v in enumerate(codes2) if v]
                    raise NonFiniteError(f"onebit_allreduce: the server scale of chunk(s) {bad} is not finite (beyond "
                                         f"the range of {vdt.name}); nothing was changed", bad)
            # ---- decode, write x, commit the error buffers
            sig = recv2[:, 8 : 8 + vdt.itemsize].copy().view(vdt).reshape(P, 1).astype(acc)
            y = unpack_signs(recv2[:, self.HEADER : self.HEADER + cb].copy().reshape(-1)).reshape(P, nc).astype(acc)
            y *= 2
            y -= 1
            y *= sig
            y = y.reshape(-1)
            if flat is not None:
                flat[...] = y[: lay.total]  # one copy
            else:  # one copy per tensor: the arrays are the caller's
                for v, o, n in zip(views, lay.offsets, lay.sizes):
                    if n:
                        v[...] = y[o : o + n]
            s_acc = s.astype(acc)
            c -= xp.where(bits, s_acc, -s_acc)
            sigma_acc = sigma.astype(acc)
            u -= xp.where(ubits, sigma_acc, -sigma_acc)
            self.worker_error, self.server_error = c, u
        t5 = time.perf_counter()
        comm.stats.record(self.KIND, self._traffic((t1 - t0) + (t3 - t2), (t2 - t1) + (t4 - t3), t5 - t4))
        return x

    def _gather(self, xp, flat, views, out):
        """``out[...] = x`` (the caller's arrays, fused): one copy for a fused ``x``; for a list of
        arrays on a device one ``concatenate`` (into ``out`` when the dtypes agree, else a
        concatenation and one cast), per tensor on the CPU."""
        lay = self.layout
        if flat is not None:
            out[...] = flat
        elif xp is np or not len(lay):
            for v, o, n in zip(views, lay.offsets, lay.sizes):
                if n:
                    out[o : o + n] = v
        elif lay.dtype == out.dtype:
            xp.concatenate([views[i] for i in range(len(lay))], out=out)
        else:
            out[...] = xp.concatenate([views[i] for i in range(len(lay))])

    def _traffic(self, encode_s, comm_s, decode_s):
        """One exchange's :class:`Traffic`: the all-to-all's P blocks and the allgather's one."""
        P, B, lay = self.size, self.block, self.layout
        p1, p2 = P * B, B
        dense = lay.total * lay.dtype.itemsize
        return Traffic(1, p1 + p2, alltoall_wire(p1, P) + allgather_wire(p2, P), dense, allreduce_wire(dense, P),
                       lay.total, lay.total, encode_s, comm_s, decode_s)
