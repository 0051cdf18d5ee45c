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

It is a part of a :class:`~slamb_comm.Communicator` (which makes it at first use, as
``comm.onebit``, and uses its public transport, layout, value dtype, input checks and statistics)
and needs a transport with ``alltoall``; :class:`~slamb_comm.methods.onebit_lamb.OneBitLambRule`
shares its error buffers through ``comm.onebit``.

Costs: 1/32 of a dense fp32 allreduce's bytes on the links (plus 16 bytes of header per block);
the worker error (N' elements) and the server error (N'/P) in ``promote(dtype, float32)``. On
the CPU, whole-buffer NumPy operations and scratch of one compensated copy of the buffer per
call. On a device (:class:`DeviceWire`, the kernels of :mod:`slamb_comm.device.onebit_kernels`): four
launches besides the two collectives, whatever the number of tensors and whether ``x`` is one
fused buffer or a list of arrays (read and written where they are), about 33 bytes of device
traffic per float32 element at two ranks, one host read, and no copy to the device once a
list's table of addresses is made; kept scratch of c (N'), u (N'/P) and the blocks of the two
collectives, nothing allocated per call. The results are the CPU's, bit for bit.

Failure behaviour, as for the communicator's other exchanges: every block carries a status
word, and a rank with bad input or a non-finite compensated buffer or scale makes every rank
raise (:class:`~slamb_comm.errors.PeerError` / :class:`~slamb_comm.errors.NonFiniteError`)
after the same two collectives; neither the buffer nor the error buffers change.
"""

import math
import time
from typing import NamedTuple

import numpy as np

from .. import arrays as _arr
from ..device import tables as _dev
from ..device import onebit_kernels as _ok
from ..wire.layout import LazyTensors, fused_input
from ..errors import (
    collective_error,
    STATUS_BAD_INPUT,
    STATUS_NON_FINITE,
    ConfigError,
    LayoutError,
    LayoutMismatchError,
    NonFiniteError,
)
from ..device.kernels import TILE
from ..wire.stats import Traffic, allgather_wire, alltoall_wire

__all__ = ["OneBitExchange", "DeviceWire", "pack_signs", "unpack_signs", "padded_size"]

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


def tree_depth(n):
    """H, the depth of NumPy's pairwise tree over ``n`` elements (a multiple of 8) at which every node is
    a leaf (the device's tree passes, :mod:`slamb_comm.device.onebit_kernels`, sum ``2^H`` slots)."""
    if n % 8:
        raise ValueError(f"the tree passes take a multiple of 8 elements, got {n}")
    sizes, depth = {n}, 0
    while max(sizes) > 128:
        halves = {s: s // 2 - s // 2 % 8 for s in sizes if s > 128}
        sizes = {p for s in sizes for p in ((halves[s], s - halves[s]) if s > 128 else (s,))}
        depth += 1
    return depth


def _subtrees(depth):
    """The blocks of a tree pass: one per subtree of 256 leaves (one for a smaller tree)."""
    return 1 << max(0, depth - 8)


class _Times(NamedTuple):
    """Seconds of one exchange so far: encoding (worker and server), the collectives, and the
    ``perf_counter`` at which the collectives ended (decoding is timed from there)."""

    encode: float
    comm: float
    end: float


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
        self._wire = None  # ((library, device), its DeviceWire)
        self._host = HostWire(self)  # the exchange on NumPy arrays

    # ------------------------------------------------------------------ state
    def _state_xp(self):
        a = self.worker_error if self.worker_error is not None else self.server_error
        if a is None or self._on_host:
            return None
        return _arr.namespace(a)

    def errors(self, xp):
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
        """A state :func:`slamb_comm.methods.resize.resize` made from P other ranks' (docs/algorithm.md
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
    def allreduce(self, x):
        """In place: ``x`` becomes the 1-bit compressed mean over ranks (docs/onebit_lamb.md
        section 1), the same on every rank; the error buffers are updated. Returns ``x``.

        ``x`` is the fused buffer (``layout.total`` elements) or a list of arrays shaped like the
        layout, of the layout's dtype. Two collectives (an all-to-all, an allgather) and, on a
        GPU, one host read and four launches whatever the number of tensors (the three of
        :meth:`device_exchange`, then one that writes ``x`` and commits the errors).

        Raises (on every rank alike; nothing changes): PeerError where another rank rejected
        its input; LayoutError/DTypeError/NonContiguousError/TypeError on the rank whose input
        was bad; NonFiniteError where a rank's ``x + e`` or a scale is not finite.
        """
        t0 = time.perf_counter()
        xp, views, flat, problem = self._input(x)
        if views is not None and len(self.layout):
            like = views[0]
        else:
            like = self.worker_error if self._state_xp() is not None else np.zeros(0)
        with _arr.device_scope(like):
            if xp is np:
                times = self._host.allreduce(views, flat, problem, t0)
            else:
                times = self._device_allreduce(xp, views, flat, problem, t0)
        self.record(times)
        return x

    def _input(self, x):
        """``(xp, views, flat, problem)``: the caller's tensors (``flat``: ``x`` itself where it is
        one fused buffer), or ``views`` None and the error this rank must raise after taking
        part in the collectives with zeros."""
        comm = self.comm
        xp, views, problem = comm.take(x)
        if isinstance(views, LazyTensors):  # items converted on the fly: writing into them would be lost
            views, problem = None, TypeError("the 1-bit exchange writes its result in place: pass a fused buffer "
                                             "or a list of arrays, not a lazily converted sequence")
        sxp = self._state_xp()
        if problem is None and sxp is not None and xp is not sxp:
            views, problem = None, TypeError(f"the 1-bit exchange's state lives in {sxp.__name__}, got {xp.__name__}")
        if views is None:
            xp = sxp or np
        return xp, views, None if views is None else fused_input(comm.layout, x, views), problem

    def check(self, codes, problem, times):
        """Raise on every rank alike, given both phases' status words (every rank's, then every
        server's): a rank's bad input or non-finite ``c``, or a server's non-finite scale."""
        P, comm = self.size, self.comm
        codes1, codes2 = codes[:P], codes[P:]
        with comm.stats.failed(self.KIND, lambda: self._traffic(times.encode, times.comm, 0.0)):
            if any(codes1) or problem is not None:
                raise collective_error(codes1, problem, "onebit_allreduce")
            if any(codes2):
                bad = [r for r, v in enumerate(codes2) if v]
                raise NonFiniteError(f"onebit_allreduce: the server scale of chunk(s) {bad} is not finite (beyond "
                                     f"the range of {self.value_dtype.name}); nothing was changed", bad)

    def record(self, times):
        """Count one exchange (its timings :class:`_Times`, decoding until now) in the statistics."""
        decode_s = time.perf_counter() - times.end
        self.comm.stats.record(self.KIND, self._traffic(times.encode, times.comm, decode_s))

    # ------------------------------------------------------------------ on a device
    def _device_allreduce(self, xp, views, flat, problem, t0):
        """The exchange on a device: :meth:`device_exchange` of ``x`` (read where it is: one fused
        buffer, or a list through its table of addresses), then one launch writes the result into
        ``x`` and commits both error buffers in place."""
        tiles, tables = self.comm.device_tables(xp)
        x = None if views is None else _dev.tensors(xp, tables, "onebit", views if flat is None else flat,
                                                   self.layout.dtype)
        w, times = self.device_exchange(xp, lambda w, e: w.encode(xp, tiles, x, e), problem, t0)
        w.decode(xp, tiles, x, *self.error_buffers(xp))
        return times

    def device_exchange(self, xp, encode, problem=None, t0=None):
        """Both phases on the device, nothing committed: ``encode(wire, e)`` writes phase 1's
        blocks and the compensated buffer ``wire.c`` from the worker error ``e`` (None: zeros; a
        rank with a ``problem`` sends zeros); then the all-to-all, the server's pass
        (:meth:`DeviceWire.serve`), the allgather, and one host read of both phases' status words
        (:meth:`DeviceWire.codes`), raising as :meth:`allreduce` does. Returns the
        :class:`DeviceWire` (phase 2's blocks in ``recv2``; ``c`` and ``u``, which
        :meth:`error_buffers` are to become) and the :class:`_Times`. Two launches besides
        ``encode`` and the collectives, whatever the number of tensors."""
        t0 = time.perf_counter() if t0 is None else t0
        key = (xp.__name__, xp.cuda.Device().id)
        if self._wire is None or self._wire[0] != key:
            self._wire = (key, DeviceWire(xp, self))
        w = self._wire[1]
        ew, es = self.errors(xp) if problem is None else (None, None)
        encode(w, ew)
        t1 = time.perf_counter()
        self.comm.transport.alltoall(w.send, w.recv)
        t2 = time.perf_counter()
        w.serve(xp, es)
        t3 = time.perf_counter()
        self.comm.transport.allgather(w.send2, w.recv2)
        t4 = time.perf_counter()
        times = _Times(t1 - t0 + t3 - t2, t2 - t1 + t4 - t3, t4)
        self.check(w.codes(xp), problem, times)
        return w, times

    def commit_errors(self, worker, server):
        """The worker and server errors of an exchange that succeeded become this exchange's."""
        self.worker_error, self.server_error = worker, server

    def error_buffers(self, xp):
        """The worker and server errors, which a device commit writes in place (made, not yet
        initialised, before the first exchange: the commit writes every element)."""
        if self.worker_error is None:
            self.worker_error = xp.empty(self.padded, self.acc_dtype)
            self.server_error = xp.empty(self.chunk, self.acc_dtype)
        return self.worker_error, self.server_error

    def _traffic(self, encode_s, comm_s, decode_s):
        """One exchange's :class:`Traffic`: the all-to-all's P blocks and the allgather's one."""
        P, B, lay = self.size, self.block, self.layout
        p1, p2 = P * B, B
        dense = lay.total * lay.dtype.itemsize
        return Traffic.one_call(
            payload_bytes=p1 + p2, wire_bytes=alltoall_wire(p1, P) + allgather_wire(p2, P), dense_bytes=dense, size=P,
            elements_sent=lay.total, elements_total=lay.total, encode_s=encode_s, comm_s=comm_s, decode_s=decode_s)


class HostWire:
    """The exchange of a :class:`OneBitExchange` ``ex`` on NumPy arrays: whole-buffer operations, step by
    step (docs/onebit_lamb.md section 1), on the exchange's geometry and error buffers."""

    def __init__(self, ex):
        self.ex = ex

    def allreduce(self, views, flat, problem, t0):
        """The exchange on NumPy arrays: whole-buffer operations (section 1, step by step)."""
        ex = self.ex
        comm, lay, P, B = ex.comm, ex.layout, ex.size, ex.block
        ew, es = ex.errors(np) if views is not None else (None, None)
        c, s, bits, send = self._worker(views, flat, problem, ew)
        t1 = time.perf_counter()
        recv = np.empty((P, B), np.uint8)
        comm.transport.alltoall(send.reshape(-1), recv.reshape(-1))
        t2 = time.perf_counter()
        u, sigma, ubits, send2 = self._server(recv, es)
        t3 = time.perf_counter()
        recv2 = np.empty((P, B), np.uint8)
        comm.transport.allgather(send2, recv2.reshape(-1))
        t4 = time.perf_counter()
        times = _Times(t1 - t0 + t3 - t2, t2 - t1 + t4 - t3, t4)
        words = np.concatenate((recv[:, :4].copy().view(np.int32).reshape(-1),
                                recv2[:, :4].copy().view(np.int32).reshape(-1)))
        ex.check(words.tolist(), problem, times)
        y = self._decoded(recv2, self._scales(recv2))
        if flat is not None:
            flat[...] = y[: lay.total]  # one copy
        else:  # one copy per tensor: the arrays are the caller's
            for v, o, n in zip(views, lay.offsets, lay.sizes):
                if n:
                    v[...] = y[o : o + n]
        acc = ex.acc_dtype
        s_acc, sigma_acc = s.astype(acc), sigma.astype(acc)
        c -= np.where(bits, s_acc, -s_acc)
        u -= np.where(ubits, sigma_acc, -sigma_acc)
        ex.commit_errors(c, u)
        return times

    def _worker(self, views, flat, problem, ew):
        """Steps 1-2: ``c = pad(x) + e``, its scale and signs, and phase 1's blocks."""
        ex = self.ex
        lay, P, cb = ex.layout, ex.size, ex.chunk_bytes
        c = np.zeros(ex.padded, ex.acc_dtype)
        if views is not None:
            self._gather(flat, views, c[: lay.total])
            if ew is not None:
                c += ew
        s, ok = self._scale(c, ex.padded)
        bits = c >= 0
        status = STATUS_BAD_INPUT if problem is not None else (0 if ok else STATUS_NON_FINITE)
        send = np.zeros((P, ex.block), np.uint8)
        send[:, : ex.HEADER] = self._header(status, s)
        send[:, ex.HEADER : ex.HEADER + cb] = pack_signs(bits).reshape(P, cb)
        return c, s, bits, send

    def _server(self, recv, es):
        """Steps 5-7: the server's average of the P decoded chunks plus its error, its scale and
        signs, and phase 2's block."""
        ex = self.ex
        P, nc, cb, acc = ex.size, ex.chunk, ex.chunk_bytes, ex.acc_dtype
        scales = self._scales(recv).reshape(P)
        scales *= acc.type(1.0 / P)
        signs = unpack_signs(recv[:, ex.HEADER : ex.HEADER + cb].copy().reshape(-1)).reshape(P, nc)
        u = np.zeros(nc, acc)
        for j in range(P):
            sj = signs[j].astype(acc)
            sj *= 2
            sj -= 1
            sj *= scales[j]
            u += sj
        if es is not None:
            u += es
        sigma, ok = self._scale(u, nc)
        ubits = u >= 0
        send2 = np.zeros(ex.block, np.uint8)
        send2[: ex.HEADER] = self._header(0 if ok else STATUS_NON_FINITE, sigma)
        send2[ex.HEADER : ex.HEADER + cb] = pack_signs(ubits)
        return u, sigma, ubits, send2

    def _scales(self, blocks):
        """The scales in the headers of ``blocks`` (P rows), in the accumulation dtype, as a column."""
        vdt = self.ex.value_dtype
        return blocks[:, 8 : 8 + vdt.itemsize].copy().view(vdt).reshape(-1, 1).astype(self.ex.acc_dtype)

    def _decoded(self, recv2, sig):
        """Step 9: ``σ_k sgn(u_k)`` on every chunk k, the padded result."""
        ex = self.ex
        cb = ex.chunk_bytes
        y = unpack_signs(recv2[:, ex.HEADER : ex.HEADER + cb].copy().reshape(-1)).reshape(ex.size, ex.chunk)
        y = y.astype(ex.acc_dtype)
        y *= 2
        y -= 1
        y *= sig
        return y.reshape(-1)

    def _header(self, status, scale):
        """The 16-byte block header: int32 ``status`` and the scale as ``value_dtype``."""
        vdt = self.ex.value_dtype
        h = np.zeros(self.ex.HEADER, np.uint8)
        h[0:4].view(np.int32)[...] = status
        h[8 : 8 + vdt.itemsize].view(vdt)[...] = scale
        return h

    def _scale(self, a, n):
        """``||a|| / sqrt(n)`` summed in float64 (NumPy's pairwise sum, which the device's tree
        passes reproduce bit for bit), as ``value_dtype`` (0-d array), and whether it is finite.
        A NaN or Inf in ``a`` makes it NaN/Inf."""
        sq = np.sum(np.square(a, dtype=np.float64))
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported as non-finite instead
            s = (np.sqrt(sq) / math.sqrt(n)).astype(self.ex.value_dtype)
        return s, bool(np.isfinite(s))

    def _gather(self, flat, views, out):
        """``out[...] = x`` (the caller's arrays, fused): one copy for a fused ``x``, else per tensor."""
        if flat is not None:
            out[...] = flat
            return
        lay = self.ex.layout
        for v, o, n in zip(views, lay.offsets, lay.sizes):
            if n:
                out[o : o + n] = v


class DeviceWire:
    """The device side of one :class:`OneBitExchange` (made once per device) and its launches: the
    compensated buffer ``c`` (N', the worker error-to-be) and the server's average ``u`` (N'/P),
    the four blocks of the two collectives (the two sent have their padding bytes zeroed once:
    nothing writes them), both phases' status words (the host read), and the subtree sums and
    block counters of the two tree passes (docs/onebit_lamb.md section 5). One zero fill
    (the blocks to send and the counters, carved out of one buffer); the rest uninitialised."""

    def __init__(self, xp, ex):
        P, B, acc = ex.size, ex.block, ex.acc_dtype
        self.ex = ex
        self.depth, self.depth2 = tree_depth(ex.padded), tree_depth(ex.chunk)
        zeroed = xp.zeros(P * B + B + 16, np.uint8)  # B is a multiple of 8: the counters are aligned
        self.send, self.send2 = zeroed[: P * B], zeroed[P * B : P * B + B]
        self.counters = zeroed[P * B + B :].view(np.uint32)
        self.recv, self.recv2 = xp.empty(P * B, np.uint8), xp.empty(P * B, np.uint8)
        self.c, self.u = xp.empty(ex.padded, acc), xp.empty(ex.chunk, acc)
        self.words = xp.empty(2 * P, np.int32)
        self.partials = xp.empty(_subtrees(self.depth) + _subtrees(self.depth2), np.float64)

    def worker_pass(self):
        """The trailing arguments of a worker's tree pass (into ``c`` and ``send``), its grid and its
        writes."""
        ex, nw = self.ex, _subtrees(self.depth)
        args = (np.int64(ex.padded), np.int32(self.depth), self.c, self.send, np.int64(ex.chunk_bytes),
                np.int64(ex.block), np.int32(ex.size), np.float64(math.sqrt(ex.padded)), self.partials[:nw],
                self.counters[:2])
        writes = [("compensated", ex.padded * ex.acc_dtype.itemsize), ("signs", ex.padded // 8 + 16 * ex.size),
                  ("subtree sums", 16 * nw)]
        return args, nw, writes

    def encode(self, xp, tiles, x, e):
        """Phase 1's encoding of the exchange's input ``x`` (:class:`~slamb_comm.device.onebit_kernels.Tensors`;
        None on a rank that rejected its input: zeros, status 1) plus the worker error ``e`` (None before
        the first exchange: zeros): ``c``, its signs, its scale and status into every block's header."""
        ex = self.ex
        lay, acc = ex.layout, ex.acc_dtype
        zero = x is None
        if zero:
            x = _dev.Tensors(_dev.dummy(xp, np.uint64), _dev.dummy(xp, lay.dtype), np.int32(1))
        tail, grid, writes = self.worker_pass()
        args = (x.tab, x.flat, x.fused, tiles.toff, np.int32(len(lay)), np.int64(lay.total), _dev.dummy(xp, acc, e),
                np.int32(e is not None), np.int32(zero), *tail)
        reads = [("x", 0 if zero else lay.total * lay.dtype.itemsize),
                 ("worker error", 0 if e is None else ex.padded * acc.itemsize), _dev.table_bytes(x, len(lay))]
        _ok.launch(xp, _ok.name("encode_x", lay.dtype, ex.value_dtype), grid, args, reads, writes)

    def serve(self, xp, es):
        """Phase 2's encoding: this rank's chunk averaged over the P ranks' signs and scales, plus the
        server error ``es`` (None: zeros), into ``u``; its signs, scale and status into ``send2``."""
        ex = self.ex
        P, nc, acc = ex.size, ex.chunk, ex.acc_dtype
        nw, ns = _subtrees(self.depth), _subtrees(self.depth2)
        args = (self.recv, np.int64(ex.block), np.int32(P), np.float64(1.0 / P), _dev.dummy(xp, acc, es),
                np.int32(es is not None), np.int64(nc), np.int32(self.depth2), self.u, self.send2,
                np.float64(math.sqrt(nc)), self.partials[nw:], self.counters[2:])
        reads = [("signs", P * (ex.chunk_bytes + 16)), ("server error", 0 if es is None else nc * acc.itemsize)]
        writes = [("average", nc * acc.itemsize), ("signs", ex.chunk_bytes + 16), ("subtree sums", 16 * ns)]
        _ok.launch(xp, _ok.name("server", acc, ex.value_dtype), ns, args, reads, writes)

    def codes(self, xp):
        """Both phases' status words, every rank's then every server's: one small launch, one host read."""
        P = self.ex.size
        _ok.launch(xp, "ob_collect", 1, (self.recv, self.recv2, np.int64(self.ex.block), np.int32(P), self.words),
                   reads=[("status words", 8 * P)], writes=[("status words", 8 * P)])
        return _arr.to_host(self.words).tolist()

    def decode(self, xp, tiles, x, e, es):
        """The result, ``σ_k sgn(u_k)`` on chunk k, into the tensors ``x`` (:class:`~slamb_comm.device.onebit_kernels.
        Tensors`), and the errors ``e``, ``es`` committed in place from ``c`` and ``u``: one launch."""
        ex = self.ex
        lay, acc, Np, nc = ex.layout, ex.acc_dtype, ex.padded, ex.chunk
        args = (*_dev.tiled(tiles), x.tab, x.flat, x.fused, tiles.toff, self.recv2, np.int64(ex.block), np.int64(nc),
                self.c, e, np.int64(Np), self.send, self.u, es, self.send2)
        reads = [("signs", lay.total // 8 + 16 * ex.size), ("c, u", (Np + nc) * acc.itemsize),
                 ("tables", 20 * tiles.count), _dev.table_bytes(x, len(lay))]
        writes = [("x", lay.total * lay.dtype.itemsize), ("errors", (Np + nc) * acc.itemsize)]
        _ok.launch(xp, _ok.name("decode", lay.dtype, ex.value_dtype), max(tiles.count, Np // TILE + 1), args, reads,
                   writes)
