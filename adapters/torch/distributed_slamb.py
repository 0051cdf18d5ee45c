"""Distributed SLAMB: the methods of the class that ``DistributedOptimizer(SLAMB(...))`` builds.

Launches each parameter's masked momentum exchange from its gradient hook (or from
:func:`slamb_comm.adapters.torch.slamb_hook` under DDP), finishes it in ``synchronize()``,
redoes it when a recipe changed the gradients, and applies the update in ``step()``.
Written against the collectives interface of :mod:`.collectives` (Horovod's in
:mod:`slamb_comm.adapters.horovod`).
"""

import itertools
import logging
import warnings
from typing import NamedTuple

import torch

from slamb_comm.errors import ConfigError, NonFiniteError, PeerError

from .contract import STEP_AFTER_SYNC, ContractMethods, GradientNotes, grad_norms, queue_callback
from .flat_exchange import FlatExchange
from .hook_exchange import HookExchange
from .params import param_changed, params_changed, run_closure
from .slamb import SLAMB
from .tensors import Grads, Params, cuda_scope

__all__ = ["DistributedSlamb"]


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

_log = logging.getLogger("slamb_comm")


class DistributedSlamb(ContractMethods, SLAMB):
    """Methods of the class :func:`DistributedOptimizer` builds around a :class:`SLAMB`.

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
        self._names = names
        self._where = {}
        self._contract = self._make_contract(coll, names, backward_passes_per_step, self._ready, self._end_of_backward,
                                             self._abandon, lambda: self._where)
        self.gradient_predivide_factor = gradient_predivide_factor
        self._options_agreed = False  # update options are checked before the first step (after a broadcast)
        self._hook_state = None  # the SlambHookState bound to this optimizer: DDP launches the exchange
        self._ddp_groups = {}  # DDP bucket index -> its parameters, as DDP's hook last handed them
        self._build_engines()
        self._index_params()
        self._nonfinite = None  # the agreed NonFiniteError of this step, if some rank's gradient was not finite
        self._words = HookWords(0, 0)  # the last flag's words, in hooks and deferred mode
        self._error = None  # an error of the end-of-backward agreement, raised at the next step()/synchronize()
        # hooks mode: the exchange starts in the gradient hooks; else from step(). Flat buckets
        # (SLAMB(fused=...)) exchange through the device kernels: from DDP's hooks, a group per DDP
        # bucket (self._flat_exchange), else from step()
        self._in_hooks = not self._flat_mode()
        self._hooks = HookExchange(coll, gradient_predivide_factor)  # tensor by tensor, from the hooks
        self._flat_exchange = FlatExchange(coll)
        self._notes = GradientNotes()  # the gradients as the agreement saw them
        self._layout_problem = None  # this rank's LayoutError of the open step, sent as a NaN status
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._exchanges = itertools.count()
        self._contract.register_hooks([p for p in self._all_params if p.requires_grad])

    @property
    def _coll(self):
        return self._contract.coll

    @property
    def _member(self):
        return self._contract.member

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
        self._coll.immediate = True

    def rebind(self, coll, tag, transport):
        """For Elastic Horovod, after the world changed: the collectives of the new world (named by
        ``tag``, the same on every worker), its ``transport``, and the buckets rebuilt on it
        (collective; the state is kept)."""
        self._contract.rebind(coll, tag)
        self._hooks, self._flat_exchange = HookExchange(coll, self.gradient_predivide_factor), FlatExchange(coll)
        self._slamb_transport, self._exchanges = transport, itertools.count()
        self._build_engines()
        self._index_params()
        self._options_agreed = False
        self._in_hooks = not self._flat_mode()

    def _flat_mode(self):
        """Whether steps go through the buckets' flat buffers (SLAMB's ``fused``): every bucket's
        step, exchange included, is the core's whole-buffer one, launched from ``step()``."""
        return self.gradient_predivide_factor == 1.0 and any(e.flat is not None for e in self._engines)

    def _flag_words(self):
        """Sent with the per-step flag: whether this rank's groups ask for a new ratio, and (in
        deferred mode, where the flag starts in ``step()``) whether this rank changed a gradient
        since the agreement."""
        return [self._asks_new_ratio(), int(not self._in_hooks and self._grads_changed())]

    def _asks_new_ratio(self):
        """1 if this rank's groups ask for a new ratio in some bucket (a schedule), else 0."""
        def asks(e):
            try:
                return self._requested_ratio(e) != e.comm.ratio
            except ConfigError:
                return True  # groups of a bucket disagree: the change fails collectively, with this error
        return int(any(asks(e) for e in self._engines))

    def _change_ratios(self):
        """Some rank asked for a new ratio: every rank moves every bucket to its groups' ratio,
        collectively (each bucket one 3-word agreement); if the ranks disagree, ConfigError on
        those that changed it, PeerError on the others, and nothing changes."""
        for e in self._engines:
            self._set_ratio(e)

    # -------------------------------------------------------------- hooks
    def _ready(self, p):
        """``p``'s gradient hook (Horovod's countdown); when it completes, in hooks mode, the launch
        of its exchange. Under DDP, :func:`slamb_hook` launches the exchange instead."""
        if self._ddp:
            return
        self._backward_begins()
        if self._contract.count(p) and self._in_hooks:
            self._launch(p)

    def _backward_begins(self):
        """At the first gradient hook (or DDP bucket) of a backward pass: an error of the last
        agreement not raised yet is raised now; a step that was agreed but not taken (a
        GradScaler skipped it; or ``synchronize()``, then one more backward pass) is dropped --
        it changed no state -- and this backward pass starts the step afresh."""
        if self._contract.in_backward:
            return
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        self._contract.in_backward = True
        if self._contract.agreed and (self._ddp or self._contract.fresh):
            self._abandon()
            self._contract.agreed = False
        self._nonfinite = None
        self._contract.synchronized = False

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
        norms = None
        flat = self._flat_exchange.finish(self._engines) if not self._in_hooks else None
        if flat:  # the device exchange packed from DDP's hooks was not finite on some rank
            self._flat_exchange.poison()
            self._nonfinite = NonFiniteError(
                f"SLAMB momentum exchange: non-finite values (NaN/Inf) from some rank in {flat[:5]}; every rank's "
                "gradients were set to NaN and the step is skipped on every rank, with no state changed", (), flat)
        elif self._in_hooks:
            self._launch_missing()  # a parameter without a gradient takes part with zeros (its status says so)
            self._finish()
        elif flat is None:
            norms = grad_norms(self._contract.params)  # L2: overflows where v would (a bad gradient)
            if self._contract.agree_finite(self._contract.params, norms):
                names = [self._names.get(id(p), "?") for p in self._contract.params]
                self._abort()
                self._nonfinite = NonFiniteError(
                    "SLAMB: a non-finite gradient (NaN/Inf) on some rank; every rank's gradients were set to NaN "
                    "and the step is skipped on every rank, with no state changed", (), names)
        self._notes.take(self._contract.params, norms)
        if self._flat_mode():
            self._flat_exchange.regroup(self._engines, self._ddp_groups if self._ddp else {})
        self._contract.agreed = True

    def _grads_changed(self):
        """Whether this rank changed a gradient since the agreement (:class:`GradientNotes`)."""
        return self._notes.changed(self._contract.params)

    def _raise_pending(self):
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _begin(self, e):
        if isinstance(self._engines, str):
            raise RuntimeError("parameter groups changed after DistributedOptimizer was built")
        self._contract.launch_flag(self._all_params, self._flag_words())
        if self._layout_problem is None:
            self._layout_problem = params_changed(self, self._all_params)
        try:
            self._pull(e)
        except ConfigError as err:  # an option fixed at construction changed on this rank: send it as a status
            if self._layout_problem is None:
                self._layout_problem = err
        self._hooks.begin(e, topk=e.comm.mask_kind == "topk")

    def _launch_once(self, p):
        """``_launch(p)`` unless this step already launched it (DDP's hook, once per bucket)."""
        e, _ = self._where[p]
        if not self._hooks.launched(e, p):
            self._launch(p)

    def _launch(self, p, redo=False):
        """Local moments of ``p`` from its gradient, and (except for the topk mask) the async
        Average of its momentum entries on M_t (:meth:`HookExchange.launch`)."""
        e, i = self._where[p]
        if not self._hooks.is_open(e):
            self._begin(e)
        if self._layout_problem is None:
            self._layout_problem = param_changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
        g = None if self._layout_problem is not None else self._grad_array(p, e)[0]
        self._hooks.launch(e, i, p, g, self._layout_problem, redo)

    def _finish_exchange(self):
        """Wait for every launched exchange and keep the means (:meth:`HookExchange.finish`).

        Non-finite values on any rank (seen by every rank alike, through the status slot or
        the averaged values) abandon the step on every rank, fill the affected gradients
        with NaN -- as Horovod's averaged gradients would be -- so that an AMP GradScaler
        skips the step on every rank, and make the next ``step()`` raise NonFiniteError.
        A parameter that no longer fits its bucket on some rank (NaN status slot, or a
        rejected fused exchange) abandons the step too, and raises on every rank at once.
        """
        fin = self._hooks.finish(self._engines, self._layout_problem)
        if fin.changed is not None:
            self._raise_changed(None if fin.changed is True else fin.changed)
        if fin.bad:
            names = [e.names[e.index[p]] for e, p in fin.bad]
            self._abort()
            with torch.no_grad():
                for _, p in fin.bad:
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
            self._nonfinite = NonFiniteError(
                f"SLAMB momentum exchange: non-finite values (NaN/Inf) from some rank in {names[:5]}; "
                "the step was abandoned on every rank and no state was changed", (), names)

    def _raise_changed(self, peer_err):
        """On every rank alike: abandon the step; this rank's error (LayoutError: a parameter
        changed; ConfigError: a fixed option changed) if it has one, else a PeerError naming the
        ranks that do (``peer_err``, or asked for here)."""
        problem = self._layout_problem
        self._abort()
        if peer_err is None:  # which ranks: one more collective, on this failure path only
            flag = torch.tensor([int(problem is not None)], dtype=torch.int32, device=self._coll.device)
            codes = self._coll.allgather(flag, f"slamb_comm.changed.{next(self._exchanges)}")
            ranks = [r for r, c in enumerate(codes.tolist()) if c]
            peer_err = PeerError(f"SLAMB momentum exchange: rank(s) {ranks} have a parameter or an option that "
                                 "changed after the optimizer was built (see their error); the step was abandoned "
                                 "on every rank and nothing was changed", ranks)
        raise problem if problem is not None else peer_err

    def _abandon(self):
        """Wait for whatever this step launched (Horovod needs every handle collected), then abort."""
        self._hooks.abandon()
        self._abort()

    def _abort(self):
        self._contract.drop_flag()
        self._flat_exchange.abandon()
        self._hooks.abort()
        self._layout_problem = None
        self._contract.reset_countdown()
        self._contract.synchronized = False

    def synchronize(self):
        """Make this step's collective decisions now, if the end of the backward pass did not
        (every rank submits every tensor): after it, a non-finite gradient on any rank has made
        every rank's gradients NaN. In hooks mode the exchange is finished here; in deferred
        mode it waits for ``step()``, which uses the gradients as they are then (clip them in
        between, under ``skip_synchronize()``, as with Horovod).

        Outside the process set there is nothing to exchange (the rank optimises alone)."""
        if not self._member:
            self._contract.synchronized = True
            return
        self._raise_pending()
        if not self._contract.agreed:
            self._agree()
        self._contract.reset_countdown()
        self._contract.synchronized = True

    def _finish(self):
        """Wait for the step's flag and exchange; first redo the exchange if the flag says every
        rank unfroze parameters or some rank asks for a new ratio."""
        flag = self._contract.wait_flag()
        grown, self._words = flag.grown, HookWords(*flag.words)
        rerate = self._words.rerate > 0  # some rank's groups ask for a new ratio (a schedule)
        if grown or rerate:  # both collective decisions: abandon this exchange and redo it after
            self._abandon()
            if rerate:  # every rank alike, from this step on (or an error on every rank)
                self._change_ratios()
            if grown:  # every rank unfroze the same parameters: adopt them (collectively)
                self._build_engines()  # keeps the state; the new parameters get a bucket of their own, at step 0
                self._index_params()
                self._contract.register_hooks(grown)
                self._options_agreed = False
            self._contract.hold_flag()
            self._launch_missing()
        self._finish_exchange()
        if not self._options_agreed:  # the update options, as broadcast_optimizer_state left them
            try:
                for e in self._engines:
                    e.rule.agree_options(*self._lr_wd(e))
            except ConfigError:
                self._abort()
                raise
            self._options_agreed = True
        self._contract.drop_flag()

    def _index_params(self):
        """Where each parameter is (its engine and index there), and its place in engine order
        (the same on every rank)."""
        self._where = {p: (e, i) for e in self._engines for i, p in enumerate(e.params)}
        self._order = {p: k for k, p in enumerate(self._where)}

    def _launch_missing(self):
        missing = [p for p in self._contract.params if not self._hooks.launched(self._where[p][0], p)]
        self._launch_all(missing)  # a parameter without a gradient takes part with zeros (its status says so)

    def _launch_all(self, params, redo=False):
        """Launch the exchanges of ``params`` from ``step()``: under DDP bucket by bucket, as DDP's
        hooks group them (one fused collective per bucket, as in hooks mode, so that the sums are
        the same bits), else all together (one fused collective)."""
        left = list(params)
        wanted = set(left)
        groups = [[p for p in self._ddp_groups[k] if p in wanted] for k in sorted(self._ddp_groups)]
        grouped = {p for g in groups for p in g}
        groups.append([p for p in left if p not in grouped])
        for group in groups:
            with self._coll.batch():
                for p in group:
                    self._launch(p, redo=redo)

    def _exchange_now(self):
        """The step's exchange, launched here from the gradients as they are (hooks mode after
        a change of the gradients: a redo; deferred mode: the only exchange of the step)."""
        if self._in_hooks:  # a redo: the first exchange's values are dropped, its moments recomputed
            self._hooks.relaunch()
            self._launch_all(self._contract.params, redo=True)
            self._finish_exchange()
            self._in_hooks = False  # the gradients change after the backward pass: exchange from step()
            return
        self._launch_missing()
        self._finish()
        if self._nonfinite is None and self._words.changed == 0 and not self._flat_mode():
            self._in_hooks = True  # no rank changed its gradients after the agreement: back to the hooks

    def _decide_flat(self):
        """Flat mode: the step's collective decisions in one small allreduce (the trainable flag),
        before any bucket changes: a new ratio asked for, a parameter that no longer fits its
        bucket, a gradient missing or sparse (the step then goes tensor by tensor, which handles
        them), and, where the exchange was packed during the backward pass, whether some rank
        changed its gradients since (it is then packed again). A non-finite gradient is found by
        the exchange itself, before any bucket changes. Returns ``(flat step goes, packed again)``."""
        problem = self._layout_problem or params_changed(self, self._all_params)
        for e in self._engines:  # state replaced from outside (a broadcast), options read from the groups
            try:
                self._pull(e)
            except ConfigError as err:  # an option fixed at construction changed on this rank
                problem = problem or err
        for e in self._engines if problem is None else ():
            for i, p in enumerate(e.params):
                problem = problem or param_changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
        self._layout_problem = problem
        ready = problem is None and all(e.flat is not None and e.flat.ready() for e in self._engines)
        asks = self._asks_new_ratio() if problem is None else 0
        packed = self._flat_exchange
        regrad = int(ready and (packed.finished or packed.deferred) and self._grads_changed())
        self._contract.launch_flag(self._all_params, extra=[asks, int(problem is not None), int(not ready), regrad])
        flag = self._contract.wait_flag()
        self._contract.drop_flag()
        grown = flag.grown
        rerate, changed, unready, regrad = FlatWords(*flag.words)
        packed.deferred = bool(regrad)  # exchange from the hooks again only after a step nobody changed
        if changed:
            self._raise_changed(None)
        try:
            if grown or rerate:  # collective decisions: the step then goes tensor by tensor, after them
                self._flat_exchange.abandon()
                if rerate:
                    self._change_ratios()
                if grown:
                    self._build_engines()
                    self._index_params()
                    self._contract.register_hooks(grown)
                    self._options_agreed = False
            if not self._options_agreed:
                for e in self._engines:
                    e.rule.agree_options(*self._lr_wd(e))
                self._options_agreed = True
        except BaseException:
            self._abort()  # nothing was changed; the countdowns are full again
            raise
        return not (unready or grown or rerate), bool(regrad)

    def _step_flat(self, again):
        """Flat mode's step (:meth:`FlatExchange.step`): False if it was skipped on every rank for a
        non-finite gradient (``self._nonfinite`` says why)."""
        err = self._flat_exchange.step(self._engines, again, self._lr_wd)
        if err is not None:
            self._nonfinite = err
            return False
        for e in self._engines:
            self._publish(e)
        return True

    def _changed_anywhere(self):
        """Hooks mode: whether any rank changed a gradient since the agreement (one-word allreduce)."""
        flag = torch.tensor([int(self._grads_changed())], dtype=torch.int32, device=self._coll.device)
        self._coll.allreduce(flag, f"slamb_comm.regrad.{next(self._exchanges)}")
        return int(flag[0]) > 0

    @torch.no_grad()
    def step(self, closure=None):
        """Call ``closure`` (if any) first, then exchange the momentum of the gradients as they
        are now and apply the SLAMB update.

        Outside the process set: the single-process SLAMB step (P = 1), as Horovod's non-members
        step their optimizer on the local gradient."""
        if not self._member:
            return super().step(closure)
        loss = run_closure(closure)
        # once: a DDP module without slamb_hook, or a hook DDP never called
        self._contract.check_ddp_once(self, self._all_params, slamb=True, hook_state=self._hook_state)
        self._raise_pending()
        if self._contract.should_synchronize and self._contract.synchronized:
            warnings.warn(STEP_AFTER_SYNC)
        self._contract.synchronized = False
        flat = False
        try:
            if not self._contract.agreed:
                self._agree()
            if self._nonfinite is None and self._flat_mode():
                flat, again = self._decide_flat()
                if flat and not self._step_flat(again):
                    flat = True  # skipped: self._nonfinite says why
                elif not flat:
                    self._flat_exchange.abandon()
            if self._nonfinite is None and not flat and (not self._in_hooks or self._changed_anywhere()):
                self._exchange_now()
        finally:
            self._contract.agreed = False
            self._notes.clear()
        if self._nonfinite is not None:
            err, self._nonfinite = self._nonfinite, None
            self._contract.reset_countdown()
            if any(e.rule.on_nonfinite == "raise" for e in self._engines):
                raise err
            for e in self._engines:
                e.rule.skipped_steps += 1
            _log.warning("slamb_comm: step skipped on every rank: %s", err)
            return loss
        if flat:
            self._contract.reset_countdown()
            return loss
        for e in self._engines:
            opened = self._hooks.close(e)
            if opened is None:
                continue
            means, skip = opened
            if len(skip) == len(e.params):  # no gradient anywhere in the bucket: no step at all
                e.rule.abort_step()
                continue
            lr, wd = self._lr_wd(e)
            x = Params(e)
            with cuda_scope(e.params[0].device):
                e.rule.apply(x, Grads(e), means=means, lr=lr, weight_decay=wd, written=x.written, skip=skip)
            self._publish(e)
        self._contract.reset_countdown()
        return loss

    def ddp_bucket(self, bucket):
        """:func:`slamb_hook`'s work for one DDP bucket: in hooks mode, launch the exchange of its
        parameters; the agreement follows at the end of the backward pass."""
        self._backward_begins()
        self._contract.queue_end_of_backward()
        group = [p for p in bucket.parameters() if p in self._where]
        if group:  # keyed as DDP numbers its buckets (the same on every rank)
            key = bucket.index() if hasattr(bucket, "index") else min(self._order[p] for p in group)
            old = self._ddp_groups.get(key)
            if old is None or [id(p) for p in old] != [id(p) for p in group]:  # new, or DDP rebuilt its buckets
                mine = {id(p) for p in group}
                self._ddp_groups = {k: [p for p in g if id(p) not in mine] for k, g in self._ddp_groups.items()}
                self._ddp_groups = {k: g for k, g in self._ddp_groups.items() if g}
                self._ddp_groups[key] = group
        if self._in_hooks:
            with self._coll.batch():  # the bucket's exchanges as one collective
                for p in bucket.parameters():
                    if p in self._where:
                        self._launch_once(p)
        elif group and self._flat_mode():  # the device exchange of the bucket's parameters, from here
            self._launch_flat(bucket)

    def _launch_flat(self, bucket):
        """Pack and launch the exchange of a DDP bucket's parameters per bucket of SLAMB (flat mode):
        a bucket that does not match the grouping of the last step launches nothing here (the step's
        agreement then drops what this step launched, and ``step()`` exchanges)."""
        by_engine = {}
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if p in self._where:
                e, _ = self._where[p]
                by_engine.setdefault(e, ([], []))
                by_engine[e][0].append(p)
                by_engine[e][1].append(g)
        for e, (params, grads) in by_engine.items():
            if not self._flat_exchange.launch(e, params, grads):
                return

    def zero_grad(self, set_to_none=True):
        """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
        ``backward()`` and ``step()``/``synchronize()``, when exchanges are in flight."""
        self._contract.check_zero_grad(self._contract.fresh)
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        """Abandon any step in flight, then restore the SLAMB state exactly."""
        if any(self._hooks.is_open(e) for e in self._engines):
            self._abort()
        self._contract.forget_step()
        self._notes.clear()
        self._nonfinite, self._error = None, None
        super().load_state_dict(state_dict)
        self._index_params()
