"""The SLAMB update rule on fused flat buffers (docs/algorithm.md section 1).

:class:`SlambRule` owns the optimizer state of one fused buffer of parameters -- momentum
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
* **Host synchronisations on a GPU**: none per step on the device kernels (the cyclic mask): a
  non-finite step is decided on the device and learnt at the next step (:meth:`SlambRule.settle`);
  two on periodic-sync steps. Tensor by tensor (the bernoulli and topk masks): one per step (the
  exchange's status), one more for the topk mask's union. None per tensor; trust ratios stay on
  the device.
* **Time on the CPU**: cache-sized blocks; the moments, the direction and the norms in one
  pass over each tensor, the update in a second.
* **On a GPU**: :mod:`slamb_comm.device.slamb_step` runs the step as a few kernels over a table of tiles
  (:mod:`slamb_comm.device.kernels`), on a fused buffer or a list of arrays alike: about 46 bytes of
  device traffic per parameter (``AdamW(fused=True)``: 28), 7 device operations at any number of
  tensors, m and v plus the payload in memory (about 8.4 bytes per parameter), no host-to-device
  copy once its tables are built, no host read.

Tuning guide (from the paper and docs/algorithm.md section 5):

* ``ratio`` (k, on the communicator): the fraction of the momentum exchanged per step.
  0.1 is the paper's default; the bytes per step are about ``k + 1/H`` of dense LAMB's,
  plus the always-dense small and 1-D tensors. With ``value_dtype='float16'`` halve that.
  It can change between steps (:meth:`SlambRule.set_ratio`): the reference's CIFAR-10 runs
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
:attr:`SlambRule.skipped_steps`; with ``'raise'`` every rank raises
:class:`~slamb_comm.errors.NonFiniteError`. Either way nothing changes. On the device kernels a
skipped step is decided on the device: it counts in ``t`` until :meth:`SlambRule.settle` (the next
step, :attr:`SlambRule.skipped_steps`, :meth:`SlambRule.state_dict`) takes it back, and the next
step logs it.
"""

import logging
import math

import numpy as np

from .. import arrays as _arr
from ..device import slamb_step as _fused
from ..errors import ConfigError, LayoutError, NonFiniteError
from .tensorwise import TensorwiseStep, _views

__all__ = ["SlambRule"]

log = logging.getLogger("slamb_comm")


