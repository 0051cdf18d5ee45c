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
from ..errors import ConfigError, NonFiniteError
from ..wire.layout import views
from .slamb_state import SlambState
from .tensorwise import Scratch, TensorwiseExchange, TensorwiseUpdate

__all__ = ["SlambRule", "expected_payload", "warn_if_not_sparse"]

log = logging.getLogger("slamb_comm")


class SlambRule:
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
        warn_payload: warn on rank 0 at construction when the expected bytes per step are not below a
            dense allreduce's (:func:`warn_if_not_sparse`; an adapter of several rules warns once).
        shard_group: for sharded tensors (a layout with ``shards``; docs/algorithm.md section 15): a
            transport over the ranks holding the other pieces of the same tensors (an HSDP mesh's shard
            group; ``comm`` spans the replicas). Each step sums every tensor's squared norms over it (4
            floats per tensor), so the trust ratios are the whole tensors', and agrees on a skip over it.

    One whole step is :meth:`step`. For overlapping communication with the backward pass it is
    also offered in pieces: :meth:`begin_step`; ``tensorwise.accumulate`` per tensor as its gradient
    arrives (its share of the payload, possibly into the caller's buffer); ``tensorwise.exchange``
    (or the caller's own averaging); then ``update.apply`` with the gradients and averaged values.
    """

    def __init__(self, comm, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, beta3=0.99, sync_interval=100,
                 c_min=0.01, c_max=1000.0, on_nonfinite="skip", check_options=True, shard_group=None, warn_payload=True):
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
        if warn_payload:
            warn_if_not_sparse([(comm, self.sync_interval)], "SlambRule")
        self.derived = comm.mask.kind == "cyclic"  # freshness follows from the mask's schedule
        self.t = 0  # steps committed
        self._t_open = None  # the step in progress, between begin_step and apply
        #: m, v and the stored freshness (:class:`~slamb_comm.methods.slamb_state.SlambState`)
        self.state = SlambState(comm.layout, self.derived)
        #: scratch of one tensor's size at most, for the tensor-by-tensor step
        self.scratch = Scratch()
        #: the tensor-by-tensor step (the CPU's path, and the pieces API): its exchange half
        #: (``counts``, ``picks``, ``accumulate``, ``exchange``) and its update half (``apply``)
        self.tensorwise = TensorwiseExchange(self)
        self.update = TensorwiseUpdate(self, self.tensorwise)
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
        _agree(self.comm.transport, self.layout, dict(
            betas=self.betas, eps=self.eps, beta3=self.beta3, sync_interval=self.sync_interval, c_min=self.c_min,
            c_max=self.c_max, lr=lr, weight_decay=weight_decay, on_nonfinite=self.on_nonfinite))

    def per_tensor(self, value, name):
        """``value`` (a float, or one per tensor) as one float per tensor, checked (>= 0, finite)."""
        return per_tensor(len(self.layout), value, name)

    # ------------------------------------------------------------------ state (:class:`SlambState`)
    @property
    def xp(self):
        """``numpy`` or ``cupy``: where the state lives (``None`` before the first step)."""
        return self.state.xp

    @property
    def m(self):
        """The first moment, one flat array over the layout (None before the first step)."""
        return self.state.m

    @property
    def v(self):
        """The second moment, one flat array over the layout (None before the first step)."""
        return self.state.v

    def place(self, like):
        """Allocate the state now (zeros, or what :meth:`load_state_dict` restored) in the library
        and on the device of the array ``like``, instead of at the first step."""
        like = _arr.as_array(like)
        self.state.ensure(_arr.namespace(like), like)

    @property
    def has_stored_freshness(self):
        """Whether some tensor's freshness is stored (cyclic mask: it once skipped a step), not derived."""
        return self.state.has_stored_freshness

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

    # ------------------------------------------------------------------ the step's life
    @property
    def t_open(self):
        """The step in progress (between :meth:`begin_step` and its commit), or None."""
        return self._t_open

    def begin_step(self):
        """Open step ``t + 1`` (after settling the last one) and return it."""
        self.settle()
        if self._t_open is not None:
            raise RuntimeError(f"step {self._t_open} is still open: call apply() (or abort_step()) first")
        t = self._t_open = self.t + 1
        self.opened += 1
        self.tensorwise.begin(t)
        return t

    def abort_step(self):
        """Abandon the open step: nothing it computed is kept."""
        self._t_open = None
        self._device_open = None
        self.tensorwise.reset()

    def end_step(self, t):
        """Commit step ``t``, whose update has been applied: it becomes the last step."""
        if self._t_open != t:
            raise RuntimeError(f"step {t} is not the open step ({self._t_open})")
        self.t = t
        self._t_open = None
        self.tensorwise.reset()

    def freshness(self, i=None):
        """The freshness f after the last committed step: of tensor ``i`` (shaped like it), or of
        the fused buffer (``i=None``); a host array. Derived from the mask's schedule for the
        cyclic mask (built here, O(size)); a copy of the stored state otherwise."""
        self.settle()
        return self.state.freshness(i, self.comm.mask, self.t, self.beta3)

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
        arrays, skipped = self.state.arrays()
        return {"step": self.t, **arrays, "f": self.freshness() if arrays["m"] is not None else None,
                "skipped": skipped, "comm": self.comm.state_dict()}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output exactly. The state stays on the host until the next
        step, which moves it to the device of that step's arrays (so a GPU run resumes on the
        GPU). For the cyclic mask the saved freshness is not needed (it is derived)."""
        if self._t_open is not None:
            raise RuntimeError("cannot load state in the middle of a step")
        self.device.pending = self._unreported = None  # the last step's verdict is of the state replaced
        self.comm.load_state_dict(state["comm"])
        self.t = int(state["step"])
        self.scratch.clear()
        self.state.load(state)

    def step(self, x, g, lr=None, weight_decay=None, written=None, skip=()):
        """One whole SLAMB step: ``x`` updated in place from this rank's gradient ``g``.

        ``x`` and ``g``: fused flat buffers or lists of arrays shaped like the layout (or lazily
        read sequences, with ``written`` as in ``update.apply``; ``g`` also
        :class:`~slamb_comm.device.tables.Addresses`). On a device the step runs as the kernels of
        :mod:`slamb_comm.device.slamb_step` (a constant number of device operations whatever the number of
        tensors; :attr:`fused` chooses); on the CPU tensor by tensor. ``skip``: tensors without a
        gradient on every rank (the same on every rank; see ``update.apply``); they still take part
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
                gv = views(self.layout, g)
                for i in range(len(self.layout)):
                    self.tensorwise.accumulate(i, gv[i])
            except Exception:
                self.abort_step()
                raise
            exchange = lambda: self.tensorwise.exchange(g)  # noqa: E731
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
        return self.update.apply(x, g, lr=lr, weight_decay=weight_decay, written=written, skip=skip)

    def _skip(self, e, x):
        """A step that failed on every rank for non-finite values: raise, or count and log it."""
        if self.on_nonfinite == "raise":
            raise e
        self._skipped += 1
        log.warning("slamb_comm: step %d skipped on every rank (%d skipped so far): %s",
                    self.t + 1, self._skipped, e)
        return x


def per_tensor(n, value, name):
    """``value`` (a float, or one per tensor of ``n``) as ``n`` floats, checked (>= 0, finite): ConfigError
    naming option ``name`` otherwise. No Python-level step per tensor."""
    if np.isscalar(value):
        vals = [float(value)] * n
    else:
        vals = [float(v) for v in value]
        if len(vals) != n:
            raise ConfigError(f"{name}: {len(vals)} values for {n} tensors")
    if not (math.isfinite(sum(vals)) and min(vals, default=0.0) >= 0):
        raise ConfigError(f"{name} must be finite and >= 0, got {value}")
    return vals


def _agree(transport, layout, opts):
    """Collective: ConfigError on every rank, naming the ranks that differ from rank 0 and the options they
    differ in, unless every rank has the same options ``opts`` (a dict: lr and weight_decay one value per
    tensor). One allgather of one word per option."""
    mine = np.array([np.frombuffer(layout.digest(k, v)[:8], np.int64)[0] for k, v in opts.items()], np.int64)
    everyone = np.zeros(len(mine) * transport.size, dtype=np.int64)
    transport.allgather(mine, everyone)
    everyone = everyone.reshape(transport.size, len(mine))
    differ = [r for r in range(transport.size) if not np.array_equal(everyone[r], everyone[0])]
    if differ:
        names = [k for j, k in enumerate(opts) if any(everyone[r, j] != everyone[0, j] for r in differ)]
        shown = {k: (v if not isinstance(v, list) else v[0] if len(set(v)) == 1 else v[:3] + ["..."] if len(v) > 3
                     else v) for k, v in opts.items()}  # one value per tensor: one value where they are alike
        raise ConfigError(f"SLAMB options differ between ranks: rank(s) {differ} differ from rank 0 in "
                          f"{', '.join(names)}; this is rank {transport.rank} with "
                          + ", ".join(f"{k}={shown[k]!r}" for k in names) + "; pass the same options on every rank")


def expected_payload(comm, sync_interval):
    """``(payload, dense)``: the bytes one rank hands the collectives per step, on average over a cycle
    of the mask and the periodic sync (the always-dense tensors whole, a ``ratio`` share of each
    compressible one, one status word, and every ``sync_interval`` steps the parameters), against a
    dense allreduce of the gradients (docs/algorithm.md section 4)."""
    lay = comm.layout
    comp = sum(lay.sizes[i] for i in lay.compressible)
    sent = (lay.total - comp) + comp * min(1.0, comm.ratio) + 1
    payload = sent * comm.value_dtype.itemsize + (lay.total + 1) * lay.dtype.itemsize / sync_interval
    return payload, lay.total * lay.dtype.itemsize


def warn_if_not_sparse(rules, what):
    """On rank 0, one warning when the expected bytes per step of ``rules`` (``(communicator,
    sync_interval)`` pairs) are not below a dense allreduce's, naming the fix; returns the share."""
    payload = dense = 0.0
    for comm, H in rules:
        p, d = expected_payload(comm, H)
        payload, dense = payload + p, dense + d
    share = payload / dense if dense else 0.0
    if share >= 1.0 and rules and rules[0][0].rank == 0:
        lay = [c.layout for c, _ in rules]
        small = sum(sum(1 for d in x.dense if d) for x in lay)
        log.warning(
            "slamb_comm: %s expects to send %.0f%% of a dense allreduce's bytes per step (%d of %d tensors are "
            "always sent whole: ndim <= 1 or fewer than dense_threshold=%d elements), so compression saves "
            "nothing here. Lower dense_threshold=, fuse small tensors into larger ones, raise sync_interval=, "
            "use value_dtype='float16', or use dense data parallelism (DDP) for this model.",
            what, 100 * share, small, sum(len(x) for x in lay), lay[0].dense_threshold)
    return share


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

