"""The SLAMB update rule on fused flat buffers (ALGORITHM.md section 1).

:class:`Slamb` owns the optimizer state of one fused buffer of parameters -- momentum
``m``, second moment ``v`` and freshness ``f``, each one flat array with per-tensor views
-- and does one step in a handful of vector operations:

1. local moments ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2`` (v is never sent);
2. ``m[M_t] = mean over ranks`` -- one masked allreduce through the communicator;
3. freshness ``f = b3 f; f[M_t] = 1``;
4. Adam direction ``u = mhat / (sqrt(vhat) + eps) + wd x``;
5. per tensor, trust ratios ``phi_S`` over the fresh elements and ``phi_A`` over the stale ones;
6. ``x -= (lr phi_S f + lr / sqrt(P) phi_A (1 - f)) u``;
7. after steps 1, H+1, 2H+1, ...: ``x = mean over ranks of x`` (one fused allreduce).

Tuning guide (from the paper and ALGORITHM.md section 5):

* ``ratio`` (k, on the communicator): the fraction of the momentum exchanged per step.
  0.1 is the paper's default; the bytes per step are about ``k + 1/H`` of dense LAMB's,
  plus the always-dense small and 1-D tensors. With ``value_dtype='float16'`` halve that.
* ``beta3``: how fast a stale element's step slides from the large-batch rate ``lr`` to the
  small-batch rate ``lr / sqrt(P)``. The reference code uses 0.99, the BERT runs 0.93; at
  short budgets 0.9 did best in our simulation. Sweep it together with ``lr``.
* ``sync_interval`` (H): full parameter averaging every H steps bounds replica drift.
  100 in the paper. ``H = 1`` averages after every step.
* ``mask`` (on the communicator): 'cyclic' bounds staleness by ``ceil(1/k)`` steps; use it.

State is double-buffered: a step computes the new moments beside the committed ones and
commits them only when the exchange succeeded, so a step that fails (a NaN on any rank,
a bad input) leaves ``m``, ``v``, ``f``, ``x`` and the step count exactly as they were, on
every rank. This costs one extra copy of ``m`` and ``v`` in memory.

Non-finite gradients: with ``on_nonfinite='skip'`` (default, like AMP's grad scaler) a
step whose new moments hold a NaN or Inf on any rank is skipped by every rank, logged
(logger ``slamb_comm``) with the ranks and tensor names, and counted in
:attr:`Slamb.skipped_steps`; with ``'raise'`` every rank raises
:class:`~slamb_comm.errors.NonFiniteError` instead. Either way nothing non-finite reaches
any rank's state.
"""

import logging
import math

import numpy as np

