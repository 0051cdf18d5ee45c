"""The distributed SLAMB's exchange of one step, in its three modes: :class:`SlambExchange`.

* **Hooks mode**: each parameter's gradient hook (or, under DDP, ``slamb_hook`` per DDP bucket)
  launches its masked momentum exchange (:class:`~.hook_exchange.HookExchange`), overlapping the
  rest of the backward pass; the agreement at its end finishes it.
* **Deferred mode**: after a recipe changed the gradients between ``backward()`` and ``step()``,
  the exchange is launched from ``step()`` itself, until a step where no rank changed them.
* **Flat mode** (SLAMB's ``fused``): every bucket's step, exchange included, is the core's
  whole-buffer one (:class:`~.flat_exchange.FlatExchange`), packed from DDP's hooks where it can be.

:class:`SlambExchange` owns the step's exchanges and what a step decides collectively (a new ratio,
parameters that became trainable, a parameter or option that changed on some rank, a non-finite
gradient); :class:`~.slamb.DistributedSlamb`, the optimizer, drives it. It reaches the optimizer's
buckets through the public methods of :class:`~slamb_comm.adapters.torch.optim.slamb.SLAMB`.
"""

import itertools
from typing import NamedTuple

import torch

from slamb_comm.errors import ConfigError, PeerError

from ..optim.slamb_options import requested_ratio
from ..params import param_changed, params_changed
from ..tensors import grad_array
from .contract import GradientNotes, flagged_ranks, nonfinite_error
from .flat_exchange import FlatExchange
from .hook_exchange import HookExchange

__all__ = ["SlambExchange", "HookWords", "FlatWords"]


class HookWords(NamedTuple):
    """The words summed with the step's flag in hooks and deferred mode, over the ranks."""

    rerate: int  # ranks whose groups ask for a new ratio (a schedule)
    changed: int  # deferred mode: ranks that changed a gradient since the agreement


class FlatWords(NamedTuple):
    """The words summed with the step's flag in flat mode, over the ranks."""

    rerate: int  # ranks whose groups ask for a new ratio
    changed: int  # ranks with a parameter or a fixed option that changed since construction
    unready: int  # ranks with a parameter without a dense gradient (the step goes tensor by tensor)
    regrad: int  # ranks that changed a gradient since the exchange was packed (it is packed again)


