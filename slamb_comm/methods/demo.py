"""DeMo, Decoupled Momentum Optimization (Peng, Quesnelle & Kingma, 2024), on the core (docs/algorithm.md section 13).

Each rank keeps its own momentum ``m`` (never averaged). Per step:

1. ``m = beta m + g`` (this rank's gradient);
2. ``m`` is cut into chunks: a tensor of ndim >= 2, viewed as ``(shape[0], prod(shape[1:]))``,
   into ``s x s`` blocks, a 1-D tensor (or a scalar) into runs of ``s``, zero-padded where ``s``
   does not divide a dimension;
3. each chunk's orthonormal DCT-II (:func:`dct_matrix` D: ``C = D X D^T``, ``c = D x``) keeps its
   ``topk`` coefficients of largest magnitude (``min(topk, s)`` for a run);
4. ``q`` = the inverse DCT of the kept coefficients (as sent, in ``value_dtype``), cut back to
   the tensors; ``m = m - q``;
5. one all-gather of every rank's coefficients (int32 indices within the chunk, values);
6. ``Q = (1/P) sum_r IDCT(coefficients_r)``, the same bits on every rank;
7. ``x = (1 - lr wd) x - lr sign(Q)`` (signum with decoupled weight decay).

:class:`DCTChunks` is the codec (pure array code, NumPy or CuPy); :class:`DeMo` the rule over a
transport. A step is whole-buffer expressions on the fused buffer -- one gather into chunk
space, two batched matrix products per transform, one top-k per chunk kind (blocks, runs) --
whose number does not grow with the number of tensors; the decode adds three per rank, and
writing back a list ``x`` one or two per tensor.
"""

import hashlib
import logging
import time

import numpy as np

from .. import arrays as _arr
from ..wire.layout import Layout
from ..errors import (
    collective_error,
    STATUS_BAD_INPUT,
    STATUS_NON_FINITE,
    STATUS_OK,
    ConfigError,
    DTypeError,
    LayoutError,
    LayoutMismatchError,
    NonFiniteError,
    PeerError,
)
from ..wire.stats import Stats, Traffic, allgather_wire
from ..exchange.transports import LocalTransport

__all__ = ["DCTChunks", "DeMo", "dct_matrix"]

log = logging.getLogger("slamb_comm")



def dct_matrix(s, dtype=np.float64):
    """The orthonormal DCT-II matrix of size ``s``: ``D[u, n] = a_u cos(pi (2 n + 1) u / (2 s))``
    with ``a_0 = sqrt(1/s)`` and ``a_u = sqrt(2/s)`` for u > 0. ``D D^T = I``, so the inverse
    (DCT-III) is ``D^T``. Built in float64, then cast to ``dtype``."""
    n = np.arange(s, dtype=np.float64)
    d = np.cos(np.pi * np.outer(n, 2.0 * n + 1.0) / (2.0 * s)) * np.sqrt(2.0 / s)
    d[0] *= np.sqrt(0.5)
    return d.astype(dtype)


