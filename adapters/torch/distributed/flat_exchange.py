"""The device exchange of a distributed SLAMB's flat buckets, overlapped with the backward pass.

Under DDP with :func:`~slamb_comm.adapters.torch.slamb_hook`, each DDP bucket's masked momentum is
packed by the core's pack kernel (:meth:`slamb_comm.device.slamb_step.DeviceStep.pack`: the gradients read
once, in DDP's bucket, with their finiteness in the status word) and its allreduce started from
the hook, as soon as DDP hands the bucket, so the exchange overlaps the rest of the backward
pass as DDP's own allreduce does. The agreement at the end of the backward pass waits for them
and checks every status word and value (one host read per bucket of SLAMB); ``step()`` applies
the core's update kernels with the averaged payload, unless some rank changed its gradients
after the agreement (a recipe: ``GradScaler.unscale_``, ``clip_grad_norm_``): then every rank
packs and exchanges again from the gradients as they are (:meth:`abandon`, and the optimizer's
synchronous flat step).

The grouping follows DDP's buckets as the last step's hooks handed them (DDP rebuilds its
buckets after the first iteration): a step whose buckets differ, or a bucket of SLAMB whose
parameters are not all viewed in its flat buffer (16-bit or non-contiguous parameters), exchanges
from ``step()`` instead.
"""

import itertools

import numpy as np
import torch

from slamb_comm import arrays as _arr
from slamb_comm.device.tables import Addresses
from slamb_comm.errors import NonFiniteError
from slamb_comm.device.slamb_step import applies

from .. import tensors
from ..tensors import cuda_scope
from .contract import flagged_ranks, nonfinite_error

__all__ = ["FlatExchange", "runs_on_device"]


def runs_on_device(e):
    """Whether bucket ``e``'s steps are the core's device kernels: flat buffers of device arrays and
    a mask the kernels derive (:func:`slamb_comm.device.slamb_step.applies`)."""
    xp = e.rule.xp
    return e.flat is not None and xp is not None and xp is not np and applies(e.rule, e.flat.array, None, xp, ())


class _FlatStep:
    """One bucket of SLAMB's exchange in flight: its step, plan and launched groups."""

    def __init__(self, e, groups):
        self.e = e
        first = e.rule.begin_step()
        self.t = first
        with cuda_scope(e.params[0].device):
            self.plan = e.rule.device.plan(e.rule.xp, groups)
        self.handles = {}  # group -> the allreduce of its payload


