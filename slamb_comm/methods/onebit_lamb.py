"""The 1-bit LAMB rule on fused flat buffers (docs/onebit_lamb.md section 2, with section 3's
slamb_comm choices).

:class:`OneBitLambRule` owns the optimizer state of one fused buffer of parameters and does one
step at a time:

* **warm-up**, steps 1..``freeze_step``: one dense allreduce of the gradient (the mean ḡ), then
  LAMB on ḡ -- ``m``, ``v``, the LAMB coefficient ``c = clamp(||x|| / ||u||, c_min,
  c_max)`` per tensor, and its moving average ``κ`` (``coeff_beta``);
* **compression**, after ``freeze_step``: v is frozen; each rank's momentum, scaled per tensor
  by ``γ`` (fixed at the first compression step so that every tensor's momentum has the same
  RMS), goes through the 1-bit exchange (:class:`~slamb_comm.exchange.onebit.OneBitExchange`); the
  reconstructed gradient updates the fresh second moment ``f``, whose ratio to the frozen one
  sets a bounded factor ``φ``; the step is ``x -= lr κ φ u``.

Costs: state m, v, f (12 bytes per fp32 parameter) plus the exchange's error buffers (4 + 4/P
bytes per parameter). On the CPU the step goes tensor by tensor, with one scratch buffer of the
whole model (the averaged gradient, then the exchanged momentum), the direction computed twice
(for the norms, then for the update) instead of being kept. On a device (docs/onebit_lamb.md
section 5) a constant number of launches whatever the number of tensors: the warm-up 4 besides
the dense allreduce's (64 bytes of device traffic per fp32 parameter at two ranks, the
allreduce included), the compression stage 6 and the two collectives (69 bytes, 73 with weight
decay), one more launch at its first step (γ); no copy to the device after the first step, the
warm-up's mean gradient and the exchange's buffers as scratch; two host reads per step (the
allreduce's or the exchange's status words, at P = 1 the momentum's check; then the per-tensor
numbers, γ with them at its step).

Tuning (DeepSpeed's advice): ``freeze_step`` long enough for v to settle (their BERT runs:
a few thousand steps, with ``1 / (1 - coeff_beta) <= freeze_step``); ``factor_min``,
``factor_max`` and ``factor_threshold`` bound how far and how fast the frozen LAMB coefficient
may be rescaled in the compression stage.
"""

import logging
import math

import numpy as np

from .. import arrays as _arr
from ..errors import ConfigError, LayoutError, NonFiniteError
from ..device.onebit_step import LambOnDevice
from .onebit_host import OneBitHostStep

__all__ = ["OneBitLambRule"]

log = logging.getLogger("slamb_comm")


def _sumsq(a):
    return float(np.dot(a, a))


def _clamp(v, lo, hi):
    return min(max(v, lo), hi)


