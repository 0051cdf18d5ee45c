"""Distributed SLAMB: the mixin of the class that ``DistributedOptimizer(SLAMB(...))`` builds.

Launches each parameter's masked momentum exchange from its gradient hook (or from
:func:`slamb_comm.adapters.torch.slamb_hook` under DDP), finishes it at the end of the backward pass
or in ``synchronize()``, redoes it when a recipe changed the gradients, and applies the update in
``step()`` (the exchange's three modes: :mod:`.slamb_exchange`). Written against the collectives
interface of :mod:`.collectives` (Horovod's in :mod:`slamb_comm.adapters.horovod`) and the public
methods of :class:`~slamb_comm.adapters.torch.optim.slamb.SLAMB`.
"""

import warnings

import torch

from ..params import run_closure
from .contract import STEP_AFTER_SYNC, DistributedMixin, grad_norms, make_contract, nonfinite_error, queue_callback
from .slamb_exchange import SlambExchange

__all__ = ["DistributedSlamb"]

_SKIPPED = "every rank's gradients were set to NaN and the step is skipped on every rank, with no state changed"


class DistributedSlamb(DistributedMixin):
    """The distributed SLAMB: with the user's :class:`SLAMB` class, the bases of the class
    :func:`DistributedOptimizer` builds around a SLAMB (``(DistributedSlamb, SLAMB)``, its ``step``
    this one's :meth:`distributed_step`); its step's exchange is a :class:`~.slamb_exchange.SlambExchange`.

    A step has two collective points, the same on every rank:

    * **The agreement, at the end of the backward pass** (a callback of torch's autograd
      engine, as DDP's own; or ``synchronize()``, or ``step()`` when no backward ran). In
      *hooks mode* each parameter's gradient hook (after ``backward_passes_per_step`` passes;
      under DDP, :func:`slamb_hook` per bucket) has updated that parameter's local moments and
      launched the asynchronous Average of its momentum on the shared mask M_t, overlapping
      the rest of the backward pass; the agreement submits zeros for parameters that got no
      gradient on this rank (so no rank waits) and finishes the exchange. In *deferred mode*
      it is one small allreduce saying whether some rank's gradient is not finite. Either
      way, when some rank's gradient is not finite every rank's gradients become NaN before
      ``backward()`` returns, so every rank's AMP ``GradScaler`` skips the step and halves
      its scale alike, and ``step()`` skips (or raises) on every rank.
    * **The step** uses the gradients as they are when ``step()`` is called. What the user
      did in between (``GradScaler.unscale_``, ``clip_grad_norm_``, any in-place change) is
      seen from the gradients' version counters: in hooks mode a one-word allreduce says
      whether any rank changed a gradient since the agreement; if so every rank recomputes
      its moments from the gradients as they are and redoes the exchange, and the optimizer
      switches to deferred mode. In deferred mode the exchange is launched from ``step()``
      itself (no overlap with the backward pass, but one exchange per step), and a step at
      which no rank changed its gradients since the agreement switches back to hooks mode.

    ``step(closure)`` calls the closure first (under ``torch.enable_grad()``), as every
    ``torch.optim`` optimizer does, and steps on the gradients it leaves. Unlike Horovod,
    ``p.grad`` is never replaced by a mean: SLAMB exchanges momenta, each rank's gradients
    stay local (clipping clips the local gradient).
    """

    def __init__(self, params, names, compression, backward_passes_per_step, coll, sum_op=False,
                 gradient_predivide_factor=1.0, fused=None):
        # A rank outside the process set optimises alone (P = 1), as Horovod's non-members do.
        super().__init__(params, fused=fused, transport=coll.transport(), names=names, build=False)
        self._exchange = None  # the step's exchange, made once the buckets are built
        self.contract = make_contract(self, coll, names, backward_passes_per_step, self._ready, self._end_of_backward,
                                      self._abandon, self._known)
        self.gradient_predivide_factor = gradient_predivide_factor
        self._hook_state = None  # the SlambHookState bound to this optimizer: DDP launches the exchange
        self.rebuild_buckets()
        self._exchange = SlambExchange(self, self.contract, gradient_predivide_factor)
        self._error = None  # an error of the end-of-backward agreement, raised at the next step()/synchronize()
        self.contract.register_hooks([p for p in self._exchange.all_params if p.requires_grad])

    def _known(self):
        """The parameters the buckets hold (for the contract's trainable flag)."""
        return {} if self._exchange is None else self._exchange.where

    def _abandon(self):
        """Wait for whatever this step launched (Horovod needs every handle collected), then drop it."""
        self._exchange.abandon()

    @property
    def _ddp(self):
        return self._hook_state is not None

    @property
    def hook_state(self):
        """The :class:`~slamb_comm.adapters.torch.SlambHookState` bound to this optimizer (DDP's
        buckets launch its exchange), or None."""
        return self._hook_state

    def attach_hook_state(self, state):
        """For :meth:`SlambHookState.bind`: from now on DDP's buckets, handed to ``slamb_hook``
        (:meth:`ddp_bucket`), launch the exchange instead of the parameters' own hooks; DDP's
        buckets come in the same order on every rank, so their collectives start at once."""
        self._hook_state = state
        self.contract.coll.immediate = True

    def rebind(self, coll, tag, transport):
        """For Elastic Horovod, after the world changed: the collectives of the new world (named by
        ``tag``, the same on every worker), its ``transport``, and the buckets rebuilt on it
        (collective; the state is kept)."""
        self.contract.rebind(coll, tag)
        self.transport = transport
        self.rebuild_buckets()
        self._exchange.rebind(coll)

    # -------------------------------------------------------------- the backward pass
    def _ready(self, p):
        """``p``'s gradient hook (Horovod's countdown); when it completes, in hooks mode, the launch
        of its exchange. Under DDP, :func:`slamb_hook` launches the exchange instead."""
        if self._ddp:
            return
        self._backward_begins()
        if self.contract.count(p) and self._exchange.in_hooks:
            self._exchange.launch(p)

    def _backward_begins(self):
        """At the first gradient hook (or DDP bucket) of a backward pass: an error of the last
        agreement not raised yet is raised now; a step that was agreed but not taken (a
        GradScaler skipped it; or ``synchronize()``, then one more backward pass) is dropped --
        it changed no state -- and this backward pass starts the step afresh."""
        c = self.contract
        if c.in_backward:
            return
        self._raise_pending()
        c.in_backward = True
        if c.agreed and (self._ddp or c.fresh):
            self._abandon()
            c.agreed = False
        self._exchange.nonfinite = None
        c.synchronized = False

    def _end_of_backward(self):
        """Queued by the first hook of a backward pass whose countdown completes: runs when the
        backward pass ends. Under DDP once more, so as to run after DDP's own end-of-backward
        callback, which copies the buckets into ``p.grad``."""
        if self._ddp:
            queue_callback(self._agree_quietly)
        else:
            self._agree_quietly()

    def _agree_quietly(self):
        """The agreement, from the autograd engine: an error is kept for the next step()."""
        try:
            self._agree()
        except Exception as err:  # noqa: BLE001 -- raised on every rank alike, from step()/synchronize()
            self._error = err

    def _agree(self):
        """This step's agreement (collective): finish the exchange launched from the hooks, or,
        in deferred mode, agree on the gradients' finiteness; then note the gradients as the
        step may use them (their versions and norms)."""
        x, c = self._exchange, self.contract
        norms = None
        flat = x.flat.finish(self.buckets) if not x.in_hooks else None
        if flat:  # the device exchange packed from DDP's hooks was not finite on some rank
            x.flat.poison()
            x.nonfinite = nonfinite_error("SLAMB momentum exchange", x.flat.ranks, flat, _SKIPPED)
        elif x.in_hooks:
            x.launch_missing()  # a parameter without a gradient takes part with zeros (its status says so)
            x.finish()
        elif flat is None:
            norms = grad_norms(c.params)  # L2: overflows where v would (a bad gradient)
            if c.agree_finite(c.params, norms):
                x.abort()
                x.nonfinite = nonfinite_error("SLAMB", *c.nonfinite, _SKIPPED)
        x.notes.take(c.params, norms)
        if x.flat_mode():
            x.flat.regroup(self.buckets, x.ddp_groups if self._ddp else {})
        c.agreed = True

    def _raise_pending(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def synchronize(self):
        """Make this step's collective decisions now, if the end of the backward pass did not
        (every rank submits every tensor): after it, a non-finite gradient on any rank has made
        every rank's gradients NaN. In hooks mode the exchange is finished here; in deferred
        mode it waits for ``step()``, which uses the gradients as they are then (clip them in
        between, under ``skip_synchronize()``, as with Horovod).

        Outside the process set there is nothing to exchange (the rank optimises alone)."""
        c = self.contract
        if not c.member:
            c.synchronized = True
            return
        self._raise_pending()
        if not c.agreed:
            self._agree()
        c.reset_countdown()
        c.synchronized = True

    # -------------------------------------------------------------- the step
    @torch.no_grad()
    def distributed_step(self, closure=None):
        """Call ``closure`` (if any) first, then exchange the momentum of the gradients as they
        are now and apply the SLAMB update (the built class's ``step``).

        Outside the process set: the single-process SLAMB step (P = 1), as Horovod's non-members
        step their optimizer on the local gradient."""
        x, c = self._exchange, self.contract
        if not c.member:
            return super().step(closure)
        loss = run_closure(closure)
        # once: a DDP module without slamb_hook, or a hook DDP never called
        c.check_ddp_once(self, x.all_params, slamb=True, hook_state=self._hook_state)
        self._raise_pending()
        if c.should_synchronize and c.synchronized:
            warnings.warn(STEP_AFTER_SYNC)
        c.synchronized = False
        flat = False
        try:
            if not c.agreed:
                self._agree()
            if x.nonfinite is None and x.flat_mode():
                flat, again = x.decide_flat()
                if flat and not x.step_flat(again):
                    flat = True  # skipped: x.nonfinite says why
                elif not flat:
                    x.flat.abandon()
            if x.nonfinite is None and not flat and (not x.in_hooks or x.changed_anywhere()):
                x.exchange_now()
        finally:
            c.agreed = False
            x.notes.clear()
        if x.nonfinite is not None:
            err, x.nonfinite = x.nonfinite, None
            c.reset_countdown()
            if any(e.rule.on_nonfinite == "raise" for e in self.buckets):
                raise err
            self.ledger.skip(err)
            return loss
        if not flat:
            x.hooks.apply(self.buckets, self.publish)
        c.reset_countdown()
        return loss

    def ddp_bucket(self, bucket):
        """:func:`slamb_hook`'s work for one DDP bucket: in hooks mode, launch the exchange of its
        parameters; the agreement follows at the end of the backward pass."""
        x = self._exchange
        self._backward_begins()
        self.contract.queue_end_of_backward()
        group = [p for p in bucket.parameters() if p in x.where]
        if group:  # keyed as DDP numbers its buckets (the same on every rank)
            key = bucket.index() if hasattr(bucket, "index") else min(x.order[p] for p in group)
            old = x.ddp_groups.get(key)
            if old is None or [id(p) for p in old] != [id(p) for p in group]:  # new, or DDP rebuilt its buckets
                mine = {id(p) for p in group}
                groups = {k: [p for p in g if id(p) not in mine] for k, g in x.ddp_groups.items()}
                x.ddp_groups = {k: g for k, g in groups.items() if g}
                x.ddp_groups[key] = group
        if x.in_hooks:
            with self.contract.coll.batch():  # the bucket's exchanges as one collective
                for p in bucket.parameters():
                    if p in x.where:
                        x.launch_once(p)
        elif group and x.flat_mode():  # the device exchange of the bucket's parameters, from here
            x.flat.launch_ddp_bucket(bucket, x.where)

    def zero_grad(self, set_to_none=True):
        """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
        ``backward()`` and ``step()``/``synchronize()``, when exchanges are in flight."""
        self.contract.check_zero_grad(self.contract.fresh)
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        """Abandon any step in flight, then restore the SLAMB state exactly."""
        x = self._exchange
        if any(x.hooks.is_open(e) for e in self.buckets):
            x.abort()
        self.contract.forget_step()
        x.notes.clear()
        x.nonfinite, self._error = None, None
        x.options_agreed = False
        super().load_state_dict(state_dict)
        x.index_params()
