"""The SLAMB torch optimizer (:class:`SLAMB`, and :class:`SAdamW`, :class:`LAMB`), on the core's
:class:`slamb_comm.methods.slamb.SlambRule`.

Alone it is SLAMB with P = 1; :mod:`..distributed.optimizer` turns it into SLAMB over all ranks. It
is a configuration of :class:`~.base.BucketedOptimizer` (buckets keyed by SLAMB's options, one
Communicator and one SlambRule each, a flat buffer where ``fused`` asks); its torch state's format is
:mod:`.slamb_state`, its options :mod:`.slamb_options`.
"""

import logging
from dataclasses import replace

import torch

from slamb_comm.errors import ConfigError
from slamb_comm.exchange.communicator import Communicator
from slamb_comm.methods.slamb import SlambRule, warn_if_not_sparse
from slamb_comm.wire.layout import Layout

from ..params import run_closure
from ..tensors import Grads, Params, cuda_scope, is_dtensor
from .base import BucketedOptimizer
from .bucket import any_gradient, gradients_of
from .flat import FlatBuffer, wants_flat
from .slamb_options import check_group, knobs_of, layout_knobs, refresh_rule, requested_ratio
from .slamb_state import load_bucket, publish_bucket, replaced, with_freshness

__all__ = ["SLAMB", "SAdamW", "LAMB"]

_log = logging.getLogger("slamb_comm")


