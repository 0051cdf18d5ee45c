"""The SLAMB update rule on fused flat buffers (ALGORITHM.md section 1).

:class:`Slamb` owns the optimizer state of one fused buffer of parameters -- momentum
``m`` and second moment ``v``, each one flat array -- and does one step:

1. local moments ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2`` (v is never sent);
2. ``m[M_t] = mean over ranks`` -- one masked allreduce through the communicator;
3. freshness ``f = b3 f; f[M_t] = 1``;
4. Adam direction ``u = mhat / (sqrt(vhat) + eps) + wd x``;
5. per tensor, trust ratios ``phi_S`` over the fresh elements and ``phi_A`` over the stale ones;
6. ``x -= (lr phi_S f + lr / sqrt(P) phi_A (1 - f)) u``;
7. after steps 1, H+1, 2H+1, ...: ``x = mean over ranks of x`` (bucketed allreduces).

What it costs (N parameters, fp32):

* **Memory**: m and v (8 bytes per parameter, as AdamW). The freshness is *derived* for the
  default cyclic mask -- every element's steps since its last synchronisation follow from
  the mask's schedule -- so it takes no memory; the bernoulli and topk masks store it (4
  more bytes). Scratch is the direction u of one tensor at a time plus, per step, the
  |M_t| exchanged values; nothing else grows with N.
* **Failure without a second copy of the state**: before the exchange only the M_t entries
  of the new momentum are computed (into the payload) and the gradients checked; m and v
  are updated in place only after every rank's status came back good. A step that fails
  (a NaN on any rank, a bad input) leaves m, v, x and the step count as they were.
* **Host synchronisations on a GPU**: one per step (the exchange's status), one more on
  periodic-sync steps, one more for the topk mask's union; none per tensor. Trust ratios
  stay on the device.
* **Time on the CPU**: cache-sized blocks; the moments, the direction and the norms in one
  pass over each tensor, the update in a second.

Tuning guide (from the paper and ALGORITHM.md section 5):

* ``ratio`` (k, on the communicator): the fraction of the momentum exchanged per step.
  0.1 is the paper's default; the bytes per step are about ``k + 1/H`` of dense LAMB's,
  plus the always-dense small and 1-D tensors. With ``value_dtype='float16'`` halve that.
  It can change between steps (:meth:`Slamb.set_ratio`): the reference's CIFAR-10 runs
  start denser (0.5, 0.5, 0.2, then 0.1, one value per epoch).
* ``beta3``: how fast a stale element's step slides from the large-batch rate ``lr`` to the
  small-batch rate ``lr / sqrt(P)``. The reference code uses 0.99, the BERT runs 0.93; at
  short budgets 0.9 did best in our simulation. Sweep it together with ``lr``.
* ``sync_interval`` (H): full parameter averaging every H steps bounds replica drift.
  100 in the paper. ``H = 1`` averages after every step.
* ``mask`` (on the communicator): 'cyclic' bounds staleness by ``ceil(1/k)`` steps and
  needs no freshness memory; use it.

Non-finite gradients: a gradient with a NaN or Inf, or one whose square would overflow the
second moment (``|g| >= sqrt(max)`` of the dtype), makes the step fail on every rank. With
``on_nonfinite='skip'`` (default, like AMP's grad scaler) every rank skips it, logs it
(logger ``slamb_comm``) with the ranks and tensor names, and counts it in
:attr:`Slamb.skipped_steps`; with ``'raise'`` every rank raises
:class:`~slamb_comm.errors.NonFiniteError`. Either way nothing changes.
"""

import logging
import math

import numpy as np

from . import arrays as _arr
from .errors import ConfigError, LayoutError, NonFiniteError
from .codecs import per_tensor
from .masks import BLOCK
from .stats import Traffic, allreduce_wire

__all__ = ["Slamb"]

log = logging.getLogger("slamb_comm")


