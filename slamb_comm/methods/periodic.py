"""Periodic averaging on the core: DiLoCo and DES-LOC (docs/algorithm.md section 12).

Both let every rank run an inner optimizer alone and communicate only every few steps. They
work on a fixed list of NumPy/CuPy arrays (or one fused 1-D buffer) and a transport, as
:class:`~slamb_comm.Communicator` does, and average through :meth:`Communicator.sync`, so the
bytes are counted as everywhere else (docs/algorithm.md section 4) and non-finite values or
bad input raise on every rank with nothing changed (docs/algorithm.md section 9).

* :class:`DiLoCo` (Douillard et al. 2023): every ``sync_interval`` inner steps, the
  pseudo-gradient ``delta = anchor - x`` is averaged over ranks (one allreduce, optionally in
  float16), an outer Nesterov SGD step moves the anchor, and x becomes the anchor on every rank.
* :class:`DesLoc` (Iacob et al., ICLR 2026): the parameters x, Adam's first moment m and its
  second moment v are each replaced by their mean over ranks on a period of their own.

Construction is collective: the ranks check that they agree on the arrays and options, and the
arrays are broadcast from rank 0, so that every rank starts from the same x (recorded in
``stats`` as a 'broadcast', outside the first step's counts). Then call ``step()`` once after
every inner step, on every rank.
"""

import hashlib
import math
import time

import numpy as np

from .. import arrays as _arr
from ..wire.layout import Layout
from ..exchange.communicator import Communicator
from ..errors import (
    ConfigError,
    LayoutError,
    LayoutMismatchError,
    NonContiguousError,
    PeerError,
    SlambCommError,
)
from ..wire.stats import Traffic
from ..exchange.transports import LocalTransport

__all__ = ["Periodic", "DiLoCo", "DesLoc", "DEFAULT_INTERVAL", "check_interval", "check_number", "host_copy"]

#: default number of inner steps between averages (the DiLoCo paper uses 500; see section 12)
DEFAULT_INTERVAL = 50


