"""HybridSLAMB's momentum exchange started during the backward pass: :class:`FsdpOverlap` (issue 35).

**What FSDP2 allows** (torch 2.13, checked under torchrun with gloo on CPU ranks). Each FSDP module's
``post_backward`` reduce-scatters its parameters' gradients in one flat tensor, then:

* calls the module's ``set_all_reduce_hook`` hook with that flat output (this rank's pieces, in
  FSDP2's padded layout) *before* it divides it by its post-divide factor and before it assigns the
  parameters' sharded ``.grad`` (a module's ``.grad`` are readable only at the next module's hook);
* then assigns each parameter's ``.grad`` (a DTensor viewing that output) and, right after, calls the
  sharded parameter's post-accumulate-grad hooks (``register_post_accumulate_grad_hook``): the first
  point where a parameter's gradient piece is final and readable. On a GPU FSDP2 runs both hooks on
  its reduce-scatter (or all-reduce) stream.

The modules whose inputs need no gradient (the first layer, the root) run their ``post_backward``
from FSDP2's end-of-backward callback, which is queued before any callback of ours, so they too come
before our end of the backward pass. With ``set_requires_gradient_sync(False)`` a backward pass
reduces nothing and calls no hook; a replica whose modules got no gradient calls no hook either (so
the replicas' hooks differ). A second backward pass with the sync on adds into ``.grad`` in place.
``GradScaler.unscale_``, ``clip_grad_norm_`` and in-place ops on the DTensor gradient do not bump the
local piece's version counter (the DTensor's own counter moves for ``grad.mul_`` only): a change of
the gradients is seen from their values (one sum of squares per piece), not from version counters.

**What this module does.** :class:`FsdpOverlap` registers a post-accumulate-grad hook on every
sharded parameter. Its tensors are grouped into *units*: one FSDP module's tensors of one SLAMB bucket
(the modules in reverse registration order, the usual backward order; then the tensors no FSDP module
holds). At the first hook of a step every bucket's step opens (``SlambRule.begin_step``); each hook
writes its tensor's new momentum on M_t into that unit's slice of a payload buffer
(``SlambRule.tensorwise.accumulate(i, g, out=...)``), and a unit whose tensors are all in starts its allreduce over
the replicas (``async_op=True``), units strictly in order, so that every replica issues the same
collectives in the same order. The end of the backward pass (:class:`~.mesh.BackwardWatch`'s callback)
takes the tensors no hook delivered (zeros where this rank has no gradient) and starts the rest.

``step()`` waits, then one agreement over the whole mesh (the replicas, then the pieces) says which
gradients exist, plus one word: *some rank cannot use its overlapped exchange* (its gradients changed
after they were taken, a second backward pass added to them, one was not finite or too large for v,
the summed payload is not finite, an option or the optimizer's state changed since). If no rank says
so, every rank applies the averaged payload (``SlambRule.update.apply(..., means=...)``); else every rank
drops it and exchanges again from the gradients as they are (the bytes sent twice, both counted), and
the following steps exchange from ``step()`` only (*deferred*, as under DDP) until a step where no
rank changed its gradients after its single backward pass. Off (today's exchange in ``step()``) where
the pieces are not NumPy arrays tensor by tensor (CUDA, the device kernels), for the topk mask (its
payload needs every gradient), and unless ``HybridSLAMB(..., overlap=True)`` (off by default: on this
2-core machine's emulated nodes it did not shorten the step at 1 or 10 Gbit/s, since the work it moves
into the backward pass competes for the same cores, and shortened it by 13% at 100 Mbit/s:
``benchmarks/hsdp.py time``, benchmarks/RESULTS.md).
"""

import time
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from slamb_comm import arrays as _arr
from slamb_comm.errors import ConfigError

from ...privates import version_of
from ..optim.slamb_options import RuleKnobs, knobs_of
from ..params import param_changed
from ..tensors import Grads, Params, local_of, tensor_of, torch_dtype

__all__ = ["FsdpOverlap", "OptimizerSide", "OverlapReport", "OVERLAP", "DEFERRED", "OFF"]