class FlatExchange:
    """One step's device exchange over the flat buckets of a distributed SLAMB (see the module
    docstring). Its optimizer calls :meth:`regroup` at each agreement, :meth:`launch` from DDP's
    hook, :meth:`finish` at the agreement, then :meth:`apply` or :meth:`abandon` from ``step()``."""

    def __init__(self, coll):
        self.coll = coll
        self.grouping = {}  # bucket of SLAMB -> its tensors grouped as DDP's buckets held them last step
        self.open = {}  # bucket of SLAMB -> _FlatStep
        self.finished = False  # every launched exchange waited for and checked fine
        self.off = False  # this step's buckets did not match the grouping: it exchanges from step()
        #: a rank changed its gradients after a packed exchange (a recipe between backward() and step()):
        #: exchange from step() until a step where no rank does, as the tensor-by-tensor hooks do
        self.deferred = False
        #: after a check that failed: the ranks whose own gradients were not finite (every rank alike)
        self.ranks = []
        self._numbers = itertools.count()  # numbers the failure path's collectives (Horovod matches names)

    def regroup(self, engines, ddp_groups):
        """The grouping of the next step's exchange: per bucket of SLAMB that the device kernels step,
        its parameters' indices in each DDP bucket (in DDP's order), then those in none; without
        DDP one group of all of them."""
        order = [ddp_groups[k] for k in sorted(ddp_groups)]
        for e in engines:
            if not runs_on_device(e):
                self.grouping.pop(e, None)
                continue
            groups = [g for g in ([e.index[p] for p in grp if p in e.index] for grp in order) if g]
            rest = sorted(set(range(len(e.params))) - {i for g in groups for i in g})
            self.grouping[e] = groups + ([rest] if rest else [])

    def launch(self, e, params, grads):
        """From DDP's hook: pack bucket ``e``'s tensors ``params`` from ``grads`` (DDP's bucket
        views) and start their allreduce. Returns False, launching nothing, where they are not one
        of the groups this step packs by."""
        if self.deferred:
            return False
        groups = self.grouping.get(e)
        idx = [e.index[p] for p in params]
        if self.off or groups is None or idx not in groups or any(g.dtype != e.dtype for g in grads):
            self.abandon()
            self.off = True  # for the rest of this backward pass
            return False
        st = self.open.get(e)
        if st is None:
            st = self.open[e] = _FlatStep(e, groups)
        k = groups.index(idx)
        owners = [None] * len(e.params)
        for i, g in zip(idx, grads):
            owners[i] = g
        ptrs = tuple(0 if o is None else o.data_ptr() for o in owners)
        self._start(st, k, Addresses(ptrs, tuple(owners)), f"ddp{k}")
        return True

    def launch_ddp_bucket(self, bucket, where):
        """From DDP's hook: pack and launch the exchange of DDP ``bucket``'s parameters per bucket of
        SLAMB (``where``: parameter -> (its bucket of SLAMB, its index)). A DDP bucket that does not
        match the grouping of the last step launches nothing here (the step's agreement then drops
        what this step launched, and ``step()`` exchanges)."""
        by_bucket = {}
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if p in where:
                e, _ = where[p]
                by_bucket.setdefault(e, ([], []))
                by_bucket[e][0].append(p)
                by_bucket[e][1].append(g)
        for e, (params, grads) in by_bucket.items():
            if not self.launch(e, params, grads):
                return

    def _start(self, st, k, g, role):
        e = st.e
        with cuda_scope(e.params[0].device):
            e.rule.device.pack(st.plan, st.t, g, k, role=role)
            buf = tensors.tensor_of(e.rule.device.group_payload(st.plan, st.t, k))
        st.handles[k] = self.coll.allreduce_async(buf, f"slamb_comm.flat.{e.names[0]}.{st.t}.{k}", average=True)

    def finish(self, engines, everything=False):
        """Pack and launch what the hooks did not (from ``p.grad``), wait for every allreduce, check
        the averaged payloads: at the agreement, after the hooks (``everything``: from ``step()``,
        all of it now, with the same groups and collectives as from the hooks, so that the sums are
        the same bits). Returns None where nothing was packed (without ``everything``) or the
        buckets cannot be packed here (every rank alike: its grouping is the same everywhere), else
        the names of the tensors whose exchange was not finite on some rank (empty: fine)."""
        if not everything and (self.off or not self.open):
            self.abandon()
            self.off = False
            return None
        if not all(e in self.grouping and e.flat.ready() for e in engines):
            self.abandon()
            return None
        for e in engines:
            st = self.open.get(e) or self.open.setdefault(e, _FlatStep(e, self.grouping[e]))
            for k in [k for k in range(len(st.plan.groups)) if k not in st.handles]:
                self._start(st, k, e.flat.gradients(), "g")  # groups no hook packed: from p.grad
        bad = []
        for st in self.open.values():
            for h in st.handles.values():
                self.coll.wait(h)
            bad += self._check(st)
        self.finished = not bad
        if bad:  # which ranks: one more collective, on this failure path only
            mine = False
            for st in self.open.values():
                with cuda_scope(st.e.params[0].device):
                    mine = mine or bool(st.e.rule.device.bad_tensors(st.e.rule.xp))
            self.ranks = flagged_ranks(self.coll, mine, f"slamb_comm.flat.nonfinite.{next(self._numbers)}")
        return bad

    def runs(self, engines):
        """Whether every bucket of SLAMB goes through this exchange (the device kernels)."""
        return all(e in self.grouping for e in engines)

    def step(self, engines, again, lr_wd):
        """The optimizer's flat step. On the device kernels, the exchange packed during the backward
        pass is applied as it is, unless ``again`` (some rank changed its gradients since) or none
        was packed: then every bucket packs and exchanges now, with the groups and collectives of
        the hooks. Elsewhere (the CPU; a mask the kernels do not derive) every bucket's
        :meth:`~slamb_comm.methods.slamb.SlambRule.exchange_step`, then every bucket's update. Every bucket's
        exchange runs before any bucket changes, so that a non-finite gradient on any rank skips
        the whole step on every rank: returns that NonFiniteError, or None. ``lr_wd(e)``: the
        bucket's learning rates and weight decays now."""
        if self.runs(engines):
            if again or not self.finished:
                self.abandon()
                bad = self.finish(engines, everything=True)
                if bad:
                    self.abandon()
                    return nonfinite_error("SLAMB momentum exchange at step()", self.ranks, bad,
                                           "the step is skipped on every rank, with no state changed")
            if self.finished:
                for e in engines:
                    self.apply(e, *lr_wd(e))
                return None
        self.abandon()
        return _step_in_halves(engines, lr_wd)

    def _check(self, st):
        """One host read: whether bucket ``st``'s averaged payload is finite; the names of the
        tensors where it is not (the failure path)."""
        e, plan = st.e, st.plan
        xp = e.rule.xp
        with cuda_scope(e.params[0].device):
            arena = e.rule.device.payload(plan, st.t)
            if bool(xp.isfinite(xp.sum(arena, dtype=np.float64))):
                e.rule.device.record(plan, st.t)
                return []
            j = plan.mask.chunk(st.t) if plan.C > 1 else 0
            return [e.names[i] for i in plan.bad_tensors(j, _arr.to_host(arena))] or [e.names[0]]

    def apply(self, e, lr, wd):
        """From ``step()``: bucket ``e``'s update with its averaged payload, then its commit and
        periodic sync (the core's kernels 2 to 4)."""
        st = self.open.pop(e)
        if not self.open:
            self.finished = False
        with cuda_scope(e.params[0].device):
            x = e.flat.load()
            e.rule.device.apply(st.plan, st.t, x, e.flat.gradients(), 1.0, lr, wd)
            e.rule.device.finish(st.t, x)
        e.flat.store()

    def abandon(self):
        """Drop the step's exchange, if any: wait for what was launched (every handle is collected),
        and change nothing."""
        for st in self.open.values():
            for h in st.handles.values():
                self.coll.wait(h)
            st.e.rule.abort_step()
        self.open = {}
        self.finished = False

    @torch.no_grad()
    def poison(self):
        """After a failed check: every gradient of the buckets in flight becomes NaN, so that an AMP
        ``GradScaler`` skips the step on every rank alike; then :meth:`abandon`."""
        for st in self.open.values():
            for p in st.e.params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        self.abandon()


def _step_in_halves(engines, lr_wd):
    """Every bucket's exchange, then every bucket's update (the core's two halves of a step);
    returns the NonFiniteError that skipped the step on every rank, or None."""
    opened = []
    try:
        for e in engines:
            with cuda_scope(e.params[0].device):
                x = e.flat.load()
                e.rule.exchange_step(x, e.flat.gradients())
            opened.append((e, x))
    except NonFiniteError as err:  # raised on every rank alike: no bucket changed
        for e, _ in opened:
            e.rule.abort_step()
        return err
    except BaseException:
        for e, _ in opened:
            e.rule.abort_step()
        raise
    for e, x in opened:
        lr, wd = lr_wd(e)
        with cuda_scope(e.params[0].device):
            e.rule.apply_step(x, e.flat.gradients(), lr=lr, weight_decay=wd)
        e.flat.store()
    return None