class OneBitLambRule:
    """1-bit LAMB's state and update for the fused buffer described by ``comm.layout``.

    Args:
        comm: a :class:`~slamb_comm.Communicator` built on the parameters; its transport must
            have ``alltoall``, its ``value_dtype`` is that of the exchanged scales.
        lr, betas, eps, weight_decay: as in LAMB (``u = m / (sqrt(v) + eps) + weight_decay x``).
        freeze_step: the number of warm-up (dense LAMB) steps.
        c_max, c_min: clamp of the warm-up's LAMB coefficient (the trust ratio's bounds, named
            as SLAMB's; DeepSpeed calls them ``max_coeff``/``min_coeff``).
        coeff_beta: moving-average rate of the warm-up's LAMB coefficient (κ).
        factor_max, factor_min, factor_threshold: bounds of the compression stage's factor φ,
            and of its change per step (a fraction of the previous φ).
        bias_correction: False (default): DeepSpeed's rule, no bias correction. True: the warm-up
            is docs/algorithm.md's LAMB on the mean gradient (``m / (1 - b1^t)``, ``v / (1 - b2^t)``),
            and the compression stage divides m by ``1 - b1^t``, the frozen v by
            ``1 - b2^freeze_step`` and f by ``1 - b2^t``.
        on_nonfinite: 'skip' (default): a step with a NaN/Inf gradient on any rank is skipped by
            every rank (logged, counted in :attr:`skipped_steps`); 'raise': every rank raises
            :class:`~slamb_comm.errors.NonFiniteError`. Either way nothing changes.
    """

    def __init__(self, comm, *, lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 c_max=10.0, c_min=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, bias_correction=False, on_nonfinite="skip"):
        self.comm = comm
        self.layout = comm.layout
        if self.layout.dtype == np.float16:
            raise ConfigError("OneBitLambRule keeps its state in the parameters' dtype: keep a float32 master copy "
                              "of float16 parameters and build the communicator on it")
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"betas must be in [0, 1), got {betas}")
        if isinstance(freeze_step, bool) or int(freeze_step) != freeze_step or freeze_step < 0:
            raise ConfigError(f"freeze_step must be an integer >= 0, got {freeze_step!r}")
        if not (0.0 < float(c_min) <= float(c_max)):
            raise ConfigError(f"need 0 < c_min <= c_max, got {c_min}, {c_max}")
        if not (0.0 < float(factor_min) <= 1.0 <= float(factor_max)):
            raise ConfigError(f"need 0 < factor_min <= 1 <= factor_max, got {factor_min}, {factor_max}")
        if not (0.0 <= float(factor_threshold) < 1.0):
            raise ConfigError(f"factor_threshold must be in [0, 1), got {factor_threshold}")
        if not (0.0 <= float(coeff_beta) < 1.0):
            raise ConfigError(f"coeff_beta must be in [0, 1), got {coeff_beta}")
        for name, val in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not (math.isfinite(float(val)) and float(val) >= 0):
                raise ConfigError(f"{name} must be finite and >= 0, got {val}")
        if on_nonfinite not in ("skip", "raise"):
            raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")
        self.lr, self.eps, self.weight_decay = float(lr), float(eps), float(weight_decay)
        self.betas = (b1, b2)
        self.freeze_step = int(freeze_step)
        self.c_max, self.c_min = float(c_max), float(c_min)
        self.coeff_beta = float(coeff_beta)
        self.factor_max, self.factor_min = float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self.bias_correction = bool(bias_correction)
        self.on_nonfinite = on_nonfinite
        self.exchange = comm.onebit
        T = len(self.layout)
        self.t = 0
        self.kappa = [0.0] * T  # lamb_coeff_freeze
        self.phi = [1.0] * T  # last_factor
        self.gamma = None  # scaling_coeff, fixed at the first compression step
        self.skipped_steps = 0
        self.lamb_coeffs = [1.0] * T  # the coefficients of the last step (c, or κ φ), as DeepSpeed's get_lamb_coeffs
        self._xp = None
        self.m = self.v = self.f = None
        self._host = None
        self._scratch = {}
        self._device = None  # ((library, device), its LambOnDevice)
        self._cpu = OneBitHostStep(self)  # the step on NumPy arrays

    # ------------------------------------------------------------------ state
    @property
    def compressing(self):
        """Whether the next step is in the compression stage."""
        return self.t >= self.freeze_step

    def _ensure_state(self, xp, like):
        if self._xp is None:
            n, dt = self.layout.total, self.layout.dtype
            host = self._host or {}
            with _arr.device_scope(like):
                self.m = xp.asarray(host["m"]) if "m" in host else xp.zeros(n, dt)
                self.v = xp.asarray(host["v"]) if "v" in host else xp.zeros(n, dt)
                self.f = xp.asarray(host["f"]) if host.get("f") is not None else None
            self._host = None
            self._xp = xp
        elif self._xp is not xp:
            raise TypeError(f"1-bit LAMB state lives in {self._xp.__name__}, got {xp.__name__} arrays")

    def place(self, like):
        """Allocate the state now (zeros, or what :meth:`load_state_dict` restored) in the library
        and on the device of the array ``like``, instead of at the first step."""
        like = _arr.as_array(like)
        self._ensure_state(_arr.namespace(like), like)

    def scratch(self, xp, name):
        """A scratch array of the model's size on ``xp``, by name (the warm-up's mean gradient, the
        compression stage's momentum on the host), kept between steps."""
        a = self._scratch.get(name)
        if a is None or _arr.namespace(a) is not xp:
            a = self._scratch[name] = xp.empty(self.layout.total, self.layout.dtype)
        return a

    def state_dict(self):
        """This rank's state: step, m, v, f (host copies; None before they exist), the per-tensor
        κ, φ and γ, and the exchange's error buffers."""
        src = self._host if self._host is not None else {"m": self.m, "v": self.v, "f": self.f}
        host = (lambda a: None if a is None else _arr.to_host(a).copy())
        return {
            "step": self.t,
            "m": host(src.get("m")),
            "v": host(src.get("v")),
            "f": host(src.get("f")),
            "kappa": list(self.kappa),
            "phi": list(self.phi),
            "gamma": None if self.gamma is None else list(self.gamma),
            "skipped_steps": self.skipped_steps,
            "exchange": self.exchange.state_dict(),
        }

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly (the arrays stay on the host until the next
        step moves them to the device of its arrays). The error buffers are restored too, so a
        resumed run continues bit for bit (unlike DeepSpeed, which resets them)."""
        n, T, dt = self.layout.total, len(self.layout), self.layout.dtype
        for k in ("m", "v", "f"):
            if state[k] is not None and np.shape(state[k]) != (n,):
                raise LayoutError(f"saved {k} has shape {np.shape(state[k])}, expected ({n},)")
        for k in ("kappa", "phi"):
            if len(state[k]) != T:
                raise LayoutError(f"saved {k} has {len(state[k])} values for {T} tensors")
        if state["gamma"] is not None and len(state["gamma"]) != T:
            raise LayoutError(f"saved gamma has {len(state['gamma'])} values for {T} tensors")
        self.exchange.load_state_dict(state["exchange"])
        self.t = int(state["step"])
        self.kappa = [float(k) for k in state["kappa"]]
        self.phi = [float(p) for p in state["phi"]]
        self.gamma = None if state["gamma"] is None else [float(g) for g in state["gamma"]]
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._xp = None
        self.m = self.v = self.f = None
        self._scratch = {}
        self._device = None
        self._host = None if state["m"] is None else {
            k: None if state[k] is None else np.array(_arr.to_host(state[k]), dtype=dt, copy=True)
            for k in ("m", "v", "f")}

    # ------------------------------------------------------------------ the step
    def step(self, x, g, lr=None):
        """One step: ``x`` (the fused parameter buffer, or a list of arrays shaped like the
        layout) updated in place from this rank's gradient ``g`` (same form). Returns ``x``.

        A step with a non-finite gradient on any rank changes nothing (m, v, f, x, the error
        buffers, the step count) and is skipped or raises, per ``on_nonfinite``."""
        lr = self.lr if lr is None else float(lr)
        lay = self.layout
        xv, gv = self._views(x), self._views(g)
        xp = _arr.namespace(*(xv + gv)) if lay.total else np
        like = xv[0] if len(lay) else np.zeros(0)
        self._ensure_state(xp, like)
        try:
            with _arr.device_scope(like):
                if xp is not np:
                    self._device_step(xp, x, xv, g, gv, lr)
                elif self.compressing:
                    self._cpu.compressed(xv, gv, lr)
                else:
                    self._cpu.warmup(xv, gv, lr)
        except NonFiniteError as e:
            if self.on_nonfinite == "raise":
                raise
            self.skipped_steps += 1
            log.warning("slamb_comm: 1-bit LAMB step %d skipped on every rank (%d skipped so far): %s",
                        self.t + 1, self.skipped_steps, e)
        return x

    def _views(self, a):
        lay = self.layout
        if isinstance(a, (list, tuple)):
            arrs = [_arr.as_array(v) for v in a]
            if len(arrs) != len(lay):
                raise LayoutError(f"got {len(arrs)} arrays, expected {len(lay)}")
            out = []
            for v, name, n in zip(arrs, lay.names, lay.sizes):
                if v.size != n or v.dtype != lay.dtype or not v.flags.c_contiguous:
                    raise LayoutError(f"tensor {name!r}: {v.size} {v.dtype.name} (contiguous: "
                                      f"{v.flags.c_contiguous}), expected {n} {lay.dtype.name}")
                out.append(v.reshape(-1))
            return out
        flat = _arr.as_array(a)
        if flat.shape != (lay.total,) or flat.dtype != lay.dtype or not flat.flags.c_contiguous:
            raise LayoutError(f"expected a fused buffer of {lay.total} {lay.dtype.name}, got {flat.shape} {flat.dtype.name}")
        return lay.flat_views(flat)

    def corrections(self, t):
        """The bias corrections ``(1 - b1^t, 1 - b2^min(t, freeze_step), 1 - b2^t)`` (ones without
        ``bias_correction``)."""
        b1, b2 = self.betas
        if not self.bias_correction:
            return 1.0, 1.0, 1.0
        frozen = min(t, self.freeze_step)
        return 1.0 - b1**t, 1.0 - b2**frozen, 1.0 - b2**t

    # ------------------------------------------------------------------ on a device
    def _device_step(self, xp, x, xv, g, gv, lr):
        """One step on a device in a constant number of launches, whatever the number of tensors
        (docs/onebit_lamb.md section 5); ``x`` and ``g`` are read where they are (a fused
        buffer, or a list through its table of addresses). The per-tensor numbers (κ, φ, the
        coefficients, γ) live on the device and come back with one host read at the end."""
        key = (xp.__name__, xp.cuda.Device().id)
        if self._device is None or self._device[0] != key:
            self._device = (key, LambOnDevice(xp, self))
        dev = self._device[1]
        dev.copy_in(xp)
        xt, gt = dev.operand(xp, "x", x, xv), dev.operand(xp, "g", g, gv)
        fixes_gamma = self.compressing and self.gamma is None
        if self.compressing:
            self._device_compressed(xp, dev, xt, gt, lr)
        else:
            self._device_warmup(xp, dev, xt, gt, lr)
        dev.read_back(fixes_gamma)

    def _device_warmup(self, xp, dev, xt, gt, lr):
        """The warm-up (2.2): the gradient copied and checked (one launch), its mean (the dense
        allreduce, which raises on every rank if some rank's gradient is not finite), then the
        moments and tile norms, the coefficients and the update (three launches)."""
        t = self.t + 1
        gbar = self.scratch(xp, "g")
        dev.scan(xp, gt, gbar)
        self.comm.sync(gbar, bad=dev.word[2])
        copy_f = t == self.freeze_step
        if copy_f:
            self.f = xp.empty(self.layout.total, self.layout.dtype)  # f = v, written by the moments pass
        c1, c2, _ = self.corrections(t)
        dev.warm(xp, xt, gbar, copy_f, c1, c2)
        dev.coeffs(xp, False, lr)
        dev.update(xp, xt, c1, c2)
        self.t = t

    def _device_compressed(self, xp, dev, xt, gt, lr):
        """The compression stage (2.3): γ at its first step (one launch), the 1-bit exchange of
        the scaled momentum computed on the fly (:meth:`OneBitExchange.device_exchange`; at
        P = 1 one launch checks it instead), then the moments with the errors' commit, the
        factors and the update (three launches)."""
        t = self.t + 1
        self._scratch.pop("g", None)  # the warm-up's mean gradient: no buffer of the model's size is needed here
        if self.gamma is None:
            dev.gamma(xp)
        if self.f is None:  # freeze_step == 0: no warm-up, the fresh second moment starts from v
            self.f = self.v.copy()
        w = errors = times = None
        if self.comm.size > 1:
            w, times = self.exchange.device_exchange(xp, lambda w, e: dev.encode(xp, w, gt, e))
            errors = self.exchange.error_buffers(xp)
        else:
            dev.scan(xp, gt, None)
            if bool(dev.word[2]):
                raise NonFiniteError(f"1-bit LAMB step {t}: non-finite gradient", (0,))
        corrections = self.corrections(t)
        dev.comp(xp, xt, gt, w, errors, corrections)
        if times is not None:
            self.exchange.record(times)
        dev.coeffs(xp, True, lr)
        dev.update(xp, xt, *corrections[:2])
        self.t = t