OVERLAP, DEFERRED, OFF = "overlap", "deferred", "off"


class OptimizerSide(NamedTuple):
    """What the overlap needs of its optimizer, handed over at construction (it writes none of its state)."""

    engines: Callable  # () -> its buckets now (a list; anything else while they are to be rebuilt)
    lr_wd: Callable  # bucket -> (its learning rates, its weight decays) now
    publish: Callable  # bucket -> None: point the torch state at the bucket's state after its step


class OverlapReport(NamedTuple):
    """How the last step exchanged: ``mode`` it ran in (``"overlap"``, ``"deferred"``, ``"off"``),
    ``units`` (allreduces per step in overlap mode), ``early`` (units started before the end of the
    backward pass), ``applied`` (the overlapped exchange was used), ``fell_back`` (it was started and
    dropped: its bytes were sent twice)."""

    mode: str
    units: int
    early: int
    applied: bool
    fell_back: bool


class GradNote(NamedTuple):
    """A gradient piece as it was taken: the tensor, its two version counters and its sum of squares
    (None for a parameter without a gradient)."""

    grad: Any
    version: int
    local_version: int
    sumsq: float


class Unit(NamedTuple):
    """One allreduce of the overlapped exchange: tensors ``tensors`` (indices) of bucket ``engine``."""

    engine: Any
    tensors: tuple


class UnitPlan:
    """The units of a list of buckets, in launch order, and where each parameter is."""

    def __init__(self, engines, modules):
        self.engines = engines
        self.units = []
        held = set()
        for params in modules:
            held.update(params)
            for e in engines:
                idx = tuple(i for i, p in enumerate(e.params) if p in params)
                if idx:
                    self.units.append(Unit(e, idx))
        for e in engines:  # tensors no FSDP module holds: the end of the backward pass takes them
            idx = tuple(i for i, p in enumerate(e.params) if p not in held)
            if idx:
                self.units.append(Unit(e, idx))
        #: parameter -> (its unit's index, its bucket, its index there)
        self.where = {u.engine.params[i]: (k, u.engine, i) for k, u in enumerate(self.units) for i in u.tensors}


class _OverlapStep:
    """The step in flight: every bucket's payload buffer and each tensor's slice of it, what each unit
    still waits for, the launched allreduces and what was taken of the gradients."""

    def __init__(self, plan):
        self.plan, self.spans, self.buf, self.slices = plan, {}, {}, []
        opened = []
        try:
            for e in plan.engines:
                e.rule.begin_step()
                opened.append(e)
        except BaseException:
            for e in opened:
                e.rule.abort_step()
            raise
        counts = {e: e.rule.tensorwise.counts() for e in plan.engines}
        ends = {e: 0 for e in plan.engines}
        for u in plan.units:
            e, start = u.engine, ends[u.engine]
            spans = self.spans.setdefault(e, {})
            for i in u.tensors:
                spans[i] = (ends[e], counts[e][i])
                ends[e] += counts[e][i]
            self.slices.append((start, ends[e]))
        for e in plan.engines:
            self.buf[e] = torch.empty(ends[e], dtype=torch_dtype(e.comm.value_dtype))
        self.grads = {e: Grads(e) for e in plan.engines}
        self.left = [len(u.tensors) for u in plan.units]
        self.handles = [None] * len(plan.units)
        self.next = 0  # the next unit to launch (units go strictly in order)
        self.notes = {}  # parameter -> GradNote (or None: no gradient here) when taken
        # a gradient taken was not finite (or too large for v); a hook came after every unit had started
        # (a later backward pass); the core refused a gradient
        self.bad = self.late = self.failed = False
        self.passes = 0  # backward passes that reduced gradients since the step opened
        self.early = None  # units launched when the end of the first backward pass came
        self.encode_s = [0.0] * len(plan.units)


def _sumsq(a):
    """The sum of squares of array ``a`` (one BLAS pass; the same bits for the same values)."""
    v = a.reshape(-1)
    return float(np.dot(v, v))