def check_interval(name, value, fix):
    """``value`` as an int >= 1, else a ConfigError (a ValueError) naming ``name`` and ``fix``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1 (inner steps between two averages), got {value!r}; {fix}")
    return int(value)


def check_number(name, value, ok, want, fix):
    """``value`` as a float if it is a finite real number and ``ok(value)``, else a ConfigError
    naming ``name``, what it must be (``want``) and ``fix``."""
    real = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and ok(value)):
        raise ConfigError(f"{name} must be {want}, got {value!r}; {fix}")
    return float(value)


def host_copy(a):
    return None if a is None else np.array(_arr.to_host(a), copy=True)


class Periodic:
    """What DiLoCo and DES-LOC share: the layout, the agreement, the broadcast, the step count."""

    kind = "periodic"

    def setup(self, transport, x, names, options, check, comm_dtype, bucket_bytes):
        self.transport = transport if transport is not None else LocalTransport()
        problem, digest = None, bytes(16)
        try:
            check()
            if isinstance(x, (list, tuple)):
                arrs = [_arr.as_array(a) for a in x]
                if not arrs:
                    raise ConfigError(f"{self.kind} needs at least one array")
                self.layout = Layout.from_arrays(arrs, names=names)
            else:
                flat = _arr.as_array(x)
                if flat.ndim != 1:
                    raise LayoutError(f"pass a list of arrays or one fused 1-D buffer, got shape {tuple(flat.shape)}")
                self.layout = Layout([flat.shape], flat.dtype, names=names)
            self.dtype = self.layout.dtype
            got = self.views(x)  # before the agreement: a non-contiguous array fails on every rank alike
            self.value_dtype = _arr.value_dtype(self.dtype if comm_dtype is None else comm_dtype)
            self.options = dict(options(), value_dtype=self.value_dtype.name)
            text = repr((self.kind, sorted(self.options.items()), self.layout.shapes, self.dtype.name))
            digest = hashlib.sha256(text.encode()).digest()[:16]
        except (SlambCommError, TypeError) as e:
            problem = e
        self._agree(problem, digest)
        lay = self.layout
        self.comm = Communicator(self.transport, Layout(lay.shapes, self.value_dtype, names=lay.names),
                                 ratio=1.0, seed=0, bucket_bytes=bucket_bytes)
        self.stats = self.comm.stats
        self.t = 0
        return self.broadcast(*got)

    def _agree(self, problem, digest):
        """Every rank checks, in one allgather, that no rank rejected its options and all agree."""
        t = self.transport
        mine = np.zeros(3, np.int64)
        mine[0] = problem is not None
        mine[1:] = np.frombuffer(digest, np.int64)
        rows = np.zeros(3 * t.size, np.int64)
        t.allgather(mine, rows)
        rows = rows.reshape(t.size, 3)
        if problem is not None:
            raise problem
        failed = [r for r in range(t.size) if rows[r, 0]]
        if failed:
            raise PeerError(f"rank(s) {failed} rejected the {self.kind} options or arrays (see their error)", failed)
        differ = [r for r in range(t.size) if not np.array_equal(rows[r, 1:], rows[0, 1:])]
        if differ:
            raise LayoutMismatchError(
                f"ranks disagree on the {self.kind} options or arrays: rank(s) {differ} differ from rank 0; this is "
                f"rank {t.rank} with {self.options} and {self.layout.describe()}")

    def views(self, x):
        """``(xp, 1-D views of the tensors, the fused buffer or None)``; LayoutError etc. on bad input."""
        lay = self.layout
        if isinstance(x, (list, tuple)):
            arrs = [_arr.as_array(a) for a in x]
            if len(arrs) != len(lay):
                raise LayoutError(f"got {len(arrs)} arrays, {self.kind} was built for {len(lay)}")
            for a, name, shape in zip(arrs, lay.names, lay.shapes):
                if tuple(a.shape) != shape or a.dtype != self.dtype:
                    raise LayoutError(f"tensor {name!r} is {a.dtype.name}{list(a.shape)}, expected "
                                      f"{self.dtype.name}{list(shape)}")
                if not a.flags.c_contiguous:
                    raise NonContiguousError(f"tensor {name!r} is not C-contiguous")
            return _arr.namespace(*arrs), [a.reshape(-1) for a in arrs], None
        flat = _arr.as_array(x)
        if flat.shape != (lay.total,) or flat.dtype != self.dtype or not flat.flags.c_contiguous:
            raise LayoutError(f"expected a contiguous fused buffer of {lay.total} {self.dtype.name}, got "
                              f"{flat.dtype.name}{list(flat.shape)}")
        return _arr.namespace(flat), lay.flat_views(flat), flat

    def take(self, x, what="x"):
        """:meth:`views`, collectively: a rank whose input is bad still takes part in the exchange
        the others are in (flagged), so they raise PeerError naming it, and it raises its own error."""
        try:
            if x is None:
                raise ConfigError(f"{self.kind} step {self.t} averages {what}: pass it to step()")
            return self.views(x)
        except (SlambCommError, TypeError):
            try:
                self.comm.sync([])  # a flagged dummy payload: nothing changes on any rank
            except SlambCommError:
                pass
            raise

    def broadcast(self, xp, views, flat):
        """Rank 0's x on every rank (in place); returns ``(xp, views, flat)`` of x."""
        lay, P = self.layout, self.transport.size
        if P > 1:
            t0 = time.perf_counter()
            with _arr.device_scope(views[0]):
                buf = flat if flat is not None else xp.concatenate(views)
                self.transport.broadcast(buf, root=0)
                if flat is None:
                    for v, o, n in zip(views, lay.offsets, lay.sizes):
                        v[...] = buf[o : o + n]
            dense = lay.total * self.dtype.itemsize
            self.stats.record("broadcast", Traffic.one_call(
                payload_bytes=dense, wire_bytes=float(dense), dense_bytes=dense, size=P, elements_sent=lay.total,
                elements_total=lay.total, comm_s=time.perf_counter() - t0))
            self.stats.new_step()  # the start's broadcast is in stats.total, not in the first step's counts
        return xp, views, flat

    def base_state(self):
        return {"kind": self.kind, "t": self.t, "options": dict(self.options),
                "shapes": [list(s) for s in self.layout.shapes], "dtype": self.dtype.name}

    def load_base(self, state):
        if state.get("kind") != self.kind:
            raise ConfigError(f"this state was saved by {state.get('kind')!r}, not {self.kind!r}")
        if [tuple(s) for s in state["shapes"]] != self.layout.shapes or state["dtype"] != self.dtype.name:
            raise LayoutMismatchError(f"the saved {self.kind} state was made for other arrays "
                                      f"({len(state['shapes'])} tensors of {state['dtype']}); this one has "
                                      f"{self.layout.describe()}")
        t = state["t"]
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ConfigError(f"saved step count must be an integer >= 0, got {t!r}")
        return int(t)

    def load_arrays(self, state, keys):
        """Restore the step count and the fused arrays ``keys`` of :meth:`state_dict` output exactly,
        onto the device of the current anchor (all checked before any is replaced)."""
        t = self.load_base(state)
        new = []
        for key in keys:
            v = np.asarray(state[key])
            if v.shape != (self.layout.total,) or v.dtype != self.dtype:
                raise LayoutMismatchError(f"saved {key} is {v.dtype.name}{list(v.shape)}, expected "
                                          f"{self.dtype.name}[{self.layout.total}]")
            new.append(v)
        xp = _arr.namespace(self.anchor)
        with _arr.device_scope(self.anchor):
            for key, v in zip(keys, new):
                setattr(self, key, xp.array(v, copy=True))
        self.t = t


