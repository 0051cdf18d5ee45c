"""The SLAMB torch optimizer (:class:`SLAMB`), on the core's :class:`slamb_comm.methods.slamb.SlambRule`.

Alone it is SLAMB with P = 1; :mod:`.distributed` turns it into SLAMB over all ranks. Holds
the bucketing of parameters into (device, dtype, options, step) engines, the torch-side
state (live views into the core's fused buffers), and its exact import and export.
"""

import itertools
import logging
import operator
from dataclasses import dataclass, replace

import torch

from slamb_comm import arrays as _arr
from slamb_comm.wire.codecs import Layout, check_ratio
from slamb_comm.exchange.communicator import Communicator
from slamb_comm.errors import ConfigError
from slamb_comm.methods.slamb import SlambRule
from slamb_comm.wire.stats import Traffic, per_step
from slamb_comm.exchange.transports import LocalTransport

from .flat import Flat, wants_flat
from .options import check_group, knobs_of, layout_knobs
from .params import Engine, EngineKey, any_gradient, gradients_of, run_closure, saved_state_by_param
from .tensors import Grads, Params, as_compute, cuda_scope, is_dtensor, state_dtype, tensor_of

__all__ = ["SLAMB", "SAdamW"]

_log = logging.getLogger("slamb_comm")


_EXP_AVG = operator.methodcaller("get", "exp_avg")
_STEP = operator.methodcaller("get", "step")


@dataclass(frozen=True)
class Published:
    """What an engine's torch state was last pointed at (:meth:`SLAMB._publish`)."""

    sign: tuple  # the mask's seed, its schedule, which tensors store their freshness
    state: object  # the optimizer's ``state`` mapping written into
    entries: tuple  # each parameter's state dict, as written
    exp_avgs: tuple  # the torch state's exp_avg views
    step: torch.Tensor  # the bucket's step count, one tensor that every parameter's state holds
    m: object  # the core's m and v the views are of
    v: object
    t: int  # the step count written

    def holds(self, state):
        """Whether ``state`` (the optimizer's) still holds what was written: the same mapping, and
        in each written dict the same ``exp_avg`` and ``step`` tensors (C-level passes, no Python
        call per parameter). A dict put in place of a parameter's whole state (``opt.state[p] =
        ...``) is not seen here; torch's ``load_state_dict``, the way to replace state, is."""
        return (state is self.state and all(map(operator.is_, map(_EXP_AVG, self.entries), self.exp_avgs))
                and all(map(operator.is_, map(_STEP, self.entries), itertools.repeat(self.step))))


def _schedule(e):
    """Bucket ``e``'s ratio changes that its cyclic mask still follows, as [[chunks, step], ...]
    (integers: a checkpoint keeps them exactly, where torch would cast a float tensor to the
    parameters' dtype); None if it has had none."""
    mask = e.comm.mask
    if "schedule" not in mask.state_dict():
        return None
    return [[m.num_chunks, m.origin] for m in mask.levels()]


def _stored(rule, n):
    """Which of the ``n`` tensors of ``rule`` store their freshness (a live view is published):
    every one or none with the bernoulli and topk masks, none with the cyclic mask unless a tensor
    once skipped a step (then per tensor: the only case that asks each tensor)."""
    if not n:
        return ()
    if not rule.derived:
        return ("all", rule.stored_freshness(0) is not None)
    if not rule.has_stored_freshness:
        return ()
    return tuple(rule.stored_freshness(i) is not None for i in range(n))