class SlambExchange:
    """One distributed SLAMB optimizer's step exchange (see the module docstring).

    Args:
        opt: the distributed SLAMB optimizer (its buckets, state and groups).
        contract: its :class:`~.contract.Contract` (the collectives, the countdown, the flag).
        predivide: Horovod's ``gradient_predivide_factor``.
    """

    def __init__(self, opt, contract, predivide=1.0):
        self.opt, self.contract, self.predivide = opt, contract, predivide
        self.hooks = HookExchange(contract.coll, predivide)  # tensor by tensor, from the hooks
        self.flat = FlatExchange(contract.coll)  # flat buckets on a device, from DDP's hooks
        self.notes = GradientNotes()  # the gradients as the agreement saw them
        self.where, self.order = {}, {}  # parameter -> (its bucket, its index there); its place in bucket order
        self.ddp_groups = {}  # DDP bucket index -> its parameters, as DDP's hook last handed them
        self.problem = None  # this rank's LayoutError/ConfigError of the open step, sent as a NaN status
        self.nonfinite = None  # the agreed NonFiniteError of this step, if some rank's gradient was not finite
        self.words = HookWords(0, 0)  # the last flag's words, in hooks and deferred mode
        self.options_agreed = False  # update options are checked before the first step (after a broadcast)
        self.all_params = [p for g in opt.param_groups for p in g["params"]]
        self._numbers = itertools.count()  # numbers the failure path's collectives (Horovod matches names)
        self.index_params()
        # hooks mode: the exchange starts in the gradient hooks; else from step()
        self.in_hooks = not self.flat_mode()

    def rebind(self, coll):
        """After an elastic reset rebuilt the buckets on ``coll``: new exchanges, options agreed anew."""
        self.hooks, self.flat = HookExchange(coll, self.predivide), FlatExchange(coll)
        self._numbers = itertools.count()
        self.index_params()
        self.options_agreed = False
        self.in_hooks = not self.flat_mode()

    def index_params(self):
        """Where each parameter is (its bucket and index there), and its place in bucket order
        (the same on every rank)."""
        self.where = {p: (e, i) for e in self.opt.buckets for i, p in enumerate(e.params)}
        self.order = {p: k for k, p in enumerate(self.where)}

    def flat_mode(self):
        """Whether steps go through the buckets' flat buffers (SLAMB's ``fused``): every bucket's
        step, exchange included, is the core's whole-buffer one, launched from ``step()``."""
        return self.predivide == 1.0 and any(e.flat is not None for e in self.opt.buckets)

    def grads_changed(self):
        """Whether this rank changed a gradient since the agreement (:class:`~.contract.GradientNotes`)."""
        return self.notes.changed(self.contract.params)

    # -------------------------------------------------------------- collective decisions
    def asks_new_ratio(self):
        """1 if this rank's groups ask for a new ratio in some bucket (a schedule), else 0."""
        def asks(e):
            try:
                return requested_ratio(e) != e.comm.ratio
            except ConfigError:
                return True  # groups of a bucket disagree: the change fails collectively, with this error
        return int(any(asks(e) for e in self.opt.buckets))

    def change_ratios(self):
        """Some rank asked for a new ratio: every rank moves every bucket to its groups' ratio,
        collectively (each bucket one 3-word agreement); if the ranks disagree, ConfigError on
        those that changed it, PeerError on the others, and nothing changes."""
        for e in self.opt.buckets:
            self.opt.apply_ratio(e)

    def adopt(self, grown):
        """Every rank unfroze the same parameters ``grown``: adopt them (collectively): the buckets
        rebuilt keeping the state, the new parameters in a bucket of their own, at step 0."""
        self.opt.rebuild_buckets()
        self.index_params()
        self.contract.register_hooks(grown)
        self.options_agreed = False

    def agree_options(self):
        """Once after a construction, load or broadcast: every rank's update options agree (ConfigError)."""
        if not self.options_agreed:  # the update options, as broadcast_optimizer_state left them
            for e in self.opt.buckets:
                e.rule.agree_options(*e.lr_wd())
            self.options_agreed = True

    def pull(self, e):
        """The optimizer's :meth:`~slamb_comm.adapters.torch.optim.slamb.SLAMB.pull` of bucket ``e``;
        a state replaced from outside has its options agreed again."""
        if self.opt.pull(e):
            self.options_agreed = False

    # -------------------------------------------------------------- hooks and deferred mode
    def begin(self, e):
        """Open bucket ``e``'s step: the flag launched (once per step), this rank's problems noted."""
        self.contract.launch_flag(self.all_params, [self.asks_new_ratio(),
                                                    int(not self.in_hooks and self.grads_changed())])
        if self.problem is None:
            self.problem = params_changed(self.opt, self.all_params)
        try:
            self.pull(e)
        except ConfigError as err:  # an option fixed at construction changed on this rank: send it as a status
            if self.problem is None:
                self.problem = err
        self.hooks.begin(e, topk=e.comm.mask_kind == "topk")

    def launch_once(self, p):
        """:meth:`launch` unless this step already launched ``p`` (DDP's hook, once per bucket)."""
        e, _ = self.where[p]
        if not self.hooks.launched(e, p):
            self.launch(p)

    def launch(self, p, redo=False):
        """Local moments of ``p`` from its gradient, and (except for the topk mask) the async
        Average of its momentum entries on M_t (:meth:`~.hook_exchange.HookExchange.launch`)."""
        e, i = self.where[p]
        if not self.hooks.is_open(e):
            self.begin(e)
        if self.problem is None:
            self.problem = param_changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
        g = None if self.problem is not None else grad_array(p, e.dtype)
        self.hooks.launch(e, i, p, g, self.problem, redo)

    def launch_missing(self):
        """Launch what no hook did: a parameter without a gradient takes part with zeros (its status says so)."""
        self.launch_all([p for p in self.contract.params if not self.hooks.launched(self.where[p][0], p)])

    def launch_all(self, params, redo=False):
        """Launch the exchanges of ``params`` from ``step()``: under DDP bucket by bucket, as DDP's
        hooks group them (one fused collective per bucket, as in hooks mode, so that the sums are
        the same bits), else all together (one fused collective)."""
        left = list(params)
        wanted = set(left)
        groups = [[p for p in self.ddp_groups[k] if p in wanted] for k in sorted(self.ddp_groups)]
        grouped = {p for g in groups for p in g}
        groups.append([p for p in left if p not in grouped])
        for group in groups:
            with self.contract.coll.batch():
                for p in group:
                    self.launch(p, redo=redo)

    def finish(self):
        """Wait for the step's flag and exchange; first redo the exchange if the flag says every
        rank unfroze parameters or some rank asks for a new ratio."""
        flag = self.contract.wait_flag()
        grown, self.words = flag.grown, HookWords(*flag.words)
        rerate = self.words.rerate > 0  # some rank's groups ask for a new ratio (a schedule)
        if grown or rerate:  # both collective decisions: abandon this exchange and redo it after
            self.abandon()
            if rerate:  # every rank alike, from this step on (or an error on every rank)
                self.change_ratios()
            if grown:
                self.adopt(grown)
            self.contract.hold_flag()
            self.launch_missing()
        self.finish_exchange()
        try:
            self.agree_options()
        except ConfigError:
            self.abort()
            raise
        self.contract.drop_flag()

    def finish_exchange(self):
        """Wait for every launched exchange and keep the means (:meth:`~.hook_exchange.HookExchange.finish`).

        Non-finite values on any rank (seen by every rank alike, through the status slot or
        the averaged values) abandon the step on every rank, fill the affected gradients
        with NaN -- as Horovod's averaged gradients would be -- so that an AMP GradScaler
        skips the step on every rank, and make the next ``step()`` raise NonFiniteError.
        A parameter that no longer fits its bucket on some rank (NaN status slot, or a
        rejected fused exchange) abandons the step too, and raises on every rank at once.
        """
        fin = self.hooks.finish(self.opt.buckets, self.problem)
        if fin.changed is not None:
            self.raise_changed(None if fin.changed is True else fin.changed)
        if fin.bad:  # which ranks: one more collective, on this failure path only
            names = [e.names[e.index[p]] for e, p in fin.bad]
            ranks = flagged_ranks(self.contract.coll, fin.mine, f"slamb_comm.nonfinite.{next(self._numbers)}")
            self.abort()
            with torch.no_grad():
                for _, p in fin.bad:
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
            self.nonfinite = nonfinite_error("SLAMB momentum exchange", ranks, names,
                                             "the step was abandoned on every rank and no state was changed")

    def raise_changed(self, peer_err):
        """On every rank alike: abandon the step; this rank's error (LayoutError: a parameter
        changed; ConfigError: a fixed option changed) if it has one, else a PeerError naming the
        ranks that do (``peer_err``, or asked for here)."""
        problem = self.problem
        self.abort()
        if peer_err is None:  # which ranks: one more collective, on this failure path only
            ranks = flagged_ranks(self.contract.coll, problem is not None, f"slamb_comm.changed.{next(self._numbers)}")
            peer_err = PeerError(f"SLAMB momentum exchange: rank(s) {ranks} have a parameter or an option that "
                                 "changed after the optimizer was built (see their error); the step was abandoned "
                                 "on every rank and nothing was changed", ranks)
        raise problem if problem is not None else peer_err

    def exchange_now(self):
        """The step's exchange, launched here from the gradients as they are (hooks mode after
        a change of the gradients: a redo; deferred mode: the only exchange of the step)."""
        if self.in_hooks:  # a redo: the first exchange's values are dropped, its moments recomputed
            self.hooks.relaunch()
            self.launch_all(self.contract.params, redo=True)
            self.finish_exchange()
            self.in_hooks = False  # the gradients change after the backward pass: exchange from step()
            return
        self.launch_missing()
        self.finish()
        if self.nonfinite is None and self.words.changed == 0 and not self.flat_mode():
            self.in_hooks = True  # no rank changed its gradients after the agreement: back to the hooks

    def changed_anywhere(self):
        """Hooks mode: whether any rank changed a gradient since the agreement (one-word allreduce)."""
        coll = self.contract.coll
        flag = torch.tensor([int(self.grads_changed())], dtype=torch.int32, device=coll.device)
        coll.allreduce(flag, f"slamb_comm.regrad.{next(self._numbers)}")
        return int(flag[0]) > 0

    # -------------------------------------------------------------- flat mode
    def decide_flat(self):
        """Flat mode: the step's collective decisions in one small allreduce (the trainable flag),
        before any bucket changes: a new ratio asked for, a parameter that no longer fits its
        bucket, a gradient missing or sparse (the step then goes tensor by tensor, which handles
        them), and, where the exchange was packed during the backward pass, whether some rank
        changed its gradients since (it is then packed again). A non-finite gradient is found by
        the exchange itself, before any bucket changes. Returns ``(flat step goes, packed again)``."""
        buckets = self.opt.buckets
        problem = self.problem or params_changed(self.opt, self.all_params)
        for e in buckets:  # state replaced from outside (a broadcast), options read from the groups
            try:
                self.pull(e)
            except ConfigError as err:  # an option fixed at construction changed on this rank
                problem = problem or err
        for e in buckets if problem is None else ():
            for i, p in enumerate(e.params):
                problem = problem or param_changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
        self.problem = problem
        ready = problem is None and all(e.flat is not None and e.flat.ready() for e in buckets)
        asks = self.asks_new_ratio() if problem is None else 0
        packed = self.flat
        regrad = int(ready and (packed.finished or packed.deferred) and self.grads_changed())
        self.contract.launch_flag(self.all_params, extra=[asks, int(problem is not None), int(not ready), regrad])
        flag = self.contract.wait_flag()
        self.contract.drop_flag()
        grown = flag.grown
        rerate, changed, unready, regrad = FlatWords(*flag.words)
        packed.deferred = bool(regrad)  # exchange from the hooks again only after a step nobody changed
        if changed:
            self.raise_changed(None)
        try:
            if grown or rerate:  # collective decisions: the step then goes tensor by tensor, after them
                self.flat.abandon()
                if rerate:
                    self.change_ratios()
                if grown:
                    self.adopt(grown)
            self.agree_options()
        except BaseException:
            self.abort()  # nothing was changed; the countdowns are full again
            raise
        return not (unready or grown or rerate), bool(regrad)

    def step_flat(self, again):
        """Flat mode's step (:meth:`~.flat_exchange.FlatExchange.step`): False if it was skipped on
        every rank for a non-finite gradient (:attr:`nonfinite` says why)."""
        err = self.flat.step(self.opt.buckets, again, lambda e: e.lr_wd())
        if err is not None:
            self.nonfinite = err
            return False
        for e in self.opt.buckets:
            self.opt.publish(e)
        return True

    # -------------------------------------------------------------- dropping a step
    def abandon(self):
        """Wait for whatever this step launched (Horovod needs every handle collected), then :meth:`abort`."""
        self.hooks.abandon()
        self.abort()

    def abort(self):
        """Drop the step in flight on this rank: nothing of it changed any state."""
        self.contract.drop_flag()
        self.flat.abandon()
        self.hooks.abort()
        self.problem = None
        self.contract.reset_countdown()
        self.contract.synchronized = False