def _note(p, a):
    """``p``'s gradient as it is now, ``a`` being its piece as the core reads it."""
    g = p.grad
    if g is None:
        return None
    return GradNote(g, version_of(g), version_of(local_of(g)), _sumsq(a))  # autograd's counters


def _same(note, p, e, i):
    """Whether ``p``'s gradient is still the one ``note`` took (identity, counters, then values)."""
    g = p.grad
    if note is None or g is None:
        return note is None and g is None
    if g is not note.grad or version_of(g) != note.version or version_of(local_of(g)) != note.local_version:
        return False
    return _sumsq(Grads(e)[i]) == note.sumsq  # NaN: not the same (a poisoned or non-finite gradient falls back)


def _state_as_left(state, e):
    """Whether bucket ``e``'s torch state is as its optimizer left it (nothing loaded or broadcast
    into it since the last step), and its groups' options are those its rule holds."""
    st = state.get(e.params[0], {})
    if "step" not in st or int(float(st["step"])) != e.rule.t or int(st["mask_seed"]) != e.comm.seed:
        return False
    if e.rule.m.size and st["exp_avg"].data_ptr() != tensor_of(e.rule.m[:1]).data_ptr():
        return False
    r = e.rule
    held = RuleKnobs(r.betas, r.eps, r.beta3, r.sync_interval, r.c_min, r.c_max, r.on_nonfinite)
    for g in {id(g): g for g in e.groups}.values():
        try:
            k = knobs_of(g)
        except ConfigError:  # the exchange in step() raises it
            return False
        if k.rule != held or k.comm.ratio != e.comm.ratio or k.comm.fixed != e.key.knobs.comm.fixed:
            return False
    return all(param_changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype) is None
               for i, p in enumerate(e.params))


def applies(engines):
    """Whether the overlap can run for these buckets: NumPy arrays tensor by tensor, masks whose
    payload is known before the exchange (cyclic, bernoulli)."""
    return isinstance(engines, list) and bool(engines) and all(
        e.rule.xp is np and not e.rule.fused and e.comm.mask.kind != "topk" and e.params[0].device.type == "cpu"
        for e in engines)