class SLAMB(torch.optim.Optimizer):
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
            (:mod:`slamb_comm.adapters.torch.flat` says how and what it implies). The same
            SLAMB either way, up to float32 rounding (sums run in another order).
        transport, names, build: what :func:`~slamb_comm.adapters.torch.DistributedOptimizer`
            passes (the ranks' transport; ``id(parameter) -> name``; build the buckets now or
            let the wrapper build them); leave them out in one process.
        sharding: what :class:`~slamb_comm.adapters.torch.HybridSLAMB` passes for FSDP2's
            parameters (where each parameter's piece lies and the transport over the other
            pieces' ranks: :class:`~slamb_comm.adapters.torch.fsdp.MeshSharding`).

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

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        ratio=0.1,
        beta3=0.99,
        sync_interval=100,
        mask="cyclic",
        block=1,
        value_dtype="float32",
        c_min=0.01,
        c_max=1000.0,
        dense_threshold=9000,
        seed=0,
        on_nonfinite="skip",
        fused=None,
        *,
        transport=None,
        names=None,
        build=True,
        sharding=None,
    ):
        if fused not in (None, True, False):
            raise ConfigError(f"fused must be None (flat buffers on CUDA only), True or False, got {fused!r}")
        self._fused = fused
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, ratio=ratio, beta3=beta3,
            sync_interval=sync_interval, mask=mask, block=block, value_dtype=value_dtype, c_min=c_min,
            c_max=c_max, dense_threshold=dense_threshold, seed=seed, on_nonfinite=on_nonfinite,
        )
        check_group(defaults)
        self._engines = None  # before torch's constructor calls add_param_group
        super().__init__(params, defaults)
        for g in self.param_groups:
            check_group(g)
        self._slamb_transport = transport
        self._slamb_names = names
        self._sharding = sharding
        if build:
            self._build_engines()

    @property
    def fused(self):
        """The ``fused`` it was built with: None (flat buffers for CUDA buckets), True or False."""
        return self._fused

    def add_param_group(self, param_group):
        """Add a parameter group (options default to the constructor's); SLAMB's buckets are
        rebuilt, keeping the existing state, at the next step (collectively when distributed)."""
        super().add_param_group(param_group)
        check_group(self.param_groups[-1])
        if self._engines is not None:
            self._engines = "stale"  # rebuilt (keeping the state) at the next step

    # ------------------------------------------------------------------ engines
    def _build_engines(self, ages=None):
        """Bucket the parameters by (device, compute dtype, options, step count) and build one
        Communicator + SlambRule per bucket, keeping existing state. Collective when distributed."""
        old = getattr(self, "_built", None) or []
        saved = {p: dict(self.state[p]) for e in old for p in e.params}
        if ages is None:
            ages = {p: int(float(st["step"])) for p, st in saved.items()}
        transport = self._slamb_transport if self._slamb_transport is not None else LocalTransport()
        buckets = {}
        for gi, g in enumerate(self.param_groups):
            knobs = knobs_of(g)
            for j, p in enumerate(g["params"]):
                if not p.requires_grad:
                    continue
                dt = state_dtype(p.dtype)
                # parameters that already have state at another step (added by add_param_group)
                # cannot share a bucket, whose step count is one
                age = ages.get(p, 0)
                key = EngineKey(str(p.device), str(dt), knobs, age)
                buckets.setdefault(key, []).append((p, g, j, gi))
        engines = []
        for key, items in buckets.items():
            params = [p for p, _, _, _ in items]
            groups = [g for _, g, _, _ in items]
            names = [
                (self._slamb_names or {}).get(id(p), f"group{gi}.{j}") for p, _, j, gi in items
            ]
            e = Engine(key, params, groups, names, state_dtype(params[0].dtype))
            g0 = groups[0]
            layout = self._layout(e, int(g0["dense_threshold"]))
            e.comm = Communicator(transport, layout, ratio=g0["ratio"], mask=g0["mask"], block=e.key.knobs.comm.block,
                                  value_dtype=g0["value_dtype"], seed=g0["seed"])
            e.rule = SlambRule(e.comm, lr=[float(g["lr"]) for g in groups], betas=g0["betas"], eps=g0["eps"],
                           weight_decay=[float(g["weight_decay"]) for g in groups], beta3=g0["beta3"],
                           sync_interval=int(g0["sync_interval"]), c_min=g0["c_min"], c_max=g0["c_max"],
                           on_nonfinite=g0["on_nonfinite"], check_options=self._slamb_transport is None,
                           shard_group=None if self._sharding is None else self._sharding.group)
            kernels = wants_flat(self._fused, params[0].device)
            e.flat = Flat(e) if kernels and self._sharding is None else None
            # FSDP2's pieces stay where FSDP2 keeps them: the kernels read them through tables of addresses
            e.rule.fused = e.flat is not None or (kernels and self._sharding is not None)
            self._import_state(e, {p: saved[p] for p in params if p in saved})
            engines.append(e)
        self._engines = self._built = engines

    def _layout(self, e, dense_threshold):
        """The fused layout of bucket ``e``: its parameters' shapes, or with FSDP2's parameters
        (``sharding``) their pieces' shapes, each with the whole tensor it is a piece of."""
        if self._sharding is None:
            for p, name in zip(e.params, e.names):
                if is_dtensor(p):
                    raise ConfigError(f"parameter {name!r} is a DTensor ({list(p.placements)}): SLAMB needs whole "
                                      "tensors; for a model sharded by FSDP2's fully_shard use "
                                      "slamb_comm.adapters.torch.HybridSLAMB(model, mesh)")
            return Layout([tuple(p.shape) for p in e.params], e.np_dtype, names=e.names,
                          dense_threshold=dense_threshold)
        pieces = [self._sharding.piece(p, name) for p, name in zip(e.params, e.names)]
        return Layout([pc.local_shape for pc in pieces], e.np_dtype, names=e.names, dense_threshold=dense_threshold,
                      shards=[pc.shard for pc in pieces])

    def _ensure_engines(self):
        if not isinstance(self._engines, list):
            self._build_engines()
        return self._engines

    def _import_state(self, e, raw):
        """Load ``raw`` (param -> saved state dict) into engine ``e`` exactly; fresh state if empty.
        The state is allocated on the parameters' device and filled tensor by tensor (no fused
        host copy of the model); a saved freshness is used only where it is stored (the
        bernoulli and topk masks: the cyclic mask derives it from the step and the seed)."""
        lay = e.comm.layout
        missing = [n for p, n in zip(e.params, e.names) if p not in raw or "exp_avg" not in raw[p]]
        have = [p for p in e.params if p in raw and "exp_avg" in raw[p]]
        step, comm_state = 0, e.comm.state_dict()
        if have:
            steps = {int(float(raw[p]["step"])) for p in have}
            if len(steps) != 1 or (missing and steps != {0}):
                raise ValueError(f"the SLAMB state to load mixes step counts {sorted(steps)} in one bucket"
                                 + (f" or lacks parameter(s) {missing[:5]}" if missing else ""))
            step = steps.pop()
            comm_state["seed"] = int(raw[have[0]].get("mask_seed", comm_state["seed"]))
            sched = raw[have[0]].get("mask_schedule")
            if sched is not None and e.key.knobs.comm.mask == "cyclic":
                sched = [(int(c), int(o)) for c, o in torch.as_tensor(sched).tolist()]
                if sched[-1][0] != e.comm.mask.num_chunks:
                    raise ValueError(f"the saved mask schedule (chunks, step) {sched} ends at {sched[-1][0]} chunks, "
                                     f"but the parameter group's ratio {e.comm.ratio} makes {e.comm.mask.num_chunks}")
                ratios = [1.0 / c for c, _ in sched[:-1]] + [e.comm.ratio]  # a cyclic mask's ratio is its C
                comm_state["mask"] = dict(comm_state["mask"], schedule=[(k, o) for k, (_, o) in zip(ratios, sched)])
        e.rule.load_state_dict({"step": step, "m": None, "v": None, "f": None, "comm": comm_state})
        with cuda_scope(e.params[0].device):
            e.rule.place(torch.empty(0, dtype=e.dtype, device=e.params[0].device))
        stored = not e.rule.derived
        for p, (o, n), shape in zip(have, [lay.segments()[e.index[p]] for p in have],
                                    [lay.shapes[e.index[p]] for p in have]):
            views = [("exp_avg", e.rule.m[o:o + n]), ("exp_avg_sq", e.rule.v[o:o + n])]
            views += [("freshness", e.rule.stored_freshness(e.index[p]))] if stored else []
            for key, view in views:
                if key in raw[p]:
                    tensor_of(view).view(shape).copy_(torch.as_tensor(raw[p][key]).detach())
            if not stored and "freshness" in raw[p]:  # a tensor that once skipped a step left the schedule
                i = e.index[p]
                saved = torch.as_tensor(raw[p]["freshness"]).detach().reshape(-1).to(e.dtype).cpu()
                if not torch.equal(saved, torch.from_numpy(e.rule.freshness(i).reshape(-1))):
                    e.rule.keep_freshness(i, saved)
        e.published = None  # every entry anew (a broadcast may have written the step counts)
        self._publish(e)

    def _publish(self, e):
        """Point each parameter's torch state at the fused buffers (no copy). The freshness is a
        live view where it is stored; for the cyclic mask it is derived, and appears only in
        :meth:`state_dict`. The bucket's step count is one tensor, held by every parameter's state
        (``state_dict()`` shows it per parameter; ``torch.save`` stores it once): a step moves it
        with one in-place write, where nothing else changed (a constant number of Python calls)."""
        r = e.rule
        sched = _schedule(e)
        sign = (int(e.comm.seed), None if sched is None else tuple(map(tuple, sched)), _stored(r, len(e.params)))
        done = e.published
        if done is not None and done.sign == sign and done.m is r.m and done.v is r.v and done.holds(self.state):
            if done.t != r.t:  # the same views and options: only the step count moved (in place, as torch does)
                done.step.fill_(float(r.t))
                e.published = replace(done, t=r.t)
            return
        lay = e.comm.layout
        step = torch.tensor(float(r.t))
        for i, (p, (o, n), shape) in enumerate(zip(e.params, lay.segments(), lay.shapes)):
            st = self.state[p]
            st["step"] = step
            st["exp_avg"] = tensor_of(r.m[o:o + n]).view(shape)
            st["exp_avg_sq"] = tensor_of(r.v[o:o + n]).view(shape)
            f = r.stored_freshness(i)
            if f is None:
                st.pop("freshness", None)
            else:
                st["freshness"] = tensor_of(f).view(shape)
            # a tensor, so that hvd.broadcast_optimizer_state writes it in place like the moments
            st["mask_seed"] = torch.tensor(int(e.comm.seed), dtype=torch.int64)
            if sched is None:
                st.pop("mask_schedule", None)
            else:  # the cyclic mask's ratio changes that still decide its freshness: [(chunks, step)]
                st["mask_schedule"] = torch.tensor(sched, dtype=torch.int64)
        entries = tuple(self.state[p] for p in e.params)
        e.published = Published(sign, self.state, entries, tuple(map(_EXP_AVG, entries)), step, r.m, r.v, r.t)

    def state_dict(self):
        """torch's ``state_dict()``, plus each parameter's ``freshness`` where it is derived (the
        cyclic mask): a float32 CPU tensor built here, so a checkpoint shows every element's
        freshness; it is not needed to resume."""
        self._settle()
        sd = super().state_dict()
        index = {}
        for g in self.param_groups:
            for p in g["params"]:
                index.setdefault(id(p), len(index))
        for e in (self._engines if isinstance(self._engines, list) else []):
            if not e.rule.derived:
                continue
            for i, p in enumerate(e.params):
                k = index.get(id(p))
                if k in sd["state"] and e.rule.stored_freshness(i) is None:  # else a live view is there
                    sd["state"][k] = dict(sd["state"][k], freshness=torch.from_numpy(e.rule.freshness(i)))
        return sd

    def _pull(self, e):
        """Before a step: take in what was written into the torch state since the last step
        (``hvd.broadcast_optimizer_state`` overwrites step and seed; the moment tensors are
        live views). Also refresh the options read from the groups."""
        st = self.state[e.params[0]]
        t, seed = int(float(st["step"])), int(st["mask_seed"])
        sched = st.get("mask_schedule")
        same_schedule = (None if sched is None else sched.tolist()) == _schedule(e)
        if t != e.rule.t or seed != e.comm.seed or not self._same_views(e, st) or not same_schedule:
            if self._slamb_transport is not None:  # a local load imports at once, never here
                _log.warning(
                    "slamb_comm: SLAMB state of bucket %s was replaced from outside (a broadcast, e.g. "
                    "hvd.broadcast_optimizer_state after rank 0 loaded a checkpoint): this rank continues from "
                    "the broadcaster's moments, step %d and mask seed. That is a valid SLAMB run but not bitwise "
                    "the interrupted one, whose moments differed per rank; save and load every rank's state "
                    "(slamb_comm.methods.checkpoint) for that.", e.names[0], t)
            self._import_state(e, {p: self.state[p] for p in e.params})
            self._options_agreed = False
        groups = e.unique_groups  # each group once, not once per parameter
        rule_k = knobs_of(groups[0]).rule
        for g in groups[1:]:
            if knobs_of(g).rule != rule_k:
                raise ConfigError("parameter groups that share a SLAMB bucket now disagree on betas/eps/beta3/"
                                  "sync_interval/c_min/c_max; change them for every group at once")
        for g in groups:
            c, built = knobs_of(g).comm, e.key.knobs.comm
            if c.fixed != built.fixed:
                raise ConfigError("mask, value_dtype, dense_threshold and block are fixed at construction "
                                  f"(built with {built.fixed}, the group now says {c.fixed}); the ratio may change")
        self._requested_ratio(e)
        r = e.rule
        r.betas, r.eps, r.beta3, r.sync_interval = rule_k.betas, rule_k.eps, rule_k.beta3, rule_k.sync_interval
        r.c_min, r.c_max, r.on_nonfinite = rule_k.c_min, rule_k.c_max, rule_k.on_nonfinite

    @staticmethod
    def _same_views(e, st):
        """Whether ``st`` (the first parameter's state) still holds a view of bucket ``e``'s m: the
        tensor published (no conversion), else one at the same address."""
        r, done = e.rule, e.published
        if not r.m.size:
            return True
        views = st.get("exp_avg")
        if done is not None and done.m is r.m and views is done.exp_avgs[0]:
            return True
        return views is not None and views.data_ptr() == tensor_of(r.m[:1]).data_ptr()

    def _requested_ratio(self, e):
        """The ratio the bucket's parameter groups ask for now (a schedule may have changed it);
        ConfigError if groups that share the bucket disagree."""
        asked = {check_ratio(g["ratio"]) for g in e.unique_groups}
        if len(asked) != 1:
            raise ConfigError(f"parameter groups that share a SLAMB bucket ask for different ratios {sorted(asked)}; "
                              "change the ratio of every group of the bucket at once")
        return asked.pop()

    def _set_ratio(self, e, problem=None):
        """Move bucket ``e`` to its groups' ratio from the next step on (collective when
        distributed: every rank alike, or ConfigError/PeerError everywhere and nothing changes)."""
        k = e.comm.ratio
        if problem is None:
            try:
                k = self._requested_ratio(e)
            except ConfigError as err:
                problem = err
        if problem is None:
            e.rule.set_ratio(k)
        else:  # still collective: the other ranks learn of it and raise PeerError
            e.comm.set_ratio(k, e.rule.t, problem=problem)
        knobs = e.key.knobs
        e.key = replace(e.key, knobs=replace(knobs, comm=replace(knobs.comm, ratio=e.comm.ratio)))
        self._publish(e)

    def _lr_wd(self, e):
        """Bucket ``e``'s learning rate and weight decay now: a float each where its groups agree,
        else one per tensor (read per group, spread at C level)."""
        lr = [float(g["lr"]) for g in e.unique_groups]
        wd = [float(g["weight_decay"]) for g in e.unique_groups]
        return tuple(v[0] if len(set(v)) == 1 else list(map(v.__getitem__, e.group_of)) for v in (lr, wd))

    def _grad_array(self, p, e):
        if p.grad is None:
            return _arr.as_array(torch.zeros(p.shape, dtype=e.dtype, device=p.device)), None
        g = as_compute(p.grad, e.dtype)
        return _arr.as_array(g), g

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One SLAMB step of every parameter (in a single process: P = 1)."""
        loss = run_closure(closure)
        engines = self._settle()
        grads = [gradients_of(e.params) for e in engines]  # every p.grad, read once (C level)
        for e, g in zip(engines, grads):  # before any bucket steps: a changed parameter changes nothing
            problem = e.layout_problem(g)
            if problem is not None:
                raise problem
        for e, g in zip(engines, grads):
            if not any_gradient(g):
                continue
            self._pull(e)
            if self._requested_ratio(e) != e.comm.ratio:  # a ratio schedule: from this step on
                self._set_ratio(e)
            lr, wd = self._lr_wd(e)
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
            self._publish(e)
        return loss

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output exactly (moments stay in their saved precision)."""
        self._options_agreed = False
        raw = saved_state_by_param(self, state_dict)
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            check_group(g)
        engines = self._ensure_engines()
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for e in engines:  # torch's load made new group dicts: read options (an lr schedule's) from those
            e.groups = [group_of[p] for p in e.params]
        ages = {p: int(float(st["step"])) for p, st in raw.items() if "step" in st}
        if any(layout_knobs(knobs_of(g)) != layout_knobs(e.key.knobs) for e in engines for g in e.groups) or any(
            len({ages.get(p, 0) for p in e.params}) > 1 for e in engines
        ):
            self._build_engines(ages)  # the checkpoint's buckets differ from ours
            engines = self._engines
        for e in engines:
            self._import_state(e, {p: raw[p] for p in e.params if p in raw})
        self._traffic_t = max((e.rule.t + e.rule.skipped_steps for e in engines), default=0)

    # ------------------------------------------------------------------ statistics
    def steps_taken(self):
        """The steps its buckets have taken so far (the most of any bucket; 0 for a new optimizer)."""
        return max((e.rule.t for e in self._settle()), default=0)

    @property
    def skipped_steps(self):
        """Steps skipped (on every rank alike) for non-finite gradients, with ``on_nonfinite='skip'``."""
        return max((e.rule.skipped_steps for e in self._settle()), default=0)

    def _settle(self):
        """The buckets, each told whether its last step, decided on the device (CUDA buckets: no host
        read in a step), was skipped there, and its torch state's step count put right if it was
        (:meth:`slamb_comm.methods.slamb.SlambRule.settle`: a read of one word the device wrote back,
        which waits only if the GPU has not reached that step's exchange yet)."""
        engines = self._ensure_engines()
        for e in engines:
            if e.rule.settle():
                self._publish(e)
        return engines

    @property
    def communicators(self):
        """The :class:`slamb_comm.Communicator` of every parameter bucket (for statistics)."""
        return [e.comm for e in self._ensure_engines()]

    def step_traffic(self):
        """Bytes of every step since the last call (or since construction or the last
        ``load_state_dict``), summed over buckets, and start counting anew: a
        :class:`slamb_comm.Traffic` whose ``payload_bytes`` / ``dense_payload_bytes`` read as
        "these steps moved x of the y bytes a dense allreduce of the gradients would have" --
        one dense allreduce per step taken, also on a periodic sync step, which sends the masked
        momentum and the parameters (docs/algorithm.md section 4). Called once per step, it is
        that step's bytes. The framework adapters call it at every step and keep the result
        (``last_traffic``), so under them read that instead."""
        total, dense, size = Traffic(), 0, 1
        for c in self.communicators:
            total = total + c.stats.new_step()
            dense += c.layout.total * c.layout.dtype.itemsize
            size = c.size
        return per_step(total, dense, size, self._steps_since_traffic())

    def _steps_since_traffic(self):
        """Steps taken (or skipped on every rank, which still sent) since the last
        :meth:`step_traffic` call, or since construction or the last ``load_state_dict``."""
        engines = self._ensure_engines() if hasattr(self, "_ensure_engines") else self._engines  # OneBitLAMB's too
        now = max((e.rule.t + e.rule.skipped_steps for e in engines), default=0)
        last, self._traffic_t = getattr(self, "_traffic_t", 0), now
        return max(now - last, 0)


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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, c_min=0.01, c_max=1000.0,
                 on_nonfinite="skip", fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, ratio=1.0,
                         c_min=c_min, c_max=c_max, on_nonfinite=on_nonfinite, fused=fused)