from . import arrays as _arr
from .errors import ConfigError, LayoutError, NonFiniteError

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

    Construction is collective: the ranks check that they agree on every option above
    (a ConfigError on every rank names the ranks that differ).

    One whole step is :meth:`step`. For overlapping communication with the backward
    pass it is also offered in pieces: :meth:`begin_step`, :meth:`accumulate` per tensor,
    :meth:`exchange` (or the caller's own exchange of :meth:`mask_positions` of
    :meth:`momentum_views`), then :meth:`apply`.
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
        self._agree_options()
        self.t = 0  # steps committed
        self._t_open = None  # the step in progress, between begin_step and apply
        self._xp = None
        self.m = self.v = self.f = None
        self._m_next = self._v_next = None
        self._sel = None  # M_t of the step in progress (a Selection of the fused buffer)
        self._pos = None  # per-tensor positions of M_t

    def _agree_options(self):
        """Collective: every rank must have the same options (else ConfigError everywhere)."""
        opts = (self.betas, self.eps, self.beta3, self.sync_interval, self.c_min, self.c_max, self.lr,
                self.weight_decay, self.on_nonfinite)
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
                f"c_min={self.c_min}, c_max={self.c_max}, lr={self.lr[:3]}..., weight_decay={self.weight_decay[:3]}..., "
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

    def _ensure_state(self, xp):
        if self._xp is None:
            n, dt = self.layout.total, self.layout.dtype
            self._xp = xp
            self.m, self.v = xp.zeros(n, dt), xp.zeros(n, dt)
            self.f = xp.ones(n, dt)
            self._m_next, self._v_next = xp.empty(n, dt), xp.empty(n, dt)
            self._u, self._tmp, self._tmp2 = xp.empty(n, dt), xp.empty(n, dt), xp.empty(n, dt)
        elif self._xp is not xp:
            raise TypeError(f"SLAMB state lives in {self._xp.__name__}, got {xp.__name__} arrays")

    def state_dict(self):
        """This rank's state: step, m, v, f (host copies) and the communicator's state."""
        host = (lambda a: None if a is None else _arr.to_host(a).copy())
        return {
            "step": self.t,
            "m": host(self.m),
            "v": host(self.v),
            "f": host(self.f),
            "comm": self.comm.state_dict(),
        }

    def load_state_dict(self, state, xp=np):
        """Restore :meth:`state_dict` output exactly; ``xp`` is where the state should live."""
        if self._t_open is not None:
            raise RuntimeError("cannot load state in the middle of a step")
        self.comm.load_state_dict(state["comm"], xp=xp)
        self.t = int(state["step"])
        if state["m"] is None:
            self._xp = None
            self.m = self.v = self.f = None
            return
        for k in ("m", "v", "f"):
            if np.shape(state[k]) != (self.layout.total,):
                raise LayoutError(f"saved {k} has shape {np.shape(state[k])}, expected ({self.layout.total},)")
        self._xp = None
        self._ensure_state(xp)
        self.f = xp.ones(self.layout.total, self.layout.dtype)
        for k in ("m", "v", "f"):
            getattr(self, k)[...] = xp.asarray(state[k])

    # ------------------------------------------------------------------ pieces
    def begin_step(self):
        """Open step ``t + 1`` and return it."""
        if self._t_open is not None:
            raise RuntimeError(f"step {self._t_open} is still open: call apply() (or abort_step()) first")
        self._t_open = self.t + 1
        self._sel = self._pos = None
        return self._t_open

    def abort_step(self):
        """Abandon the open step: nothing it computed is kept."""
        self._t_open = None
        self._sel = self._pos = None

    def _open(self):
        if self._t_open is None:
            raise RuntimeError("no step is open: call begin_step() first")
        return self._t_open

    def accumulate(self, i, g_i):
        """Local moments of tensor ``i`` from its gradient (shaped like tensor ``i``)."""
        self._open()
        g_i = _arr.as_array(g_i)
        xp = _arr.namespace(g_i)
        self._ensure_state(xp)
        o, n = self.layout.offsets[i], self.layout.sizes[i]
        if g_i.size != n:
            raise LayoutError(f"gradient of tensor {self.layout.names[i]!r} has {g_i.size} elements, expected {n}")
        self._moments(slice(o, o + n), g_i.reshape(-1))

    def _moments(self, sl, g):
        """``m_next = b1 m + (1-b1) g``, ``v_next = b2 v + (1-b2) g^2`` on slice ``sl``, no temporaries."""
        xp = self._xp
        b1, b2 = self.betas
        dt = self.layout.dtype.type
        tmp, mn, vn = self._tmp[sl], self._m_next[sl], self._v_next[sl]
        xp.multiply(g, dt(1.0 - b1), out=tmp)
        xp.multiply(self.m[sl], dt(b1), out=mn)
        mn += tmp
        xp.multiply(g, g, out=tmp)
        tmp *= dt(1.0 - b2)
        xp.multiply(self.v[sl], dt(b2), out=vn)
        vn += tmp

    def momentum_views(self):
        """Per-tensor views of the momentum being computed in the open step."""
        self._open()
        return self.layout.views(self._m_next)

    def mask_positions(self, t=None):
        """Per tensor, the flat positions within that tensor that are in M_t (int arrays).

        For the 'topk' mask this is a collective (every rank must call it) and needs the
        moments of the open step to be accumulated first.
        """
        t = self._open() if t is None else t
        if self._pos is None:
            idx = self._select(t).index
            xp = self._xp or np
            s = xp.sort(idx)
            ends = np.asarray(self.layout.offsets[1:] + [self.layout.total])
            cuts = _arr.to_host(xp.searchsorted(s, xp.asarray(ends)))
            starts = [0] + cuts[:-1].tolist()
            self._pos = [s[a:b] - o for a, b, o in zip(starts, cuts.tolist(), self.layout.offsets)]
        return self._pos

    def _select(self, t):
        if self._sel is None:
            xp = self._xp or np
            self._sel = self.comm.mask.select(t, xp=xp, flat=self._m_next, transport=self.comm.transport)
        return self._sel

    def exchange(self):
        """The momentum exchange of the open step: one fused masked allreduce of m over M_t.

        Raises NonFiniteError on every rank if any rank's new moments are non-finite; the
        step is then aborted and no state changes.
        """
        t = self._open()
        xp = self._xp
        # NaN and Inf propagate into a sum: one reduction per buffer, no boolean temporaries.
        local_bad = not bool(xp.isfinite(xp.sum(self._m_next)) & xp.isfinite(xp.sum(self._v_next)))
        try:
            _, sel = self.comm._masked_allreduce(self._m_next, t, local_nonfinite=local_bad)
        except NonFiniteError as e:
            self.abort_step()
            if not local_bad:
                raise
            bad = xp.logical_not(xp.isfinite(self._m_next) & xp.isfinite(self._v_next))
            names = [n for n, v in zip(self.layout.names, self.layout.views(bad)) if bool(v.any())]
            raise NonFiniteError(f"{e} (this rank: non-finite gradient in {names})", e.ranks, names) from None
        except Exception:
            self.abort_step()
            raise
        self._sel = sel

    def apply(self, x, lr=None, weight_decay=None):
        """Finish the open step on parameters ``x`` (fused buffer or list of arrays, in place).

        Freshness, Adam direction, per-tensor trust ratios, the element-wise update, and
        the periodic parameter sync after steps with ``(t - 1) % H == 0``. Commits the step.
        """
        t = self._open()
        lay = self.layout
        lr = self.lr if lr is None else self._per_tensor(lr, "lr")
        wd = self.weight_decay if weight_decay is None else self._per_tensor(weight_decay, "weight_decay")
        listed = isinstance(x, (list, tuple))
        arrs = [_arr.as_array(a) for a in x] if listed else None
        if listed:
            if len(arrs) != len(lay):
                raise LayoutError(f"got {len(arrs)} parameter arrays, expected {len(lay)}")
            xp = _arr.namespace(*arrs)
            flat = xp.concatenate([a.reshape(-1) for a in arrs]) if arrs else xp.zeros(0, lay.dtype)
        else:
            flat = _arr.as_array(x)
            xp = _arr.namespace(flat)
            if flat.shape != (lay.total,):
                raise LayoutError(f"expected a fused buffer of {lay.total} elements, got shape {flat.shape}")
        if flat.dtype != lay.dtype:
            raise LayoutError(f"parameters have dtype {flat.dtype.name}, expected {lay.dtype.name}")
        self._ensure_state(xp)
        sel = self._select(t)
        b1, b2 = self.betas
        P = self.comm.size
        dt = lay.dtype.type
        m, v, u, tmp = self._m_next, self._v_next, self._u, self._tmp

        # Freshness: f = b3 f, then 1 on M_t (in place: nothing below can fail before the commit).
        f = self.f
        f *= dt(self.beta3)
        sel.put(f, 1)
        # Adam direction u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd x, in the
        # order of the formula (the same float rounding as a plain implementation).
        xp.divide(v, dt(1.0 - b2**t), out=u)
        xp.sqrt(u, out=u)
        u += dt(self.eps)
        xp.divide(m, dt(1.0 - b1**t), out=tmp)
        xp.divide(tmp, u, out=u)
        views = lay.segments()
        for (o, n), w in zip(views, wd):
            if w and n:
                xp.multiply(flat[o : o + n], dt(w), out=tmp[o : o + n])
                u[o : o + n] += tmp[o : o + n]
        # Per-tensor squared norms, accumulated in float64: everything, and the fresh set S = M_t (from the
        # gathered |M_t| values); the stale set A is the difference (accumulated in float64).
        x_all = np.array([float(xp.einsum("i,i->", flat[o : o + n], flat[o : o + n], dtype=np.float64))
                          for o, n in views])
        u_all = np.array([float(xp.einsum("i,i->", u[o : o + n], u[o : o + n], dtype=np.float64)) for o, n in views])
        seg = self._segments_of(xp, sel.index)
        xs, us = sel.take(flat, out=xp.empty(sel.size, np.float64)), sel.take(u, out=xp.empty(sel.size, np.float64))
        x_s = _arr.to_host(xp.bincount(seg, weights=xs * xs, minlength=len(lay)))
        u_s = _arr.to_host(xp.bincount(seg, weights=us * us, minlength=len(lay)))
        n_s = _arr.to_host(xp.bincount(seg, minlength=len(lay)))
        x_a, u_a = np.maximum(x_all - x_s, 0.0), np.maximum(u_all - u_s, 0.0)
        phi_s = self._trust(np.sqrt(x_s), np.sqrt(u_s))
        phi_a = self._trust(np.sqrt(x_a), np.sqrt(u_a))
        # x -= (lr phi_S f + lr / sqrt(P) phi_A (1 - f)) u, per tensor.
        tmp2 = self._tmp2
        for i, (o, n) in enumerate(views):
            if n == 0:
                continue
            xi, ui, fi, ti = flat[o : o + n], u[o : o + n], f[o : o + n], tmp[o : o + n]
            xp.multiply(fi, dt(lr[i] * phi_s[i]), out=ti)
            if n_s[i] < n:  # some stale elements (where all are fresh, 1 - f == 0)
                t2 = tmp2[o : o + n]
                xp.subtract(dt(1), fi, out=t2)
                t2 *= dt(lr[i] / math.sqrt(P) * phi_a[i])
                ti += t2
            ti *= ui
            xi -= ti
        # Commit the step (moments, freshness, step count) before the sync, which may raise.
        self.m, self._m_next = self._m_next, self.m
        self.v, self._v_next = self._v_next, self.v
        self.t = t
        self._t_open = None
        self._sel = self._pos = None
        if (t - 1) % self.sync_interval == 0 and P > 1:
            self.comm.sync(flat)
        if listed:
            for a, v in zip(arrs, lay.views(flat)):
                a[...] = v
        return x

    def step(self, x, g, lr=None, weight_decay=None):
        """One whole SLAMB step: ``x`` updated in place from this rank's gradient ``g``.

        ``x`` and ``g``: fused flat buffers or lists of arrays shaped like the layout.
        """
        self.begin_step()
        try:
            if isinstance(g, (list, tuple)):
                if len(g) != len(self.layout):
                    raise LayoutError(f"got {len(g)} gradients, expected {len(self.layout)}")
                for i, gi in enumerate(g):
                    self.accumulate(i, gi)
            else:
                g = _arr.as_array(g)
                if g.shape != (self.layout.total,) or g.dtype != self.layout.dtype:
                    raise LayoutError(
                        f"expected a fused gradient of {self.layout.total} {self.layout.dtype.name}, "
                        f"got {g.shape} {g.dtype.name}"
                    )
                self._ensure_state(_arr.namespace(g))
                self._moments(slice(0, self.layout.total), g)
        except Exception:
            self.abort_step()
            raise
        try:
            self.exchange()
        except NonFiniteError as e:
            if self.on_nonfinite == "raise":
                raise
            self.skipped_steps += 1
            log.warning("slamb_comm: step %d skipped on every rank (%d skipped so far): %s",
                        self.t + 1, self.skipped_steps, e)
            return x
        return self.apply(x, lr=lr, weight_decay=weight_decay)

    # ------------------------------------------------------------------ helpers
    def _segments_of(self, xp, idx):
        """The tensor index of every position in ``idx``."""
        starts = xp.asarray(np.asarray(self.layout.offsets, dtype=np.int64))
        return xp.searchsorted(starts, idx, side="right") - 1

    def _trust(self, xn, un):
        """Per tensor ``clamp(||x|| / ||u||, c_min, c_max)``, 1 where either norm is 0 (host arrays)."""
        ok = (xn > 0) & (un > 0)
        ratio = np.divide(xn, un, out=np.ones_like(xn), where=ok)
        return np.where(ok, np.clip(ratio, self.c_min, self.c_max), 1.0)