class DiLoCo(Periodic):
    """DiLoCo's outer loop on a fixed list of arrays (docs/algorithm.md section 12).

    Call :meth:`step` on every rank after every inner step. At steps t with
    ``t % sync_interval == 0`` (with ``delta``, ``momentum`` and ``anchor`` fused buffers)::

        delta    = mean over ranks of (anchor - x)        # one allreduce, in value_dtype
        momentum = outer_momentum * momentum + delta
        anchor   = anchor - outer_lr * (delta + outer_momentum * momentum)   # Nesterov
        x        = anchor                                 # on every rank

    Args:
        transport: a transport (MPITransport, NCCLTransport, TorchTransport), or None for one
            process.
        x: this rank's parameters: a list of arrays of one float dtype, or one fused 1-D
            buffer. They are overwritten with rank 0's at construction (collective).
        sync_interval: H, the number of inner steps between outer steps (default 50; the
            paper's 500 suits runs of tens of thousands of steps, see section 12).
        outer_lr: the outer learning rate (default 0.7, the paper's).
        outer_momentum: the outer Nesterov momentum in [0, 1) (default 0.9, the paper's).
        value_dtype: dtype of the averaged pseudo-gradient: None (x's dtype), 'float32' or
            'float16' (half the bytes; each rank's delta is rounded to float16 and the mean
            is summed in float16).
        names: tensor names for error messages. bucket_bytes: see :class:`Communicator`.

    Attributes: ``anchor`` and ``momentum`` (fused, x's dtype, equal on every rank), ``t`` (inner
    steps taken), ``stats`` (the bytes, as :class:`~slamb_comm.Stats`), ``comm``.
    """

    kind = "DiLoCo"

    def __init__(self, transport, x, *, sync_interval=DEFAULT_INTERVAL, outer_lr=0.7, outer_momentum=0.9,
                 value_dtype=None, names=None, bucket_bytes=32 << 20):
        def check():
            self.sync_interval = check_interval("sync_interval", sync_interval,
                                                f"the paper uses 500, this library's default is {DEFAULT_INTERVAL}")
            self.outer_lr = check_number("outer_lr", outer_lr, lambda v: v > 0, "a finite number > 0",
                                          "the paper uses 0.7 (1 with outer_momentum=0 is plain averaging)")
            self.outer_momentum = check_number("outer_momentum", outer_momentum, lambda v: 0 <= v < 1,
                                                "a number in [0, 1)", "the paper uses 0.9; 0 gives plain outer SGD")

        def options():
            return {"sync_interval": self.sync_interval, "outer_lr": self.outer_lr,
                    "outer_momentum": self.outer_momentum}

        xp, views, flat = self.setup(transport, x, names, options, check, value_dtype, bucket_bytes)
        with _arr.device_scope(views[0]):
            self.anchor = flat.copy() if flat is not None else xp.concatenate(views)
            self.momentum = xp.zeros_like(self.anchor)

    def due(self):
        """Whether the next :meth:`step` is an outer step (it then needs x)."""
        return (self.t + 1) % self.sync_interval == 0

    def step(self, x=None):
        """Count one inner step; at an outer step (see :meth:`due`) average and apply it to ``x``
        in place. Returns True at an outer step. Collective at outer steps: every rank calls it.

        Raises (on every rank, nothing changed but the count): NonFiniteError if some rank's
        delta is not finite (or not finite in float16); PeerError / LayoutError for bad input.
        """
        self.t += 1
        if self.t % self.sync_interval:
            return False
        xp, views, flat = self.take(x)
        lay, a, b = self.layout, self.anchor, self.momentum
        with _arr.device_scope(a):
            if flat is not None:
                d = a - flat
            else:
                d = xp.concatenate(views)
                xp.subtract(a, d, out=d)
            payload = d if self.value_dtype == d.dtype else _arr.cast(d, self.value_dtype)
            self.comm.sync(payload)  # the mean over ranks, in place; raises with nothing changed
            if payload is not d:
                _arr.cast_into(d, payload)
            mu, lr = a.dtype.type(self.outer_momentum), a.dtype.type(self.outer_lr)
            b *= mu
            b += d
            if mu:
                d += mu * b
            d *= lr
            a -= d
            if flat is not None:
                flat[...] = a
            else:
                for v, o, n in zip(views, lay.offsets, lay.sizes):
                    v[...] = a[o : o + n]
        return True

    def state_dict(self):
        """The step count, anchor and outer momentum (host copies; equal on every rank)."""
        return dict(self.base_state(), anchor=host_copy(self.anchor), momentum=host_copy(self.momentum))

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly (onto the device of the current anchor). The
        options are this object's; x is the caller's to restore."""
        self.load_arrays(state, ("anchor", "momentum"))


class DesLoc(Periodic):
    """DES-LOC's averaging on a fixed list of arrays (docs/algorithm.md section 12).

    Call :meth:`step` on every rank after every inner (Adam-family) step, with the parameters
    x and the inner optimizer's first and second moments m and v (arrays shaped like x). At
    step t, each is replaced in place by its mean over ranks when its period divides t::

        x = mean over ranks of x   if t % sync_interval == 0
        m = mean over ranks of m   if t % moment1_interval == 0
        v = mean over ranks of v   if t % moment2_interval == 0

    Args:
        transport, x, names, bucket_bytes: as :class:`DiLoCo` (x is broadcast from rank 0).
        sync_interval: Kx, the parameters' period (default 50).
        moment1_interval: Ku, the first moment's period (default ``3 * sync_interval``).
        moment2_interval: Kv, the second moment's period (default ``6 * sync_interval``).
    """

    kind = "DES-LOC"

    def __init__(self, transport, x, *, sync_interval=DEFAULT_INTERVAL, moment1_interval=None, moment2_interval=None,
                 names=None, bucket_bytes=32 << 20):
        def check():
            self.sync_interval = check_interval("sync_interval", sync_interval,
                                                f"the parameters' period; default {DEFAULT_INTERVAL}")
            self.moment1_interval = check_interval(
                "moment1_interval", 3 * self.sync_interval if moment1_interval is None else moment1_interval,
                "the first moment's period; default 3 * sync_interval (the paper's recommendation)")
            self.moment2_interval = check_interval(
                "moment2_interval", 6 * self.sync_interval if moment2_interval is None else moment2_interval,
                "the second moment's period; default 6 * sync_interval (the paper's recommendation)")

        def options():
            return {"sync_interval": self.sync_interval, "moment1_interval": self.moment1_interval,
                    "moment2_interval": self.moment2_interval}

        self.setup(transport, x, names, options, check, None, bucket_bytes)

    def due(self):
        """What the next :meth:`step` averages: a tuple of 'x', 'm', 'v' (empty: nothing)."""
        t = self.t + 1
        return tuple(n for n, h in (("x", self.sync_interval), ("m", self.moment1_interval),
                                    ("v", self.moment2_interval)) if t % h == 0)

    def step(self, x=None, m=None, v=None):
        """Count one inner step and average, in place, what is due (see :meth:`due`); returns
        the tuple of what was averaged. Collective when something is due."""
        due = self.due()
        self.t += 1
        for name, arrs in (("x", x), ("m", m), ("v", v)):
            if name in due:
                self.take(arrs, name)
                self.comm.sync(arrs)
        return due

    def state_dict(self):
        """The step count and options (DES-LOC keeps no state of its own beyond the inner optimizer's)."""
        return self.base_state()

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output (the options are this object's)."""
        self.t = self.load_base(state)