def _pad8(n):
    return -(-n // 8) * 8


class DCTChunks:
    """The DCT chunk codec of a fixed list of tensors (see the module docstring, steps 2-4, 6).

    Args:
        layout: a :class:`~slamb_comm.wire.layout.Layout` (or a list of arrays: their shapes and dtype).
        chunk: s, the chunk side (>= 1).
        topk: k, the coefficients kept per ``s x s`` block, 1 <= k <= s^2 (``min(k, s)`` per 1-D run).
        value_dtype: the payload's values, 'float32' (default), 'float16' or 'float64'.

    Attributes:
        n2, n1: the numbers of 2-D blocks and of 1-D runs; k2, k1: coefficients kept per each.
        K: coefficients sent per step, ``n2 k2 + n1 k1``.
        nbytes: one rank's payload, ``8 + pad8(4 K) + pad8(K * value itemsize)`` bytes.

    Chunk space is one flat array of ``n2 s^2 + n1 s`` elements: block c's element (a, b) at
    ``c s^2 + a s + b``, then run c's element a at ``n2 s^2 + c s + a``; blocks and runs in
    tensor order, a tensor's blocks row by row. A coefficient's index in the payload is its
    position within its chunk (``a s + b``, or ``a``), int32.
    """

    def __init__(self, layout, chunk=64, topk=32, value_dtype="float32"):
        if not isinstance(layout, Layout):
            layout = Layout.from_arrays(layout)
        s, k = _positive_int(chunk, "chunk"), _positive_int(topk, "topk")
        if k > s * s:
            raise ConfigError(f"topk={k} exceeds the chunk's {s}x{s} = {s * s} coefficients")
        self.layout, self.s, self.dtype = layout, s, layout.dtype
        self.value_dtype = np.dtype(_arr.value_dtype(value_dtype))
        self.k2, self.k1 = k, min(k, s)
        end = layout.total  # where padding reads from (m keeps one extra element there, always 0)
        blocks, runs = [], []
        for o, n, shape in zip(layout.offsets, layout.sizes, layout.shapes):
            if len(shape) >= 2:
                r, c = shape[0], n // shape[0] if shape[0] else 0
                nr, nc = -(-r // s), -(-c // s)
                grid = np.full((nr * s, nc * s), end, np.int64)
                grid[:r, :c] = (o + np.arange(n)).reshape(r, c)
                blocks.append(grid.reshape(nr, s, nc, s).transpose(0, 2, 1, 3).reshape(-1))
            else:
                run = np.full(-(-n // s) * s, end, np.int64)
                run[:n] = o + np.arange(n)
                runs.append(run)
        b2 = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
        b1 = np.concatenate(runs) if runs else np.zeros(0, np.int64)
        self.n2, self.n1 = b2.size // (s * s), b1.size // s
        small = np.int32 if max(end, b2.size + b1.size) < 2**31 - 1 else np.int64
        self.src = np.concatenate([b2, b1]).astype(small)  # chunk space -> fused buffer position
        self.size2 = self.n2 * s * s
        self.K = self.n2 * self.k2 + self.n1 * self.k1
        self.base = np.concatenate([np.repeat(np.arange(self.n2, dtype=np.int64) * s * s, self.k2),
                                    self.size2 + np.repeat(np.arange(self.n1, dtype=np.int64) * s, self.k1)])
        self.idx_bytes = _pad8(4 * self.K)
        self.nbytes = 8 + self.idx_bytes + _pad8(self.K * self.value_dtype.itemsize)
        self._cache = {}

    def _on(self, xp, name, dtype=None):
        """``src``, ``base`` or D (in ``dtype``) on ``xp`` (and CuPy's current device), made once."""
        key = (xp.__name__, None if xp is np else xp.cuda.Device().id, name, dtype and np.dtype(dtype).name)
        if key not in self._cache:
            host = dct_matrix(self.s, dtype) if name == "D" else getattr(self, name)
            self._cache[key] = host if xp is np else xp.asarray(host)
        return self._cache[key]

    def parts(self, buf):
        """Views of a payload (uint8): (status int32[1], indices int32[K], values[K])."""
        v = buf[8 + self.idx_bytes : 8 + self.idx_bytes + self.K * self.value_dtype.itemsize]
        return buf[:4].view(np.int32), buf[8 : 8 + 4 * self.K].view(np.int32), v.view(self.value_dtype)

    def gather(self, flat_ext):
        """The chunks of a fused buffer that has one extra element, 0, at its end."""
        return flat_ext.take(self._on(_arr.namespace(flat_ext), "src"))

    def scatter(self, chunks, flat_ext):
        """Chunk space back into ``flat_ext`` (real positions written once; padding goes to its
        last element, which the caller resets)."""
        flat_ext[self._on(_arr.namespace(chunks), "src")] = chunks
        return flat_ext

    def transform(self, chunks, inverse=False):
        """The DCT-II of every chunk (``inverse``: the DCT-III, D^T), as a new chunk-space array."""
        xp, s = _arr.namespace(chunks), self.s
        d = self._on(xp, "D", chunks.dtype)
        a, b = (d.T, d) if inverse else (d, d.T)  # block: a X b; run: x b (row vectors)
        out = xp.empty_like(chunks)
        if self.n2:
            xp.matmul(xp.matmul(a, chunks[: self.size2].reshape(-1, s, s)), b, out=out[: self.size2].reshape(-1, s, s))
        if self.n1:
            xp.matmul(chunks[self.size2 :].reshape(-1, s), b, out=out[self.size2 :].reshape(-1, s))
        return out

    def select(self, coef, idx_out, val_out):
        """Each chunk's top-k of ``|coef|`` into the payload views ``idx_out`` (within-chunk
        indices) and ``val_out`` (the values cast to ``value_dtype``). Ties: argpartition's order."""
        xp, s = _arr.namespace(coef), self.s
        k_at = 0
        for off, n, w, k in ((0, self.n2, s * s, self.k2), (self.size2, self.n1, s, self.k1)):
            if not n:
                continue
            c = coef[off : off + n * w].reshape(n, w)
            i = xp.argpartition(xp.abs(c), w - k, axis=1)[:, w - k :] if k < w else xp.broadcast_to(xp.arange(w), (n, w))
            idx_out[k_at : k_at + n * k] = i.reshape(-1)
            with np.errstate(over="ignore"):  # beyond float16's range: Inf, which the step rejects
                val_out[k_at : k_at + n * k] = xp.take_along_axis(c, i, axis=1).reshape(-1)
            k_at += n * k

    def encode(self, flat):
        """One fused buffer (``layout.total`` elements) -> (int32 indices, values): steps 2-3."""
        xp = _arr.namespace(flat)
        _, idx, val = self.parts(xp.zeros(self.nbytes, np.uint8))
        self.select(self.transform(self.gather(xp.concatenate([flat, xp.zeros(1, flat.dtype)]))), idx, val)
        return idx, val

    def coefficients(self, idx, val, dtype):
        """Chunk-space coefficients of one or more payloads (indices and values concatenated, each
        payload's positions unique), summed in payload order, in ``dtype``."""
        xp = _arr.namespace(idx)
        coef, base, per = xp.zeros(self.size2 + self.n1 * self.s, dtype), self._on(xp, "base"), max(self.K, 1)
        for a in range(0, idx.size, per):  # one payload at a time: within one, positions are unique
            coef[base + idx[a : a + per]] += val[a : a + per].astype(dtype)
        return coef

    def decode(self, idx, val, dtype=None):
        """The sum of the payloads' inverse DCTs as a fused buffer (step 4 for one payload; step 6
        times P for all), in ``dtype`` (default: the arrays' dtype, at least float32)."""
        xp = _arr.namespace(idx)
        dt = np.dtype(dtype or np.promote_types(self.dtype, np.float32))
        chunks = self.transform(self.coefficients(idx, val, dt), inverse=True)
        return self.scatter(chunks, xp.zeros(self.layout.total + 1, dt))[:-1]


def _positive_int(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


class DeMo:
    """DeMo's state and step for a fixed list of arrays over a transport (docs/algorithm.md section 13).

    Args:
        transport: a transport (:class:`~slamb_comm.exchange.transports.MPITransport`, ...), or None for
            one process. Construction is collective: ranks check they share layout and options.
        arrays: the parameters (their shapes and dtype: float32 or float64), or a Layout.
        lr: learning rate (the signum step's size). Default 4e-4, the authors' OLMo configs.
        beta: the momentum decay, in [0, 1) (default 0.999, the paper's).
        weight_decay: decoupled weight decay (default 0): ``x = (1 - lr wd) x - lr sign(Q)``.
        chunk, topk, value_dtype: the codec's (:class:`DCTChunks`): 64, 32, 'float32'.
        on_nonfinite: 'skip' (default) or 'raise', for a step with NaN/Inf on any rank.

    :meth:`step` updates the parameters; :meth:`direction` is the exchange alone (sign(Q)), for
    a caller (the torch adapter) that applies the update itself. ``stats`` counts the bytes.
    """

    def __init__(self, transport, arrays, *, lr=4e-4, beta=0.999, weight_decay=0.0, chunk=64, topk=32,
                 value_dtype="float32", on_nonfinite="skip"):
        self.transport = transport if transport is not None else LocalTransport()
        self.stats = Stats()
        self.t = self.skipped_steps = 0
        self.m = self._host_m = None
        problem = None
        try:
            self.layout = arrays if isinstance(arrays, Layout) else Layout.from_arrays(arrays)
            if self.layout.dtype == np.float16:
                raise DTypeError("DeMo keeps m in the parameters' dtype: keep a float32 copy of float16 parameters")
            self.lr, self.weight_decay, self.beta = float(lr), float(weight_decay), float(beta)
            if not 0.0 <= self.beta < 1.0:
                raise ConfigError(f"beta must be in [0, 1), got {beta}")
            if self.lr < 0 or self.weight_decay < 0:
                raise ConfigError(f"lr and weight_decay must be >= 0, got {lr}, {weight_decay}")
            if on_nonfinite not in ("skip", "raise"):
                raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
            self.on_nonfinite = on_nonfinite
            self.codec = DCTChunks(self.layout, chunk, topk, value_dtype)
        except Exception as e:  # raised below, after the other ranks heard of it
            if self.transport.size == 1:
                raise
            problem = e
        self._agree(problem)

    def _options(self):
        c = self.codec
        return (self.layout.shapes, self.layout.dtype.name, c.s, c.k2, c.value_dtype.name, self.beta,
                self.lr, self.weight_decay, self.on_nonfinite)

    def _agree(self, problem):
        """Every rank: no local error, and the same layout and options (one small all-gather)."""
        t = self.transport
        mine = np.zeros(3, np.int64)
        mine[0] = STATUS_OK if problem is None else STATUS_BAD_INPUT
        if problem is None:
            mine[1:] = np.frombuffer(hashlib.sha256(repr(self._options()).encode()).digest()[:16], np.int64)
        everyone = np.zeros(3 * t.size, np.int64)
        t.allgather(mine, everyone)
        everyone = everyone.reshape(t.size, 3)
        if problem is not None:
            raise problem
        bad = [r for r in range(t.size) if everyone[r, 0] != STATUS_OK]
        if bad:
            raise PeerError(f"DeMo: rank(s) {bad} rejected their arguments (see their error)", bad)
        differ = [r for r in range(t.size) if not np.array_equal(everyone[r, 1:], everyone[0, 1:])]
        if differ:
            raise LayoutMismatchError(f"DeMo: rank(s) {differ} differ from rank 0 in arrays or options; this is "
                                      f"rank {t.rank} with {self.layout.describe()}, options {self._options()[2:]}")

    def _flat(self, a, what, join=True):
        """(xp, ``a`` as one fused 1-D array (``join``) or None) of a list or a fused buffer, checked."""
        lay = self.layout
        if isinstance(a, (list, tuple)):
            if len(a) != len(lay):
                raise LayoutError(f"{what}: {len(a)} arrays for {len(lay)} tensors")
            arrs = [_arr.as_array(v) for v in a]
            for v, s, name in zip(arrs, lay.shapes, lay.names):
                if tuple(v.shape) != s or v.dtype != lay.dtype:
                    raise LayoutError(f"{what}: tensor {name} is {v.dtype.name}{list(v.shape)}, "
                                      f"expected {lay.dtype.name}{list(s)}")
            xp = _arr.namespace(*arrs) if arrs else np
            return xp, (xp.concatenate([v.reshape(-1) for v in arrs]) if arrs else xp.zeros(0, lay.dtype)) if join else None
        v = _arr.as_array(a)
        if v.shape != (lay.total,) or v.dtype != lay.dtype:
            raise LayoutError(f"{what}: a fused buffer must be {lay.dtype.name}[{lay.total}], got {v.dtype.name}{list(v.shape)}")
        return _arr.namespace(v), v

    def _momentum(self, xp):
        """m (with its extra 0 at the end) on ``xp``: zeros before the first step, or the loaded state."""
        if self._host_m is not None:
            self.m, self._host_m = xp.asarray(self._host_m), None
        elif self.m is None:
            self.m = xp.zeros(self.layout.total + 1, self.layout.dtype)
        elif _arr.namespace(self.m) is not xp:
            self.m = xp.asarray(self.m) if xp is not np else _arr.to_host(self.m)
        return self.m

    def direction(self, g, x=None):
        """One exchange (steps 1-6): returns ``sign(Q)`` as a fused buffer, identical on every rank,
        and commits ``m``; or None if the step was skipped (non-finite values on some rank, with
        ``on_nonfinite='skip'``), with nothing changed. ``g``: a list of arrays shaped like the
        layout, or one fused buffer; ``x`` (optional) is only validated, collectively."""
        t0 = time.perf_counter()
        codec, lay, P = self.codec, self.layout, self.transport.size
        problem, xp = None, np
        try:
            xp, gflat = self._flat(g, "g")
            if x is not None:
                self._flat(x, "x", join=False)
        except Exception as e:  # noqa: BLE001 -- every rank hears of it through the status word
            problem = e
        with _arr.device_scope(gflat if problem is None else np.zeros(0)):
            send = xp.zeros(codec.nbytes, np.uint8)
            status, idx, val = codec.parts(send)
            status[...] = STATUS_BAD_INPUT
            if problem is None:
                mn = self._momentum(xp) * lay.dtype.type(self.beta)  # a new m: the old one stays until commit
                mn[:-1] += gflat
                ok = xp.isfinite(mn).all()
                chunks = codec.gather(mn)
                codec.select(codec.transform(chunks), idx, val)
                if val.dtype.itemsize < lay.dtype.itemsize:  # e.g. beyond +-65504 in float16
                    ok &= xp.isfinite(val).all()
                status[...] = xp.where(ok, STATUS_OK, STATUS_NON_FINITE)
            t1 = time.perf_counter()
            recv = xp.empty(P * codec.nbytes, np.uint8)
            self.transport.allgather(send, recv)
            t2 = time.perf_counter()
            dense = lay.total * lay.dtype.itemsize
            traffic = (lambda enc, comm, dec: Traffic.one_call(
                payload_bytes=codec.nbytes, wire_bytes=allgather_wire(codec.nbytes, P), dense_bytes=dense, size=P,
                elements_sent=codec.K, elements_total=lay.total, encode_s=enc, comm_s=comm, decode_s=dec))
            recv = recv.reshape(P, codec.nbytes)
            codes = _arr.to_host(recv[:, :4].copy().view(np.int32)).ravel().tolist()  # the one host read
            if any(codes):
                failed = (lambda: traffic(t1 - t0, t2 - t1, 0.0))  # the bytes of a failed step still count
                with self.stats.failed("demo_allgather", failed):
                    self._fail(codes, problem)
                self.stats.record("demo_allgather", failed())
                return None
            parts = [codec.parts(recv[r]) for r in range(P)]
            both = xp.concatenate([p[1] for p in parts]), xp.concatenate([p[2] for p in parts])
            Q = codec.decode(*both)  # the sum over ranks, in rank order: the same bits on every rank
            Q *= Q.dtype.type(1.0 / P)
            u = xp.sign(Q).astype(lay.dtype, copy=False)
            q = codec.transform(codec.coefficients(idx, val, lay.dtype), inverse=True)  # values as sent
            chunks -= q  # m = m - q: real positions once each; padding lands on the extra element
            codec.scatter(chunks, mn)[-1] = 0
            self.m, self.t = mn, self.t + 1
        self.stats.record("demo_allgather", traffic(t1 - t0, t2 - t1, time.perf_counter() - t2))
        return u

    def _fail(self, codes, problem):
        """A step every rank gives up: this rank's own error, PeerError, or a non-finite step
        (raised, or skipped: counted and logged)."""
        e = collective_error(codes, problem, "DeMo", nonfinite="non-finite momentum or payload (NaN/Inf)")
        if self.on_nonfinite == "raise" or not isinstance(e, NonFiniteError):
            raise e
        self.skipped_steps += 1
        log.warning("slamb_comm: DeMo step %d skipped on every rank (%d so far): %s", self.t + 1, self.skipped_steps, e)

    def step(self, x, g):
        """One DeMo step: ``x = (1 - lr wd) x - lr sign(Q)`` in place (``x``, ``g``: lists of arrays
        shaped like the layout, or fused buffers). Returns True, or False for a skipped step."""
        u = self.direction(g, x)
        if u is None:
            return False
        lay = self.layout
        decay = lay.dtype.type(1.0 - self.lr * self.weight_decay)
        u *= lay.dtype.type(self.lr)  # exact: u is -1, 0 or 1
        if isinstance(x, (list, tuple)):
            for v, part in zip(x, lay.views(u)):
                v = _arr.as_array(v)
                if self.weight_decay:
                    v *= decay
                v -= part
        else:
            x = _arr.as_array(x)
            if self.weight_decay:
                x *= decay
            x -= u
        return True

    def state_dict(self):
        """This rank's state: step, skipped steps and m (a host copy), with the options it needs."""
        m = self._host_m if self._host_m is not None else self.m
        return {"step": self.t, "skipped_steps": self.skipped_steps,
                "m": None if m is None else _arr.to_host(m)[: self.layout.total].copy(),
                "shapes": [list(s) for s in self.layout.shapes], "dtype": self.layout.dtype.name,
                "chunk": self.codec.s, "topk": self.codec.k2}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly (m moves to the arrays' device at the next step)."""
        lay = self.layout
        if [tuple(s) for s in state["shapes"]] != lay.shapes or (state["chunk"], state["topk"]) != (self.codec.s, self.codec.k2):
            raise ConfigError(f"DeMo state of shapes {state['shapes']}, chunk {state['chunk']}, topk {state['topk']} "
                              f"does not fit {lay.describe()}, chunk {self.codec.s}, topk {self.codec.k2}")
        m = None if state["m"] is None else np.asarray(_arr.to_host(state["m"]))
        if m is not None and m.shape != (lay.total,):
            raise LayoutError(f"saved m has shape {m.shape}, expected ({lay.total},)")
        self.t, self.skipped_steps = int(state["step"]), int(state.get("skipped_steps", 0))
        self.m, self._host_m = None, None if m is None else np.concatenate([m.astype(lay.dtype), np.zeros(1, lay.dtype)])