class FsdpOverlap:
    """The overlapped exchange of a :class:`~.hybrid_slamb.HybridSLAMB` (see the module docstring).

    Args:
        model: the sharded model (its FSDP modules and parameters).
        sharding: the optimizer's :class:`~.mesh.MeshSharding` (the replicas' group).
        side: :class:`OptimizerSide`.
        enabled: ``HybridSLAMB(..., overlap=)``; False: never.

    The optimizer calls :meth:`ready` with its buckets once built and after every step,
    :meth:`end_of_backward` at the end of every backward pass that reduced gradients, then in
    ``step()`` :meth:`conclude`, the agreement, :meth:`decide`, then :meth:`apply` or :meth:`abandon`
    (and its own exchange).
    """

    def __init__(self, model, sharding, side, enabled=True):
        self.side, self.R, self.group = side, sharding.R, sharding.replicas_group
        self.enabled = enabled
        fsdp = [m for m in model.modules() if hasattr(m, "set_all_reduce_hook")]
        held, self._modules = set(), []
        for m in reversed(fsdp):  # the usual backward order; a module's own parameters (not its FSDP children's)
            own = {p for p in m.parameters() if p not in held}
            held |= own
            self._modules.append(own)
        # hooked when the overlap first applies (not on a model it never runs for: FSDP2 then keeps its
        # CPU offload's copies of the gradients asynchronous)
        self._unhooked = [p for p in model.parameters() if p in held]
        self.mode, self.plan, self._step = OFF, None, None
        self._notes, self._passes = {}, 0  # deferred mode: the gradients at the end of the last backward pass
        #: how the last step exchanged (:class:`OverlapReport`)
        self.last = OverlapReport(OFF, 0, 0, False, False)

    @property
    def launched(self):
        """The units of the step in flight whose allreduce has started."""
        return 0 if self._step is None else self._step.next

    def ready(self, engines):
        """After a step (and at construction): the units for ``engines``, the optimizer's buckets; off
        where the overlap does not apply to them."""
        if not (self.enabled and applies(engines)):
            self.mode, self.plan = OFF, None
            return
        if self.plan is None or self.plan.engines is not engines:
            self.plan = UnitPlan(engines, self._modules)
        if self.mode == OFF:
            self.mode = OVERLAP
        for p in self._unhooked:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)  # FSDP2 calls it once p.grad is assigned
        self._unhooked = []

    # ------------------------------------------------------------------ during the backward pass
    @torch.no_grad()
    def _on_grad(self, p):
        """FSDP2's post-accumulate-grad hook: ``p.grad``, this rank's piece, is final."""
        if self.mode != OVERLAP:
            return
        st = self._current()
        if st is None or p not in st.plan.where:
            return
        if st.next == len(st.plan.units) or p in st.notes:  # a later backward pass adds to the gradients
            st.late = True
            return
        k, e, i = st.plan.where[p]
        self._take(st, k, e, i, p)
        st.left[k] -= 1
        self._launch_ready(st)

    def end_of_backward(self):
        """At the end of a backward pass that reduced gradients (before ``backward()`` returns): the
        tensors no hook delivered are taken and every unit not yet started starts; in deferred mode
        the gradients are noted instead."""
        if self.mode == DEFERRED:
            self._passes += 1
            self._notes = {p: _note(p, Grads(e)[i]) if p.grad is not None else None
                           for p, (_, e, i) in self.plan.where.items()}
            return
        if self.mode != OVERLAP:
            return
        st = self._current()
        if st is None:
            return
        st.passes += 1
        if st.early is None:
            st.early = st.next
        self._launch_all(st)

    def _current(self):
        """The step in flight, opened at the first call of a step (None where the overlap went off):
        with new units if the optimizer rebuilt its buckets since the last step (a load), as every
        rank does at the same point."""
        if self._step is None:
            self.ready(self.side.engines())
            if self.mode != OVERLAP:
                return None
            self._step = _OverlapStep(self.plan)
        return self._step

    def _take(self, st, k, e, i, p):
        """Tensor ``i`` of bucket ``e`` (parameter ``p``): its new momentum on M_t into its slice."""
        t0 = time.perf_counter()
        s, c = st.spans[e][i]
        try:
            a = st.grads[e][i]  # zeros where this rank has no gradient
            bad = e.rule.tensorwise.accumulate(i, a, out=_arr.as_array(st.buf[e][s:s + c]))
        except Exception:  # noqa: BLE001 -- e.g. a gradient that no longer fits its bucket: the slice is sent
            st.buf[e][s:s + c].zero_()  # as zeros, step() falls back and its own exchange raises the error
            st.failed, st.notes[p] = True, None
        else:
            st.bad = st.bad or bool(bad)
            st.notes[p] = _note(p, a)
        st.encode_s[k] += time.perf_counter() - t0

    def _launch_ready(self, st):
        """Start the allreduce of every unit, in order, whose tensors are all taken."""
        while st.next < len(st.left) and st.left[st.next] == 0:
            a, b = st.slices[st.next]
            if b > a:  # a unit with no element on M_t this step sends nothing (the same on every replica)
                buf = st.buf[st.plan.units[st.next].engine][a:b]
                st.handles[st.next] = dist.all_reduce(buf, group=self.group, async_op=True)
            st.next += 1

    def _launch_all(self, st):
        """Take every tensor not yet taken and start every unit not yet started."""
        for k, u in enumerate(st.plan.units[st.next:], start=st.next):
            for i in u.tensors:
                p = u.engine.params[i]
                if p not in st.notes:
                    self._take(st, k, u.engine, i, p)
            st.left[k] = 0
        self._launch_ready(st)

    # ------------------------------------------------------------------ in step()
    def conclude(self, engines, state):
        """This rank's word for the step's agreement, or None where the overlap is off (no word is
        sent): True where this rank cannot use the overlapped exchange (deferred mode: could not
        have). In overlap mode every unit is started (every rank starts each once per step, so that
        the replicas' collectives match), waited for and counted. ``engines``: the optimizer's
        buckets now; ``state``: its torch state (read only)."""
        if self.mode == OFF:
            return None
        if self.mode == DEFERRED:
            notes, passes, self._notes, self._passes = self._notes, self._passes, {}, 0
            return (passes != 1 or not self._unchanged(notes, self.plan)
                    or not self._as_left(engines, state, self.plan))
        st = self._current()
        if st is None:
            return None
        self._launch_all(st)
        finite = True
        for k, (u, h) in enumerate(zip(st.plan.units, st.handles)):
            t0 = time.perf_counter()
            if h is not None:
                h.wait()
            a, b = st.slices[k]
            buf = st.buf[u.engine][a:b]
            finite = finite and bool(torch.isfinite(buf).all())
            u.engine.comm.record_masked_allreduce(buf.numel() * buf.element_size(), b - a, st.encode_s[k],
                                                  time.perf_counter() - t0)
        usable = (finite and not (st.bad or st.late or st.failed) and st.passes == 1
                  and self._unchanged(st.notes, st.plan) and self._as_left(engines, state, st.plan))
        return not usable

    @staticmethod
    def _unchanged(notes, plan):
        """Whether every gradient noted in ``notes`` is still as it was then."""
        return all(_same(note, p, *plan.where[p][1:]) for p, note in notes.items())

    @staticmethod
    def _as_left(engines, state, plan):
        """Whether the buckets, their options and their state are those the step was opened with."""
        return engines is plan.engines and all(_state_as_left(state, e) for e in engines)

    def decide(self, anywhere):
        """After the agreement: ``anywhere``, whether some rank said it cannot use the overlapped
        exchange. Sets the next step's mode and :attr:`last`; returns whether to :meth:`apply`."""
        mode, st = self.mode, self._step
        go = mode == OVERLAP and not anywhere
        if mode != OFF:
            self.mode = DEFERRED if anywhere else OVERLAP
        units = 0 if self.plan is None else len(self.plan.units)
        early = 0 if st is None or st.early is None else st.early
        self.last = OverlapReport(mode, units if mode == OVERLAP else 0, early, go, mode == OVERLAP and not go)
        return go

    @torch.no_grad()
    def apply(self, have):
        """Every bucket's update from the averaged payload. ``have``: parameter -> whether some rank
        has its gradient (the others count it as zero; nowhere: left as it is)."""
        st, self._step = self._step, None
        engines = list(st.plan.engines)
        try:
            while engines:
                e = engines[0]
                skip = {i for i, p in enumerate(e.params) if not have.get(p, False)}
                if len(skip) == len(e.params):  # no gradient anywhere in the bucket: no step
                    e.rule.abort_step()
                else:
                    lr, wd = self.side.lr_wd(e)
                    x = Params(e)
                    e.rule.update.apply(x, Grads(e), means=self._means(st, e), lr=lr, weight_decay=wd, written=x.written,
                                 skip=skip)  # raises NonFiniteError on every rank alike (its periodic sync)
                    self.side.publish(e)
                engines.pop(0)
        finally:
            for e in engines:  # a bucket raised: no step stays open (aborting a committed one changes nothing)
                e.rule.abort_step()

    def _means(self, st, e):
        """Per tensor, the mean over the replicas of its payload: the sum times ``1 / R`` in the
        update's dtype, as the core scales its own exchange's sums (the same bits)."""
        wide = np.promote_types(np.dtype(e.comm.value_dtype), e.comm.layout.dtype)
        sums = st.buf[e].numpy()
        means = sums if sums.dtype == wide else sums.astype(wide)  # in place where no cast is needed
        means *= wide.type(1.0 / self.R)
        return [means[s:s + c] for s, c in (st.spans[e][i] for i in range(len(e.params)))]

    def abandon(self):
        """Drop the step in flight, if any: wait for what it started, abort every bucket's open step."""
        st, self._step = self._step, None
        if st is None:
            return
        for h in st.handles:
            if h is not None:
                h.wait()
        for e in st.plan.engines:
            e.rule.abort_step()