class SLAMB(BucketedOptimizer):
    r"""SLAMB (Xu et al., ICML 2023) as a ``torch.optim.Optimizer``: LAMB with sparse momentum.

    Alone (no :func:`DistributedOptimizer`), in one process, it is the SLAMB rule with
    P = 1, which is LAMB with the freshness machinery (with ``ratio=1`` exactly LAMB).
    Wrapped by a ``DistributedOptimizer`` (this module's on torch.distributed, or
    :mod:`slamb_comm.adapters.horovod`'s) it is SLAMB over all ranks:
    each rank keeps its own moments from its *local* gradient; per step only the momentum
    entries on a shared mask M_t (a ``ratio`` fraction of each large tensor, all of every
    small or 1-D tensor) are averaged over the ranks, stale entries move with a rate that
    slides from ``lr`` to ``lr / sqrt(P)`` by their freshness, and the parameters are
    averaged every ``sync_interval`` steps. The math is docs/algorithm.md section 1, computed by
    :class:`slamb_comm.methods.slamb.SlambRule` on fused flat buffers.

    Args:
        params: parameters or parameter groups, as for any torch optimizer. Every option
            below can be set per group; ``lr`` and ``weight_decay`` are read from the
            groups at every step (lr schedulers work).
        lr: learning rate (the large-batch rate of fresh elements).
        betas: ``(beta1, beta2)`` of the moments (bias-corrected).
        eps: added to ``sqrt(vhat)``.
        weight_decay: decoupled weight decay inside the LAMB direction.
        ratio: k, the fraction of each large tensor's momentum exchanged per step. Alone,
            any ratio is LAMB. Distributed, ratio 1 averages all of m every step but keeps v per
            rank and sends ``(N + 1)`` values plus the periodic sync: it is not dense LAMB (for
            that baseline use :class:`LAMB`). It may change between steps (a schedule: set ``param_group["ratio"]`` on every rank
            alike); the change applies from the next step, see :meth:`slamb_comm.methods.slamb.SlambRule.set_ratio`.
        beta3: freshness decay; stale element i moves with
            ``lr * (phi_S * f_i + phi_A * (1 - f_i) / sqrt(P))``, ``f_i = beta3 ** staleness``.
        sync_interval: H; parameters are averaged over ranks after steps 1, H+1, 2H+1, ...
        mask: ``'cyclic'`` (default; every element exchanged once every ceil(1/k) steps),
            ``'bernoulli'`` or ``'topk'`` (union of the ranks' largest momenta; its exchange
            waits for the whole backward pass).
        block: the cyclic mask's run length: 1 (default) picks single elements, as in the
            paper; a larger value picks runs of that many contiguous elements of the fused
            buffer (see :class:`slamb_comm.wire.masks.CyclicMask`).
        value_dtype: ``'float32'`` or ``'float16'`` payload of the momentum exchange
            (16 bits halve the bytes).
        c_min, c_max: clamp of the layer-wise trust ratios.
        dense_threshold: tensors with ndim <= 1 or fewer elements are exchanged whole.
        seed: seed of the shared mask; rank 0's value is used by every rank.
        on_nonfinite: ``'skip'`` (default, like AMP's grad scaler): a step with a NaN or Inf
            gradient on any rank is skipped by every rank (logged on logger ``slamb_comm``,
            counted in :attr:`skipped_steps`); ``'raise'``: every rank raises
            :class:`slamb_comm.NonFiniteError`. Either way no state changes.
        fused: ``None`` (default): buckets of CUDA parameters step as whole flat buffers, a
            constant number of kernel launches per step whatever the number of tensors
            (:mod:`slamb_comm.device.slamb_step`), CPU buckets tensor by tensor (faster there); ``True``:
            flat buffers on every device; ``False``: never. With flat buffers the parameters
            become views into one buffer per bucket and the gradients are read where they are
            (:mod:`slamb_comm.adapters.torch.optim.flat` says how and what it implies). The same
            SLAMB either way, up to float32 rounding (sums run in another order).
        transport, names, build: what :func:`~slamb_comm.adapters.torch.DistributedOptimizer`
            passes (the ranks' transport; ``id(parameter) -> name``; build the buckets now or
            let the wrapper build them); leave them out in one process.
        sharding: what :class:`~slamb_comm.adapters.torch.HybridSLAMB` passes for FSDP2's
            parameters (where each parameter's piece lies and the transport over the other
            pieces' ranks: :class:`~slamb_comm.adapters.torch.fsdp.mesh.MeshSharding`).

    Tuning: ``ratio=0.1`` and ``sync_interval=100`` are the paper's; sweep ``beta3``
    (0.9-0.999) together with ``lr``. See :mod:`slamb_comm.methods.slamb` for the full guide.

    State: per parameter ``exp_avg`` (m), ``exp_avg_sq`` (v), ``freshness`` (f) -- float32
    views (float64 for float64 parameters) into SLAMB's fused buffers, live between
    steps -- ``step`` (a float32 tensor: one per bucket, which the state of each of its parameters
    holds, so that a step moves it with one write) and ``mask_seed`` (an int64 tensor, so that a
    broadcast reaches it in place). ``state_dict()`` and ``load_state_dict()`` round-trip
    exactly, so a run resumed from every rank's own state is bitwise the run that was
    interrupted. The state exists from construction on (zeros, freshness 1, step 0), so
    ``hvd.broadcast_optimizer_state`` never needs the zero-gradient ``step()`` it uses to
    create state (and creates no ``p.grad``): it copies rank 0's state and does not advance
    the step count. After Horovod's resume idiom (only rank 0 loads a checkpoint, then
    broadcasts) every rank continues from rank 0's moments: a valid run, not bitwise the
    interrupted one; the other ranks log a warning saying so.

    Data types: float32 and float64 parameters are updated in place; float16 and bfloat16
    parameters are updated through a float32 copy and cast back (Horovod has no bfloat16;
    the exchange is float32 or float16 per ``value_dtype``). Parameters with
    ``requires_grad=False`` at construction join when they become trainable (on every rank
    alike). A parameter whose gradient is ``None`` on every rank at a step is left exactly as it
    is (no moment decay, no weight decay, no move, freshness unchanged), as torch optimizers
    and the reference code do; it still takes part in the exchange, with zeros, so no rank
    waits. Where only some ranks have its gradient, the others count it as zero (Horovod's
    convention). With the cyclic mask such a parameter's freshness is stored from then on (4
    bytes per element of that parameter), since it no longer follows the mask's schedule.
    """

    what = "SLAMB"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, ratio=0.1, beta3=0.99,
                 sync_interval=100, mask="cyclic", block=1, value_dtype="float32", c_min=0.01, c_max=1000.0,
                 dense_threshold=9000, seed=0, on_nonfinite="skip", fused=None, *, transport=None, names=None,
                 build=True, sharding=None):
        if fused not in (None, True, False):
            raise ConfigError(f"fused must be None (flat buffers on CUDA only), True or False, got {fused!r}")
        self._fused = fused
        self._payload_checked = False  # the construction's warning on the expected bytes (built())
        #: FSDP2's pieces (:class:`~slamb_comm.adapters.torch.fsdp.mesh.MeshSharding`), or None
        self.sharding = sharding
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, ratio=ratio, beta3=beta3,
            sync_interval=sync_interval, mask=mask, block=block, value_dtype=value_dtype, c_min=c_min,
            c_max=c_max, dense_threshold=dense_threshold, seed=seed, on_nonfinite=on_nonfinite,
        )
        super().__init__(params, defaults, transport=transport, names=names, build=build)

    @property
    def fused(self):
        """The ``fused`` it was built with: None (flat buffers for CUDA buckets), True or False."""
        return self._fused

    # ------------------------------------------------------------------ the configuration
    def check_group(self, group):
        """ConfigError naming the first of ``group``'s SLAMB options out of its range."""
        check_group(group)

    def knobs(self, group):
        """SLAMB's options but lr and weight decay (:func:`~.slamb_options.knobs_of`)."""
        return knobs_of(group)

    def build_bucket(self, bucket, transport):
        """One Communicator and one SlambRule over ``bucket``'s fused layout, and its flat buffer
        where ``fused`` asks (collective when distributed)."""
        e, groups = bucket, bucket.groups
        g0 = groups[0]
        e.comm = Communicator(transport, self._layout(e, int(g0["dense_threshold"])), ratio=g0["ratio"],
                              mask=g0["mask"], block=e.key.knobs.comm.block, value_dtype=g0["value_dtype"],
                              seed=g0["seed"])
        e.rule = SlambRule(e.comm, lr=[float(g["lr"]) for g in groups], betas=g0["betas"], eps=g0["eps"],
                           weight_decay=[float(g["weight_decay"]) for g in groups], beta3=g0["beta3"],
                           sync_interval=int(g0["sync_interval"]), c_min=g0["c_min"], c_max=g0["c_max"],
                           on_nonfinite=g0["on_nonfinite"], check_options=self.transport is None,
                           shard_group=None if self.sharding is None else self.sharding.group, warn_payload=False)
        kernels = wants_flat(self._fused, e.params[0].device)
        e.flat = FlatBuffer(e) if kernels and self.sharding is None else None
        # FSDP2's pieces stay where FSDP2 keeps them: the kernels read them through tables of addresses
        e.rule.fused = e.flat is not None or (kernels and self.sharding is not None)

    def built(self, buckets):
        """Distributed, at the first build: warn once (on rank 0) when the expected bytes per step of all the
        buckets are not below a dense allreduce's (:func:`slamb_comm.methods.slamb.warn_if_not_sparse`)."""
        if self.transport is not None and buckets and not self._payload_checked:
            self._payload_checked = True
            warn_if_not_sparse([(e.comm, e.rule.sync_interval) for e in buckets], type(self).__name__)

    def _layout(self, e, dense_threshold):
        """The fused layout of bucket ``e``: its parameters' shapes, or with FSDP2's parameters
        (``sharding``) their pieces' shapes, each with the whole tensor it is a piece of."""
        if self.sharding is None:
            for p, name in zip(e.params, e.names):
                if is_dtensor(p):
                    raise ConfigError(f"parameter {name!r} is a DTensor ({list(p.placements)}): SLAMB needs whole "
                                      "tensors; for a model sharded by FSDP2's fully_shard use "
                                      "slamb_comm.adapters.torch.HybridSLAMB(model, mesh)")
            return Layout([tuple(p.shape) for p in e.params], e.np_dtype, names=e.names,
                          dense_threshold=dense_threshold)
        pieces = [self.sharding.piece(p, name) for p, name in zip(e.params, e.names)]
        return Layout([pc.local_shape for pc in pieces], e.np_dtype, names=e.names, dense_threshold=dense_threshold,
                      shards=[pc.shard for pc in pieces])

    def import_state(self, bucket, raw):
        """Load ``raw`` into ``bucket`` exactly (:func:`~.slamb_state.load_bucket`), then publish it."""
        load_bucket(bucket, raw)
        self.publish(bucket)

    def publish(self, bucket):
        """Point torch's state at ``bucket``'s fused buffers (:func:`~.slamb_state.publish_bucket`)."""
        publish_bucket(bucket, self.state)

    def settle(self, bucket):
        """Whether ``bucket``'s last step, decided on the device (CUDA buckets: no host read in a
        step), was skipped there (:meth:`slamb_comm.methods.slamb.SlambRule.settle`: a read of one
        word the device wrote back, which waits only if the GPU has not reached that step yet)."""
        return bucket.rule.settle()

    def keeps_buckets(self, buckets, ages):
        """Whether a loaded checkpoint's groups and step counts fit the buckets (else rebuilt)."""
        return not (any(layout_knobs(knobs_of(g)) != layout_knobs(b.key.knobs) for b in buckets for g in b.groups)
                    or any(len({ages.get(p, 0) for p in b.params}) > 1 for b in buckets))

    def state_dict(self):
        """torch's ``state_dict()``, plus each parameter's ``freshness`` where it is derived (the
        cyclic mask): a float32 CPU tensor built here, so a checkpoint shows every element's
        freshness; it is not needed to resume."""
        sd = super().state_dict()  # the buckets settled first
        return with_freshness(sd, self.param_groups, self.buckets)

    # ------------------------------------------------------------------ before a step
    def pull(self, bucket):
        """Before a step: take in what was written into ``bucket``'s torch state since the last step
        (``hvd.broadcast_optimizer_state`` overwrites step and seed; the moment tensors are live
        views), and the options its groups say now. Returns whether the state was replaced."""
        e = bucket
        was_replaced = replaced(e, self.state)
        if was_replaced:
            if self.transport is not None:  # a local load imports at once, never here
                _log.warning(
                    "slamb_comm: SLAMB state of bucket %s was replaced from outside (a broadcast, e.g. "
                    "hvd.broadcast_optimizer_state after rank 0 loaded a checkpoint): this rank continues from "
                    "the broadcaster's moments, step %d and mask seed. That is a valid SLAMB run but not bitwise "
                    "the interrupted one, whose moments differed per rank; save and load every rank's state "
                    "(slamb_comm.methods.checkpoint) for that.", e.names[0], int(float(self.state[e.params[0]]["step"])))
            self.import_state(e, {p: self.state[p] for p in e.params})
        refresh_rule(e)
        return was_replaced

    def apply_ratio(self, bucket, problem=None):
        """Move ``bucket`` to its groups' ratio from the next step on (collective when distributed:
        every rank alike, or ConfigError/PeerError everywhere and nothing changes; ``problem``: this
        rank's own error, which the other ranks learn of)."""
        e, k = bucket, bucket.comm.ratio
        if problem is None:
            try:
                k = requested_ratio(e)
            except ConfigError as err:
                problem = err
        if problem is None:
            e.rule.set_ratio(k)
        else:  # still collective: the other ranks learn of it and raise PeerError
            e.comm.set_ratio(k, e.rule.t, problem=problem)
        knobs = e.key.knobs
        e.key = replace(e.key, knobs=replace(knobs, comm=replace(knobs.comm, ratio=e.comm.ratio)))
        self.publish(e)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One SLAMB step of every parameter (in a single process: P = 1)."""
        loss = run_closure(closure)
        buckets = self.settled_buckets()
        grads = [gradients_of(e.params) for e in buckets]  # every p.grad, read once (C level)
        for e, g in zip(buckets, grads):  # before any bucket steps: a changed parameter changes nothing
            problem = e.layout_problem(g)
            if problem is not None:
                raise problem
        for e, g in zip(buckets, grads):
            if not any_gradient(g):
                continue
            self.pull(e)
            if requested_ratio(e) != e.comm.ratio:  # a ratio schedule: from this step on
                self.apply_ratio(e)
            lr, wd = e.lr_wd()
            if e.flat is not None and e.flat.ready(g):  # flat parameters, gradients where they are
                with cuda_scope(e.params[0].device):
                    e.rule.step(e.flat.load(), e.flat.gradients(g), lr=lr, weight_decay=wd)
                e.flat.store()
            else:
                x, gs = Params(e), Grads(e)
                written = x.written
                skip = {i for i, gi in enumerate(g) if gi is None}  # left exactly as they are
                if e.rule.fused:  # FSDP2's pieces on a device: the kernels take lists of arrays
                    x, gs = [x[i] for i in range(len(x))], [gs[i] for i in range(len(gs))]
                with cuda_scope(e.params[0].device):
                    e.rule.step(x, gs, lr=lr, weight_decay=wd, written=written, skip=skip)
            self.publish(e)
        return loss


class SAdamW(SLAMB):
    r"""SLAMB's sparse momentum exchange under AdamW's update (docs/algorithm.md section 11).

    The same shared mask M_t, masked average of the first moment, freshness and periodic
    parameter sync as :class:`SLAMB`, with AdamW's step instead of LAMB's trust ratio:
    ``x -= rate_i * (m_hat / (sqrt(v_hat) + eps) + weight_decay * x)``, where an element's rate
    slides from ``lr`` (fresh) to ``lr / sqrt(P)`` (stale) by its freshness. It is SLAMB with the
    trust ratio fixed at 1 (``c_min = c_max = 1``), so everything else -- the adapters, the DDP
    hook, checkpoints, resizes, flat buffers -- is SLAMB's. Alone (P = 1) it is
    ``torch.optim.AdamW`` exactly, up to float rounding, at any ``ratio``.

    Args: as :class:`SLAMB` without ``c_min``/``c_max``; AdamW's defaults (``eps=1e-8``,
    ``weight_decay=0.01``), and ``beta3=0.9``, the setting measured against dense AdamW
    (docs/algorithm.md section 11; v stays per rank: averaging it did not help there).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, beta3=0.9, **kwargs):
        for k in ("c_min", "c_max"):
            if k in kwargs:
                raise ConfigError(f"SAdamW has no trust ratio: {k} is fixed at 1 (use SLAMB for LAMB's update)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, beta3=beta3, c_min=1.0,
                         c_max=1.0, **kwargs)