class Slamb:
    """SLAMB's optimizer state and update for the fused buffer described by ``comm.layout``.

    Args:
        comm: a :class:`~slamb_comm.Communicator` built on the parameters; its ``ratio``,
            ``mask``, ``value_dtype``, ``dense_threshold`` and seed are SLAMB's sparsity knobs.
        lr: learning rate, a float or one per tensor.
        betas: ``(beta1, beta2)`` of the moments.
        eps: added to ``sqrt(vhat)``.
        weight_decay: decoupled weight decay inside the direction ``u``; float or one per tensor.
        beta3: freshness decay in [0, 1).
        sync_interval: H >= 1; parameters are averaged after steps with ``(t - 1) % H == 0``.
        c_min, c_max: clamp of the trust ratios.
        on_nonfinite: 'skip' (default) or 'raise', for a step with NaN/Inf on any rank.
        check_options: check at construction (collectively) that every rank has the same
            options above; a ConfigError on every rank names the ranks that differ. A caller
            whose options are unified later (Horovod's ``broadcast_optimizer_state``) passes
            False and calls :meth:`agree_options` before the first step instead.

    One whole step is :meth:`step`. For overlapping communication with the backward
    pass it is also offered in pieces: :meth:`begin_step`; :meth:`accumulate` per tensor as
    its gradient arrives (it writes that tensor's share of the payload, possibly into the
    caller's own buffer); :meth:`exchange` (or the caller's own averaging of those buffers);
    then :meth:`apply` with the gradients again and the averaged values.
    """

    def __init__(
        self,
        comm,
        *,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        beta3=0.99,
        sync_interval=100,
        c_min=0.01,
        c_max=1000.0,
        on_nonfinite="skip",
        check_options=True,
    ):
        self.comm = comm
        self.layout = comm.layout
        if self.layout.dtype == np.float16:
            raise ConfigError(
                "Slamb keeps its state in the parameters' dtype, and float16 is too coarse for moments: "
                "keep a float32 master copy of float16 parameters and build the communicator on it "
                "(the Horovod adapter does this for float16 and bfloat16 parameters)"
            )
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"betas must be in [0, 1), got {betas}")
        if not (0.0 <= float(beta3) < 1.0):
            raise ConfigError(f"beta3 must be in [0, 1), got {beta3}")
        if int(sync_interval) < 1:
            raise ConfigError(f"sync_interval must be >= 1, got {sync_interval}")
        if not (0.0 < float(c_min) <= float(c_max)):
            raise ConfigError(f"need 0 < c_min <= c_max, got {c_min}, {c_max}")
        if float(eps) < 0:
            raise ConfigError(f"eps must be >= 0, got {eps}")
        self.betas = (b1, b2)
        self.eps = float(eps)
        self.beta3 = float(beta3)
        self.sync_interval = int(sync_interval)
        self.c_min, self.c_max = float(c_min), float(c_max)
        self.lr = self._per_tensor(lr, "lr")
        self.weight_decay = self._per_tensor(weight_decay, "weight_decay")
        if on_nonfinite not in ("skip", "raise"):
            raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0  # steps skipped for non-finite values (on every rank alike)
        if check_options:
            self.agree_options()
        self.derived = comm.mask.kind == "cyclic"  # freshness follows from the mask's schedule
        self.t = 0  # steps committed
        self._t_open = None  # the step in progress, between begin_step and apply
        self._xp = None
        self.m = self.v = None
        self._f = None  # stored freshness (bernoulli and topk masks only)
        # Cyclic mask: stored freshness of the tensors that once skipped a step (no gradient on any
        # rank), whose freshness then no longer follows the schedule. Empty unless that happens.
        self._fx = {}
        self._host = None  # state restored by load_state_dict, moved to the device on first use
        self._scratch = {}

    def agree_options(self, lr=None, weight_decay=None):
        """Collective: every rank must have the same options (else ConfigError everywhere).
        ``lr`` and ``weight_decay``, if given, are the values the next step will use."""
        lr = self.lr if lr is None else self._per_tensor(lr, "lr")
        weight_decay = self.weight_decay if weight_decay is None else self._per_tensor(weight_decay, "weight_decay")
        opts = (self.betas, self.eps, self.beta3, self.sync_interval, self.c_min, self.c_max, lr,
                weight_decay, self.on_nonfinite)
        mine = np.frombuffer(self.layout.digest(*opts), dtype=np.int64).copy()
        t = self.comm.transport
        everyone = np.zeros(2 * t.size, dtype=np.int64)
        t.allgather(mine, everyone)
        everyone = everyone.reshape(t.size, 2)
        differ = [r for r in range(t.size) if not np.array_equal(everyone[r], everyone[0])]
        if differ:
            raise ConfigError(
                f"SLAMB options differ between ranks: rank(s) {differ} differ from rank 0; this is rank {t.rank} "
                f"with betas={self.betas}, eps={self.eps}, beta3={self.beta3}, sync_interval={self.sync_interval}, "
                f"c_min={self.c_min}, c_max={self.c_max}, lr={lr[:3]}..., weight_decay={weight_decay[:3]}..., "
                f"on_nonfinite={self.on_nonfinite!r}"
            )

    def _per_tensor(self, value, name):
        n = len(self.layout)
        if np.isscalar(value):
            vals = [float(value)] * n
        else:
            vals = [float(v) for v in value]
            if len(vals) != n:
                raise ConfigError(f"{name}: {len(vals)} values for {n} tensors")
        if any(v < 0 or not math.isfinite(v) for v in vals):
            raise ConfigError(f"{name} must be finite and >= 0, got {value}")
        return vals

    # ------------------------------------------------------------------ state
    @property
    def xp(self):
        """``numpy`` or ``cupy``: where the state lives (``None`` before the first step)."""
        return self._xp

    def _ensure_state(self, xp, like):
        if self._xp is None:
            n, dt = self.layout.total, self.layout.dtype
            with _arr.device_scope(like):
                host = self._host or {}
                self.m = xp.asarray(host["m"]) if "m" in host else xp.zeros(n, dt)
                self.v = xp.asarray(host["v"]) if "v" in host else xp.zeros(n, dt)
                if not self.derived:
                    self._f = xp.asarray(host["f"]) if "f" in host else xp.ones(n, dt)
                self._fx = {i: xp.asarray(a) for i, a in host.get("fx", {}).items()}
            self._host = None
            self._xp = xp
        elif self._xp is not xp:
            raise TypeError(f"SLAMB state lives in {self._xp.__name__}, got {xp.__name__} arrays")

    def place(self, like):
        """Allocate the state now (zeros, or what :meth:`load_state_dict` restored) in the library
        and on the device of the array ``like``, instead of at the first step."""
        like = _arr.as_array(like)
        self._ensure_state(_arr.namespace(like), like)

    def _buf(self, xp, name, n, dtype):
        """A reusable scratch array of at least ``n`` elements (first ``n`` returned)."""
        a = self._scratch.get(name)
        if a is None or a.size < n or a.dtype != dtype or _arr.namespace(a) is not xp:
            a = self._scratch[name] = xp.empty(n, dtype)
        return a[:n]

    def freshness(self, i=None):
        """The freshness f after the last committed step: of tensor ``i`` (shaped like it), or of
        the fused buffer (``i=None``); a host array. Derived from the mask's schedule for the
        cyclic mask (built here, O(size)); a copy of the stored state otherwise."""
        lay = self.layout
        idx = range(len(lay)) if i is None else [i]
        parts = []
        for k in idx:
            n = lay.sizes[k]
            fx = self._host.get("fx", {}) if self._host is not None else self._fx
            if self.derived and k in fx:
                parts.append(_arr.to_host(fx[k]).copy())
                continue
            if not self.derived:
                f = self._host["f"] if self._host is not None and "f" in self._host else self._f
                parts.append(np.ones(n, lay.dtype) if f is None else
                             _arr.to_host(f[lay.offsets[k] : lay.offsets[k] + n]).copy())
                continue
            mask = self.comm.mask
            if k not in mask._geo:
                parts.append(np.ones(n, lay.dtype))
                continue
            parts.append(mask.freshness(k, self.t, self.beta3, 0, n).astype(lay.dtype))
        if i is not None:
            return parts[0].reshape(lay.shapes[i])
        return np.concatenate(parts) if parts else np.zeros(0, lay.dtype)

    def stored_freshness(self, i):
        """Tensor ``i``'s stored freshness (a live 1-D view), or None where it is derived from the
        cyclic mask's schedule."""
        if not self.derived:
            o, n = self.layout.offsets[i], self.layout.sizes[i]
            return None if self._f is None else self._f[o : o + n]
        return self._fx.get(i)

    def keep_freshness(self, i, f):
        """Store tensor ``i``'s freshness ``f`` (cyclic mask: for a tensor whose freshness left the
        schedule because it once skipped a step; used when such a state is restored)."""
        if not self.derived:
            raise RuntimeError("only the cyclic mask derives freshness; the others store all of it")
        if self._xp is None:
            raise RuntimeError("place() the state first")
        host = np.array(_arr.to_host(_arr.as_array(f)), dtype=self.layout.dtype).reshape(-1)
        self._fx[i] = self._xp.asarray(host)

    def set_ratio(self, ratio):
        """Change k to ``ratio`` from the next step on (between steps, on every rank alike:
        collective, see :meth:`slamb_comm.Communicator.set_ratio`). The moments and every
        element's freshness carry over; with the cyclic mask the new ratio's permutation starts
        at the next step, so each element is synchronised within ``ceil(1/ratio)`` steps of the
        change, and no freshness is stored for it (it is derived from the two masks until the
        new one's first cycle is complete)."""
        problem = None if self._t_open is None else RuntimeError(
            f"step {self._t_open} is open: change the ratio between steps")
        self.comm.set_ratio(ratio, self.t, problem=problem)

    def state_dict(self):
        """This rank's state: step, m, v, f (host copies; f derived where the mask allows) and
        the communicator's state."""
        src = self._host if self._host is not None else {"m": self.m, "v": self.v}
        host = (lambda a: None if a is None else _arr.to_host(a).copy())
        have = src.get("m") is not None
        return {
            "step": self.t,
            "m": host(src.get("m")),
            "v": host(src.get("v")),
            "f": self.freshness() if have else None,
            "skipped": sorted((self._host or {}).get("fx", {}) if self._host is not None else self._fx),
            "comm": self.comm.state_dict(),
        }

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly. The state stays on the host until the next
        step, which moves it to the device of that step's arrays (so a GPU run resumes on the
        GPU). For the cyclic mask the saved freshness is not needed (it is derived)."""
        if self._t_open is not None:
            raise RuntimeError("cannot load state in the middle of a step")
        self.comm.load_state_dict(state["comm"])
        self.t = int(state["step"])
        self._xp = None
        self.m = self.v = self._f = None
        self._fx = {}
        self._scratch = {}
        if state["m"] is None:
            self._host = None
            return
        dt, n = self.layout.dtype, self.layout.total
        keys = ("m", "v") if self.derived else ("m", "v", "f")
        for k in keys:
            if np.shape(state[k]) != (n,):
                raise LayoutError(f"saved {k} has shape {np.shape(state[k])}, expected ({n},)")
        self._host = {k: np.array(_arr.to_host(state[k]), dtype=dt, copy=True) for k in keys}
        if self.derived and state.get("skipped"):  # tensors whose freshness left the schedule
            f = _arr.to_host(state["f"])
            lay = self.layout
            self._host["fx"] = {int(i): np.array(f[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]], dtype=dt)
                                for i in state["skipped"]}

    # ------------------------------------------------------------------ pieces
    def begin_step(self):
        """Open step ``t + 1`` and return it."""
        if self._t_open is not None:
            raise RuntimeError(f"step {self._t_open} is still open: call apply() (or abort_step()) first")
        t = self._t_open = self.t + 1
        self._bad_tensors = {}
        self._payload = None
        self._picks = {}
        self._rot = {}
        self._local = {}
        kind = self.comm.mask.kind
        if kind == "topk":
            self._counts = None
        else:
            self._counts = [self.comm.mask.count(t, i) for i in range(len(self.layout))]
            self._starts = _starts(self._counts)
        return t

    def abort_step(self):
        """Abandon the open step: nothing it computed is kept."""
        self._t_open = None
        self._payload = None
        self._picks = {}
        self._rot = {}
        self._local = {}

    def _open(self):
        if self._t_open is None:
            raise RuntimeError("no step is open: call begin_step() first")
        return self._t_open

    def counts(self):
        """Per tensor, the number of its elements in M_t of the open step (the payload layout;
        not known before :meth:`exchange` for the topk mask)."""
        self._open()
        if self._counts is None:
            raise RuntimeError("the topk mask's counts are known only after exchange()")
        return list(self._counts)

    def picks(self, i, xp=np):
        """M_t of the open step within tensor ``i`` (a :class:`~slamb_comm.masks.Picks`)."""
        t = self._open()
        p = self._picks.get(i)
        if p is None:
            mask = self.comm.mask
            if mask.kind == "topk":
                raise RuntimeError("the topk mask's picks are known only after exchange()")
            if mask.kind == "cyclic":
                # the rotations (one byte per group of C units) are hashed once per step and kept
                # until the commit; the positions are derived from them at each use
                if i not in self._rot:
                    self._rot[i] = mask.rotations(i, xp)
                return mask.picks(t, i, xp, self._rot[i])
            p = self._picks[i] = mask.picks(t, i, xp)  # bernoulli: drawn once per step
        return p

    def _limit(self, xp):
        return BLOCK if xp is np else None

    def _check(self, xp, g):
        """Whether the gradient (a range of it) is bad: a NaN or Inf, or a sum of squares that
        overflows (so would v). A host bool on the CPU, a 0-d device array on a GPU."""
        if g.size == 0:
            return False
        sq = xp.dot(g, g)  # one BLAS pass: NaN and Inf survive it
        return not bool(np.isfinite(sq)) if xp is np else ~xp.isfinite(sq)

    def accumulate(self, i, g_i, out=None):
        """Take tensor ``i``'s gradient for the open step (nothing is committed yet).

        Writes this rank's new momentum on M_t of tensor ``i`` (``b1 m + (1-b1) g`` at the
        picked positions, in payload order) into ``out`` (an array of ``counts()[i]``
        elements, any float dtype, e.g. the caller's own allreduce buffer) or into the
        step's payload. For the topk mask it picks the tensor's top-k instead (the payload
        follows in :meth:`exchange`). Returns whether this gradient is bad (a bool on the
        CPU, a 0-d array on a GPU): NaN/Inf, or too large for v.
        """
        self._open()
        lay = self.layout
        g = _arr.as_array(g_i)
        xp = _arr.namespace(g)
        n = lay.sizes[i]
        if g.size != n:
            raise LayoutError(f"gradient of tensor {lay.names[i]!r} has {g.size} elements, expected {n}")
        g = g.reshape(-1)
        with _arr.device_scope(g):
            self._ensure_state(xp, g)
            o = lay.offsets[i]
            m = self.m[o : o + n]
            if self.comm.mask.kind == "topk":
                bad = self._check(xp, g)
                if i in lay.compressible:
                    mn = self._buf(xp, "u", n, lay.dtype)
                    self._moment1(xp, m, g, mn)
                    self._local[i] = self.comm.mask.pick(i, mn)
            else:
                picks = self.picks(i, xp)
                if out is None:
                    if self._payload is None:
                        self._payload = xp.empty(self._starts[-1] + 1, self.comm.value_dtype)
                    s = self._starts[i]
                    out = self._payload[s : s + picks.count]
                bad = self._gather(xp, picks, m, g, out, check=True)
        self._bad_tensors[i] = bad
        return bad

    def _moment1(self, xp, m, g, out):
        """``out = b1 m + (1-b1) g`` (the new momentum, not committed), blocked on the CPU."""
        b1 = self.betas[0]
        dt = self.layout.dtype.type
        lim = self._limit(xp) or m.size
        for lo in range(0, m.size, lim):
            hi = min(lo + lim, m.size)
            o = out[lo:hi]
            xp.multiply(m[lo:hi], dt(b1), out=o)
            tmp = self._buf(xp, "tmp", hi - lo, self.layout.dtype)
            xp.multiply(g[lo:hi], dt(1.0 - b1), out=tmp)
            o += tmp

    def _gather(self, xp, picks, m, g, out, check=False):
        """``out = b1 m[M_t] + (1 - b1) g[M_t]`` for one tensor, in payload order, in the same
        blocked pass as the gradient's check (``check``: return whether it is bad)."""
        dt = self.layout.dtype
        b1, c1 = dt.type(self.betas[0]), dt.type(1.0 - self.betas[0])
        bad = False
        for r in picks.ranges(self._limit(xp)):
            if check:
                gb = g[r[0] : r[1]]
                bad = (bad or self._check(xp, gb)) if xp is np else (bad | self._check(xp, gb))
            a, b = picks.span(r)
            if b == a:
                continue
            tm = picks.take(m, r, self._buf(xp, "ta", b - a, dt))
            tg = picks.take(g, r, self._buf(xp, "tb", b - a, dt))
            tm *= b1
            tg *= c1
            tm += tg
            out[a:b] = tm
        return bad

    def exchange(self, grads=None):
        """The momentum exchange of the open step: one allreduce of the payload (every tensor's
        M_t entries and a status word) and one host read. For the topk mask it first forms the
        union of the ranks' picks (one more host read) and gathers the payload from ``grads``
        (the same gradients as given to :meth:`accumulate`).

        Raises NonFiniteError on every rank if any rank's gradients are bad; the step is then
        aborted and no state changes.
        """
        t = self._open()
        xp = self._xp or np
        with _arr.device_scope(self.m if self.m is not None else np.zeros(0)):
            self._exchange(t, xp, grads)

    def _exchange(self, t, xp, grads):
        lay, comm = self.layout, self.comm
        try:
            if comm.mask.kind == "topk":
                sel = comm.mask.union(xp, self._local, comm.transport)
                self._picks = dict(enumerate(sel.picks))
                self._counts, self._starts = sel.counts, _starts(sel.counts)
                self._payload = xp.empty(self._starts[-1] + 1, comm.value_dtype)
                gv = _views(lay, grads)
                for i, (p, s, c) in enumerate(zip(sel.picks, sel.starts, sel.counts)):
                    o = lay.offsets[i]
                    self._gather(xp, p, self.m[o : o + lay.sizes[i]], gv[i], self._payload[s : s + c])
            elif self._payload is None:
                self._payload = xp.zeros(self._starts[-1] + 1, comm.value_dtype)  # no tensor accumulated
            buf = self._payload
            bad = False  # any tensor's gradient bad (the latest accumulate of each tensor counts)
            for b in self._bad_tensors.values():
                bad = (bad or bool(b)) if xp is np else (bad | b)
            comm.reduce_checked(buf, None, bad, f"SLAMB momentum exchange at step {t}",
                                spans=(self._starts[:-1], self._counts))
        except NonFiniteError as e:
            names = [lay.names[i] for i, b in self._bad_tensors.items() if bool(b)]
            self.abort_step()
            if not names:
                raise
            raise NonFiniteError(f"{e} (this rank: non-finite gradient in {names})", e.ranks, names) from None
        except Exception:
            self.abort_step()
            raise
        payload = buf.size * buf.dtype.itemsize
        dense = lay.total * lay.dtype.itemsize
        comm.stats.record("masked_allreduce", Traffic(
            1, payload, allreduce_wire(payload, comm.size), dense, allreduce_wire(dense, comm.size),
            buf.size - 1, lay.total))

    def apply(self, x, grads, means=None, lr=None, weight_decay=None, written=None, skip=()):
        """Finish the open step on parameters ``x`` (in place) with the gradients ``grads``.

        ``x`` and ``grads``: fused buffers, lists of arrays shaped like the layout, or lazily
        read sequences (see :meth:`slamb_comm.Communicator._take`). ``means``: per tensor, the
        averaged payload of :meth:`accumulate` (when the caller did its own averaging), or
        ``None`` after :meth:`exchange`. Commits the moments, then per tensor the direction,
        the trust ratios and the update; then the periodic sync after steps with
        ``(t - 1) % H == 0``. ``written(i)`` is called once tensor i of ``x`` is final.

        ``skip``: tensors that had no gradient on any rank at this step (the caller's agreement).
        They are left exactly as they are (ALGORITHM.md section 1, "Parameters without a
        gradient"): no moment decay, no update, freshness unchanged. With the cyclic mask such
        a tensor's freshness is stored from then on (4 bytes per element of that tensor), since
        it no longer follows the schedule.
        """
        t = self._open()
        lay, comm = self.layout, self.comm
        lr = self.lr if lr is None else self._per_tensor(lr, "lr")
        wd = self.weight_decay if weight_decay is None else self._per_tensor(weight_decay, "weight_decay")
        xv, gv = _views(lay, x), _views(lay, grads)
        if means is None:
            if self._payload is None:
                raise RuntimeError("no exchanged values: call exchange() or pass means=")
            buf = self._payload
            means = [buf[s : s + c] for s, c in zip(self._starts, self._counts)]
            scale = 1.0 / comm.size
        else:
            if len(means) != len(lay):
                raise LayoutError(f"got {len(means)} exchanged arrays, expected {len(lay)}")
            means = [_arr.as_array(a).reshape(-1) for a in means]
            scale = 1.0
        P = comm.size
        b1, b2 = self.betas
        F = None
        if self.derived:
            F = [self.beta3 ** s for s in comm.mask.staleness(t)]
        xp = None
        sync = (t - 1) % self.sync_interval == 0 and P > 1
        finite = True  # of the updated parameters, checked in the update's own pass on sync steps
        for i in range(len(lay)):
            n = lay.sizes[i]
            if n == 0:
                if written is not None:
                    written(i)
                continue
            xi, gi = xv[i], gv[i]
            if xp is None:
                xp = _arr.namespace(xi)
                self._ensure_state(xp, xi)
            if xi.dtype != lay.dtype or xi.size != n:
                raise LayoutError(f"parameter {lay.names[i]!r}: {xi.size} {xi.dtype.name}, "
                                  f"expected {n} {lay.dtype.name}")
            if i in skip:
                if self.derived and i not in self._fx:  # keep f as it was after step t - 1
                    with _arr.device_scope(xi):
                        self._fx[i] = xp.asarray(self.freshness(i).reshape(-1))
                if written is not None:
                    written(i)
                continue
            with _arr.device_scope(xi):
                fin = self._tensor(xp, i, xi, gi, means[i], scale, t, lr[i], wd[i], F, sync)
            if sync:
                finite = (finite and bool(fin)) if xp is np else (finite & fin)
            if written is not None:
                written(i)
        # Commit the step count before the sync, which may raise (then on every rank alike).
        self.t = t
        self._t_open = None
        self._payload = None
        self._picks = {}
        self._rot = {}
        self._local = {}
        if sync:
            comm.sync(x, written=written, finite=finite)
        return x

    def _tensor(self, xp, i, x, g, mean, scale, t, lr, wd, F, check=False):
        """Commit tensor i's moments and update its parameters, in two blocked passes.

        The direction is kept as ``w = m / (sqrt(v) + eps sqrt(1-b2^t)) + (wd / s) x`` with
        ``u = s w`` and ``s = sqrt(1-b2^t) / (1-b1^t)``: the same u as the formula (exact
        algebra, two fewer passes); s enters the trust ratios' norms and the update's
        coefficients instead. With ``check``, returns whether the updated tensor is finite
        (its squared norm, from the update's pass)."""
        lay = self.layout
        o, n = lay.offsets[i], lay.sizes[i]
        dtype = lay.dtype
        dt = dtype.type
        m, v = self.m[o : o + n], self.v[o : o + n]
        f = self._fx.get(i) if self.derived else self._f[o : o + n]
        b1, b2 = self.betas
        picks = self.picks(i, xp)
        everything = picks.kind == "all"
        ranges = picks.ranges(self._limit(xp))
        w = self._buf(xp, "u", n, dtype)
        block = max(r[1] - r[0] for r in ranges)
        tmp_all = self._buf(xp, "tmp", block, dtype)
        wide = np.promote_types(mean.dtype, dtype)
        s_u = math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        c_b1, c_1b1, c_b2, c_1b2 = dt(b1), dt(1.0 - b1), dt(b2), dt(1.0 - b2)
        c_eps, c_wd = dt(self.eps * math.sqrt(1.0 - b2**t)), dt(wd / s_u)
        c_b3 = dt(self.beta3)
        mul, add, sqrt, divide = xp.multiply, xp.add, xp.sqrt, xp.divide
        xx = ww = xs = ws = 0.0
        # Pass 1: moments (in place: the exchange succeeded), M_t's means, freshness, w, norms.
        for r in ranges:
            lo, hi = r[0], r[1]
            mb, vb, gb, xb, wb = m[lo:hi], v[lo:hi], g[lo:hi], x[lo:hi], w[lo:hi]
            tmp = tmp_all[: hi - lo]
            mul(gb, c_1b1, out=tmp)
            mb *= c_b1
            mb += tmp
            mul(gb, gb, out=tmp)
            tmp *= c_1b2
            vb *= c_b2
            vb += tmp
            a, b = picks.span(r)
            if b > a:
                vals = mean[a:b].astype(wide, copy=True)
                if scale != 1.0:
                    vals *= vals.dtype.type(scale)
                picks.put(m, r, vals)
            if f is not None and not everything:
                f[lo:hi] *= c_b3
                picks.put(f, r, 1)
            sqrt(vb, out=wb)
            wb += c_eps
            divide(mb, wb, out=wb)
            if wd:
                mul(xb, c_wd, out=tmp)
                add(wb, tmp, out=wb)
            xx = xx + _sumsq(xp, xb)
            ww = ww + _sumsq(xp, wb)
            if not everything and b > a:
                xs = xs + _sumsq(xp, picks.take(x, r, self._buf(xp, "ta", b - a, dtype)))
                ws = ws + _sumsq(xp, picks.take(w, r, self._buf(xp, "tb", b - a, dtype)))
        if everything:
            xs, ws = xx, ww
        s2 = s_u * s_u
        phi_s, phi_a = self._ratios(xp, (xx, ww * s2, xs, ws * s2))
        # Pass 2: x -= (lr phi_S f + lr / sqrt(P) phi_A (1 - f)) u, with u = s w
        P = self.comm.size
        rate_s, rate_a = lr * s_u * phi_s, lr * s_u / math.sqrt(P) * phi_a
        mask = self.comm.mask
        moving = f is None and not everything and not mask.settled(t)  # just after a ratio change
        if everything:
            coef = _scalar(xp, rate_s, dtype)
        elif moving:  # derived freshness from two masks: built per range (a few steps per change)
            pass
        elif f is None:  # derived freshness: a table of C coefficients, one per chunk
            if xp is np:
                table = np.array([rate_s * q + rate_a * (1.0 - q) for q in F], dtype)
            else:
                Fd = xp.asarray(np.asarray(F, np.float64))
                table = (rate_s * Fd + rate_a * (1.0 - Fd)).astype(dtype)
            table = xp.concatenate((table, table))
        else:
            cs, ca = _scalar(xp, rate_s, dtype), _scalar(xp, rate_a, dtype)
        finite = True
        for r in ranges:
            lo, hi = r[0], r[1]
            tmp = tmp_all[: hi - lo]
            if everything:
                mul(w[lo:hi], coef, out=tmp)
            elif moving:
                fr = mask.freshness(i, t, self.beta3, lo, hi, xp)
                fr *= rate_s - rate_a
                fr += rate_a
                mul(fr.astype(dtype), w[lo:hi], out=tmp)
            elif f is None:
                picks.scale(table, r, w[lo:hi], tmp)
            else:
                fb = f[lo:hi]
                tmp2 = self._buf(xp, "tmp2", hi - lo, dtype)
                mul(fb, cs, out=tmp)
                xp.subtract(dt(1), fb, out=tmp2)
                tmp2 *= ca
                tmp += tmp2
                tmp *= w[lo:hi]
            xb = x[lo:hi]
            xb -= tmp
            if check:
                sq = _sumsq(xp, xb)
                finite = (finite and math.isfinite(sq)) if xp is np else (finite & xp.isfinite(sq))
        return finite

    def _ratios(self, xp, sums):
        """``(phi_S, phi_A)`` from the four squared norms: host floats on the CPU, 0-d arrays
        on a GPU (no host read)."""
        xx, uu, xs, us = sums
        if xp is np:
            xa, ua = max(xx - xs, 0.0), max(uu - us, 0.0)
            return self._trust(math.sqrt(xs), math.sqrt(us)), self._trust(math.sqrt(xa), math.sqrt(ua))
        xa, ua = xp.maximum(xx - xs, 0.0), xp.maximum(uu - us, 0.0)
        return self._trust_xp(xp, xp.sqrt(xs), xp.sqrt(us)), self._trust_xp(xp, xp.sqrt(xa), xp.sqrt(ua))

    def _trust(self, xn, un):
        """``clamp(||x|| / ||u||, c_min, c_max)``, 1 where either norm is 0."""
        if xn > 0 and un > 0:
            return min(max(xn / un, self.c_min), self.c_max)
        return 1.0

    def _trust_xp(self, xp, xn, un):
        ok = (xn > 0) & (un > 0)
        ratio = xp.clip(xn / xp.where(ok, un, 1.0), self.c_min, self.c_max)
        return xp.where(ok, ratio, 1.0)

    def step(self, x, g, lr=None, weight_decay=None, written=None, skip=()):
        """One whole SLAMB step: ``x`` updated in place from this rank's gradient ``g``.

        ``x`` and ``g``: fused flat buffers or lists of arrays shaped like the layout (or lazily
        read sequences, with ``written`` as in :meth:`apply`). ``skip``: tensors without a
        gradient on every rank (the same on every rank; see :meth:`apply`); they still take
        part in the exchange with whatever ``g`` holds for them (zeros).
        """
        self.begin_step()
        try:
            gv = _views(self.layout, g)
            for i in range(len(self.layout)):
                self.accumulate(i, gv[i])
        except Exception:
            self.abort_step()
            raise
        try:
            self.exchange(g)
        except NonFiniteError as e:
            if self.on_nonfinite == "raise":
                raise
            self.skipped_steps += 1
            log.warning("slamb_comm: step %d skipped on every rank (%d skipped so far): %s",
                        self.t + 1, self.skipped_steps, e)
            return x
        return self.apply(x, g, lr=lr, weight_decay=weight_decay, written=written, skip=skip)


def _starts(counts):
    s = [0]
    for c in counts:
        s.append(s[-1] + c)
    return s


def _views(layout, x):
    """Per-tensor 1-D arrays of ``x``: a fused buffer, a list of arrays, or a lazy sequence."""
    if hasattr(x, "shape") or hasattr(x, "__dlpack__"):
        flat = _arr.as_array(x)
        if flat.shape != (layout.total,) or flat.dtype != layout.dtype:
            raise LayoutError(f"expected a fused buffer of {layout.total} {layout.dtype.name}, "
                              f"got {flat.shape} {flat.dtype.name}")
    elif len(x) != len(layout):
        raise LayoutError(f"got {len(x)} arrays, expected {len(layout)}")
    return per_tensor(layout, x)


def _sumsq(xp, a):
    """``sum(a * a)``: on the CPU BLAS's dot of one cache block (float32 blocks agree with a
    float64 sum to about 1e-7) summed over blocks in float64, a host float; on a GPU in
    float64, a 0-d array."""
    if xp is np:
        return float(np.dot(a, a))
    return xp.sum(xp.square(a, dtype=np.float64))


def _scalar(xp, value, dtype):
    """A coefficient as a scalar of ``dtype`` (host) or a 0-d array of it (device)."""
    if isinstance(value, float):
        return dtype.type(value)
    return value.astype(dtype)