class SlambRule(TensorwiseStep):
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
        shard_group: for sharded tensors (a layout with ``shards``; docs/algorithm.md section
            15): a transport over the ranks that hold the other pieces of the same tensors (the
            shard group of an HSDP mesh), while ``comm``'s transport spans the replicas of this
            rank's pieces. Each step then sums every tensor's squared norms over the shard group
            (4 floats per tensor) so that the trust ratios are the whole tensors', and agrees on a
            non-finite step over it; ``P`` in the stale rate is the number of replicas. On a
            device the kernels of :mod:`slamb_comm.device.slamb_step` take it too (the sums between kernels 2
            and 3).

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
        shard_group=None,
    ):
        self.comm = comm
        self.layout = comm.layout
        _check_options(comm.layout, betas, beta3, sync_interval, c_min, c_max, eps, on_nonfinite)
        if (shard_group is None) != (comm.layout.shards is None):
            raise ConfigError("a layout of shards (Layout(..., shards=...)) and shard_group= go together: pass the "
                              "transport over the ranks holding the other pieces, or build the layout of whole tensors")
        #: the transport over the other pieces' ranks (sharded tensors), or None
        self.shard_group = shard_group
        self.betas = tuple(float(b) for b in betas)
        self.eps = float(eps)
        self.beta3 = float(beta3)
        self.sync_interval = int(sync_interval)
        self.c_min, self.c_max = float(c_min), float(c_max)
        self.lr = self.per_tensor(lr, "lr")
        self.weight_decay = self.per_tensor(weight_decay, "weight_decay")
        self.on_nonfinite = on_nonfinite
        self._skipped = 0  # steps skipped for non-finite values (on every rank alike)
        #: steps opened so far, a retried step too (the device kernels mark an attempt's bad tensors with it)
        self.opened = 0
        self._unreported = None  # a step the device skipped, learnt by settle(), logged at the next step
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
        self._counts = self._starts = None  # M_t's count per tensor and the payload's starts (the CPU path)
        #: whether :meth:`step` takes the device kernels (:mod:`slamb_comm.device.slamb_step`) for device arrays:
        #: None (default) where they apply, False never (tensor by tensor); NumPy arrays always go
        #: tensor by tensor (cache-sized blocks are the fast way on a CPU)
        self.fused = None
        #: the fused step's device state (plans, address tables, payload): :class:`~slamb_comm.device.slamb_step.DeviceStep`
        self.device = _fused.DeviceStep(self)
        self._device_open = None  # the device step between exchange_step and apply_step

    def agree_options(self, lr=None, weight_decay=None):
        """Collective: every rank must have the same options (else ConfigError everywhere).
        ``lr`` and ``weight_decay``, if given, are the values the next step will use."""
        lr = self.lr if lr is None else self.per_tensor(lr, "lr")
        weight_decay = self.weight_decay if weight_decay is None else self.per_tensor(weight_decay, "weight_decay")
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

    def per_tensor(self, value, name):
        """``value`` (a float, or one per tensor) as one float per tensor, checked (>= 0, finite)."""
        n = len(self.layout)
        if np.isscalar(value):
            vals = [float(value)] * n
        else:
            vals = [float(v) for v in value]
            if len(vals) != n:
                raise ConfigError(f"{name}: {len(vals)} values for {n} tensors")
        if not (math.isfinite(sum(vals)) and min(vals, default=0.0) >= 0):  # no call per tensor
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

    @property
    def has_stored_freshness(self):
        """Whether some tensor's freshness is stored (cyclic mask: it once skipped a step), not derived."""
        return bool(self._fx or (self._host or {}).get("fx"))

    @property
    def skipped_steps(self):
        """Steps skipped for non-finite values, on every rank alike (a step decided on the device is
        settled first: see :meth:`settle`)."""
        self.settle()
        return self._skipped

    @skipped_steps.setter
    def skipped_steps(self, n):
        self._skipped = int(n)

    def settle(self, wait=False):
        """Learn whether the last step, if the device decided it (:meth:`step` with
        ``on_nonfinite='skip'`` on device arrays), was skipped there: then it is taken back (``t`` goes
        back by one, :attr:`skipped_steps` up by one) and logged at the next step. Reads one word back,
        waiting only if the device has not reached that step's verdict yet. Returns whether it was.
        Local: any rank may call it at any time; the next step and :meth:`state_dict` call it. ``wait``:
        the caller knows the device has not reached it (a periodic-sync step settles its own step)."""
        failed = self.device.settle(wait)
        if failed is None:
            return False
        self.t -= 1
        self._skipped += 1
        self._unreported = failed
        return True

    def report_skips(self, wait=False):
        """Collective, at the start of a step: settle the last step and log it if the device skipped it
        (who and where: one small allgather). Returns whether it was skipped."""
        self.settle(wait)
        failed, self._unreported = self._unreported, None
        if failed is None:
            return False
        e = self.device.explain(failed)
        log.warning("slamb_comm: step %d skipped on every rank (%d skipped so far): %s", failed.t, self._skipped, e)
        return True

    def begin_step(self):
        """Open step ``t + 1`` (after settling the last one) and return it."""
        self.settle()
        t = super().begin_step()
        self.opened += 1
        return t

    def end_step(self, t):
        """Commit step ``t``, whose update has been applied: it becomes the last step."""
        if self._t_open != t:
            raise RuntimeError(f"step {t} is not the open step ({self._t_open})")
        self.t = t
        self._t_open = None
        self._payload = None
        self._picks = {}
        self._rot = {}
        self._local = {}

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
        self.settle()
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
        self.settle()
        problem = None if self._t_open is None else RuntimeError(
            f"step {self._t_open} is open: change the ratio between steps")
        self.comm.set_ratio(ratio, self.t, problem=problem)

    def state_dict(self):
        """This rank's state: step, m, v, f (host copies; f derived where the mask allows) and
        the communicator's state."""
        self.settle()
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
        self.device.pending = self._unreported = None  # the last step's verdict is of the state replaced
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

    def step(self, x, g, lr=None, weight_decay=None, written=None, skip=()):
        """One whole SLAMB step: ``x`` updated in place from this rank's gradient ``g``.

        ``x`` and ``g``: fused flat buffers or lists of arrays shaped like the layout (or lazily
        read sequences, with ``written`` as in :meth:`apply`; ``g`` also
        :class:`~slamb_comm.device.tables.Addresses`). On a device the step runs as the kernels of
        :mod:`slamb_comm.device.slamb_step` (a constant number of device operations whatever the number of
        tensors; :attr:`fused` chooses); on the CPU tensor by tensor. ``skip``: tensors without a
        gradient on every rank (the same on every rank; see :meth:`apply`); they still take part
        in the exchange with whatever ``g`` holds for them (zeros). It is :meth:`exchange_step`
        then :meth:`apply_step`.
        """
        defer = self.on_nonfinite == "skip" and self.shard_group is None
        try:
            self.exchange_step(x, g, skip, defer=defer)
        except NonFiniteError as e:
            return self._skip(e, x)
        return self.apply_step(x, g, lr=lr, weight_decay=weight_decay, written=written, skip=skip)

    def exchange_step(self, x, g, skip=(), defer=False):
        """The first half of :meth:`step`: open the next step, take this rank's gradients ``g`` and run
        the momentum exchange. Nothing is changed yet: a NonFiniteError (on every rank alike) leaves
        the step closed and the state as it was. So several optimizers (buckets) can all exchange
        before any of them updates, and skip together. ``defer``: on the device kernels, let the device
        decide a non-finite step instead (no host read; :meth:`settle` learns of it later, and the step's
        update changes nothing), as :meth:`step` does with ``on_nonfinite='skip'``."""
        xp = None if self.fused is False else _namespace_of(x)
        self._device_open = None
        if xp is not None and _fused.applies(self, x, g, xp, skip):
            exchange = lambda: setattr(self, "_device_open", self.device.open_step(x, g, defer))  # noqa: E731
        else:
            self.begin_step()
            try:
                gv = _views(self.layout, g)
                for i in range(len(self.layout)):
                    self.accumulate(i, gv[i])
            except Exception:
                self.abort_step()
                raise
            exchange = lambda: self.exchange(g)  # noqa: E731
        if self.shard_group is None:
            return exchange()
        try:
            exchange()
        except NonFiniteError as e:
            self._shards_agree(e)
            raise
        self._shards_agree(None)

    def _shards_agree(self, failed):
        """Sharded tensors: the shard group learns whether any of its replica groups failed the exchange
        (one allreduce of one float), so that every rank skips the step or none does. ``failed``: this
        rank's NonFiniteError (its step is already aborted), or None."""
        word = np.array([0.0 if failed is None else 1.0])
        self.shard_group.allreduce(word)
        if failed is None and word[0] > 0:
            self.abort_step()
            raise NonFiniteError(f"SLAMB momentum exchange at step {self.t + 1}: non-finite values in another "
                                 "shard group's exchange (this rank's pieces were finite)", [], [])

    def apply_step(self, x, g, lr=None, weight_decay=None, written=None, skip=()):
        """The second half of :meth:`step`, after :meth:`exchange_step`: the update of ``x`` and the
        periodic sync (which raises NonFiniteError on every rank if some rank's parameters are not
        finite: the step was applied)."""
        opened, self._device_open = self._device_open, None
        if opened is not None:
            return self.device.close_step(opened, x, g, lr, weight_decay, written)
        return self.apply(x, g, lr=lr, weight_decay=weight_decay, written=written, skip=skip)

    def _skip(self, e, x):
        """A step that failed on every rank for non-finite values: raise, or count and log it."""
        if self.on_nonfinite == "raise":
            raise e
        self._skipped += 1
        log.warning("slamb_comm: step %d skipped on every rank (%d skipped so far): %s",
                    self.t + 1, self._skipped, e)
        return x


def _namespace_of(x):
    """NumPy or CuPy, from a fused buffer or the first array of a list (None for an empty list)."""
    if hasattr(x, "shape") or hasattr(x, "__dlpack__"):
        return _arr.namespace(_arr.as_array(x))
    for v in x:
        return _arr.namespace(_arr.as_array(v))
    return None


def _check_options(layout, betas, beta3, sync_interval, c_min, c_max, eps, on_nonfinite):
    """ConfigError naming the first option of :class:`SlambRule` out of its range."""
    if layout.dtype == np.float16:
        raise ConfigError(
            "SlambRule keeps its state in the parameters' dtype, and float16 is too coarse for moments: "
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
    if on_nonfinite not in ("skip", "raise"):
        raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}")