class LAMB(SLAMB):
    """Dense LAMB: the baseline SLAMB is measured against, through the same API.

    Alone it is :class:`SLAMB` at ratio 1 (LAMB, docs/algorithm.md section 1 with P = 1).
    Distributed it averages the *gradients* densely, as data-parallel LAMB does, and steps on
    the mean, so m and v are equal on every rank:

    * Horovod: ``slamb_comm.adapters.horovod.DistributedOptimizer(LAMB(...))`` returns Horovod's
      own ``hvd.DistributedOptimizer`` (one allreduce of every gradient per step);
    * torch.distributed: wrap the model in ``DistributedDataParallel`` (no comm hook) and step
      ``LAMB`` alone; :func:`slamb_comm.adapters.torch.DistributedOptimizer` refuses it, naming this.

    ``DistributedOptimizer(SLAMB(ratio=1.0))`` is not this: it keeps v per rank.

    Args: as :class:`SLAMB` without the exchange's options (``ratio``, ``beta3``,
    ``sync_interval``, ``mask``, ``block``, ``value_dtype``, ``dense_threshold``, ``seed``).
    """

    defers_problems = False  # never wrapped by the distributed optimizers: an invalid option raises at once

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, c_min=0.01, c_max=1000.0,
                 on_nonfinite="skip", fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, ratio=1.0,
                         c_min=c_min, c_max=c_max, on_nonfinite=on_nonfinite, fused=fused)
