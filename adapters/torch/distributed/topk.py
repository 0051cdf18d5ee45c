"""Distributed top-k: the mixin of the class that ``DistributedOptimizer(opt, compression=TopK(...))`` builds.

At ``synchronize()`` every bucket's gradients go through the core's error-feedback top-k
allgather and ``p.grad`` becomes the mean; then the wrapped optimizer steps.
"""

import contextlib
import warnings

import torch

from slamb_comm import arrays as _arr
from slamb_comm.wire.layout import Layout
from slamb_comm.exchange.communicator import Communicator
from slamb_comm.errors import NonFiniteError

from ...privates import scaler_stage
from ..optim.bucket import Bucket, BucketKey
from ..optim.ledger import StepLedger
from ..params import param_changed, params_changed, run_closure
from .contract import STEP_AFTER_SYNC, DistributedMixin, make_contract, nonfinite_error
from ..tensors import as_compute, cuda_scope, state_dtype, tensor_of

__all__ = ["DistributedTopK", "amp_scale", "loss_scaled"]



class DistributedTopK(DistributedMixin):
    """Top-k exchange under any optimizer: with the user's optimizer class, the bases of the class
    :func:`DistributedOptimizer` builds for ``compression=TopK(...)`` (its ``step`` this one's
    :meth:`distributed_step`).

    At ``synchronize()`` (or ``step()``), the gradients of each (device, dtype) bucket go
    through one fused error-feedback top-k allgather (:meth:`slamb_comm.Communicator.sparse_allgather`);
    ``p.grad`` becomes the mean over ranks of everyone's decoded top-k (times the number of
    ranks for a Sum), then the wrapped optimizer steps. The error buffers are part
    of ``state_dict()`` (under the extra key ``'slamb_comm_topk'``) and restore exactly.
    """

    def __init__(self, params, names, compression, backward_passes_per_step, coll, sum_op=False,
                 gradient_predivide_factor=1.0, grad_scaler=None):
        super().__init__(params)
        self._compression = compression
        self._grad_scaler = grad_scaler
        self._names = names
        self._bucketed = set()
        self.contract = make_contract(self, coll, names, backward_passes_per_step, self._ready, self._contract_agrees,
                                      self._abandon, lambda: self._bucketed)
        self._sum = bool(sum_op)
        self.gradient_predivide_factor = gradient_predivide_factor
        self._skip_next = False  # the agreed skip of a non-finite step, for the step() that follows
        self.ledger = StepLedger("top-k")
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self.contract.register_hooks([p for p in self._all_params if p.requires_grad])
        self._transport = coll.transport()  # None outside the process set: nothing exchanged
        self._buckets = []  # a Bucket (its top-k Communicator) per (device, dtype), and per later addition
        self._add_buckets(self.contract.params if self.contract.member else [])

    def rebind(self, coll, tag, transport):
        """For Elastic Horovod, after the world changed: the collectives of the new world (named by
        ``tag``, the same on every worker), its ``transport``, and the buckets' communicators built
        for it anew (collective: their layout and option agreement runs again; the error buffers
        start from zero until the caller loads the merged state)."""
        self.contract.rebind(coll, tag)
        self._transport = transport
        self._buckets, self._bucketed = [], set()
        self._add_buckets(self.contract.params)

    def _add_buckets(self, params):
        """One fused top-k Communicator per (device, dtype) of ``params`` (collective). Parameters
        that become trainable later get buckets of their own, so no error buffer is remapped."""
        c = self._compression
        if c.problem is not None:  # this rank's invalid option: raised in the agreement, PeerError on the others
            Communicator(self._transport, [], problem=c.problem)
        keyed, group_of = {}, {p: g for g in self.param_groups for p in g["params"]}
        for p in params:
            keyed.setdefault(BucketKey(str(p.device), str(state_dtype(p.dtype)), None, 0), []).append(p)
        for key, ps in keyed.items():
            b = Bucket(key, ps, [group_of[p] for p in ps], [self._names[id(p)] for p in ps], state_dtype(ps[0].dtype))
            layout = Layout([tuple(p.shape) for p in ps], b.np_dtype, names=b.names,
                            dense_threshold=c.dense_threshold or 0)
            b.comm = Communicator(self._transport, layout, ratio=c.ratio, value_dtype=c.value_dtype, seed=0,
                                  topk_dense=c.dense_threshold is not None)
            self._buckets.append(b)
            self._bucketed.update(ps)

    def _abandon(self):
        self.contract.drop_flag()
        self.contract.reset_countdown()

    def _ready(self, p):
        if not self.contract.in_backward:  # a new backward pass: a skip decided before it is stale (a GradScaler took it)
            self._skip_next = False
        self.contract.count_backward(p)

    def _contract_agrees(self):
        self.contract.agree_step()

    @property
    def communicators(self):
        """The :class:`slamb_comm.Communicator` of every gradient bucket (for statistics)."""
        return [b.comm for b in self._buckets]

    @property
    def skipped_steps(self):
        """Steps skipped on every rank for a non-finite gradient (``on_nonfinite='skip'``)."""
        return self.ledger.skipped_steps()

    def step_traffic(self):
        """Bytes of the step just finished, summed over buckets (see :meth:`SLAMB.step_traffic`)."""
        return self.ledger.traffic([c.stats for c in self.communicators])

    def synchronize(self):
        """Exchange every gradient (zeros where a rank has none) and set ``p.grad`` to the mean.

        All buckets or none: every bucket is exchanged before any error buffer or ``p.grad``
        is written, and if a bucket fails (on every rank alike: NaN/Inf, or a parameter that
        changed on some rank) no bucket commits, so the step changes no state.

        Outside the process set nothing is exchanged: the wrapped optimizer steps on this rank's
        own gradients, as with Horovod."""
        c = self.contract
        if not c.member:
            c.synchronized = True
            return
        c.check_ddp_once(self, self._all_params, slamb=False)  # not under a DDP that averages densely as well
        if not c.agreed:  # no backward pass ran here: agree now, as the others did at theirs
            c.agree_step()
        c.agreed = False
        # One small Sum tells both which ranks have newly trainable parameters and, per parameter,
        # how many ranks have a gradient for it: none means it is left exactly as it is.
        before = list(c.params)
        c.launch_flag(self._all_params, extra=[int(p.grad is not None) for p in before])
        flag = c.wait_flag()
        c.drop_flag()
        nowhere = {p for p, n in zip(before, flag.words) if n == 0}
        if flag.grown:  # unfrozen alike on every rank: exchanged from this step on, with zero error buffers
            self._add_buckets(flag.grown)
            c.register_hooks(flag.grown)
        problem = params_changed(self, self._all_params)
        means = []
        scale = amp_scale(self._grad_scaler, self)
        scaled = contextlib.ExitStack()  # the error buffers in the gradients' (loss-scaled) units meanwhile
        for b in self._buckets:
            comm = b.comm
            scaled.enter_context(loss_scaled(comm, scale))
        with scaled:
            self._exchange(problem, means, nowhere)

    def _exchange(self, problem, means, nowhere):
        """Every bucket's exchange, then (all having succeeded) every commit and ``p.grad``."""
        try:
            for bucket in self._buckets:
                ps, dt, comm = bucket.params, bucket.dtype, bucket.comm
                lay = comm.layout
                for i, p in enumerate(ps):
                    problem = problem or param_changed(p, lay.names[i], lay.shapes[i], dt)
                if problem is not None:  # input the core rejects: it still takes part, the others raise PeerError
                    comm.sparse_allgather([])
                grads = []
                for p in ps:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(_arr.as_array(as_compute(p.grad, dt)))
                # A later bucket may still fail: commit the error buffers only once all succeeded.
                with cuda_scope(ps[0].device):
                    means.append((comm, grads, comm.sparse_allgather(grads, commit=False)))
        except Exception as err:  # raised on every rank, at the same bucket: start afresh
            self.contract.reset_countdown()
            if problem is not None:
                raise problem from None
            if isinstance(err, NonFiniteError) and self.contract.nonfinite[0]:  # the agreement made every rank's NaN
                err = nonfinite_error("top-k exchange", *self.contract.nonfinite, "nothing was changed")
            if isinstance(err, NonFiniteError) and self._compression.on_nonfinite == "skip":
                self._skip_nonfinite(err)
                return
            raise err
        for ps, (comm, _, _) in zip((b.params for b in self._buckets), means):
            with cuda_scope(ps[0].device):  # from the local gradients, still in p.grad
                comm.commit_residual(skip={i for i, p in enumerate(ps) if p in nowhere})
        for bucket, (_, _, mean) in zip(self._buckets, means):
            ps, comm = bucket.params, bucket.comm
            for p, m in zip(ps, mean):
                if p in nowhere:  # no rank had a gradient: the wrapped optimizer leaves it alone
                    p.grad = None
                    continue
                out = tensor_of(m)
                if self._sum:
                    out = out * comm.size
                out = out.to(p.grad.dtype)
                if p.grad.is_sparse:
                    p.grad = out.to_sparse()
                else:
                    p.grad.copy_(out)
        self.contract.reset_countdown()
        self.contract.synchronized = True

    def _skip_nonfinite(self, err):
        """On every rank alike: NaN gradients (so an AMP GradScaler skips too), and the next
        ``step()`` does not step the wrapped optimizer. Logged and counted."""
        for b in self._buckets:
            for p in b.params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        self.contract.synchronized = True
        self._skip_next = True
        self.ledger.skip(err)

    def distributed_step(self, closure=None):
        """Call ``closure`` (if any) first, as ``torch.optim`` does; synchronize (unless under
        ``skip_synchronize()``); then the wrapped optimizer's step on the mean (skipped, on every
        rank, after a non-finite gradient under ``on_nonfinite='skip'``). The built class's ``step``."""
        loss = run_closure(closure)
        c = self.contract
        if c.should_synchronize:
            if c.synchronized:
                warnings.warn(STEP_AFTER_SYNC)
            self.synchronize()
        c.synchronized = False
        if self._skip_next:
            self._skip_next = False
            return loss
        super().step()
        return loss

    def zero_grad(self, set_to_none=True):
        """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
        ``backward()`` and ``step()``/``synchronize()``, while exchanges are pending."""
        self.contract.check_zero_grad(not self.contract.pending)
        return super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state, plus this rank's error buffers under ``'slamb_comm_topk'``."""
        sd = super().state_dict()
        sd["slamb_comm_topk"] = [
            {"residual": None if c.residual is None else torch.from_numpy(_arr.to_host(c.residual).copy()),
             "seed": int(c.seed), "digest": c.state_dict()["digest"]}
            for c in self.communicators
        ]
        return sd

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output, error buffers included, exactly."""
        state_dict = dict(state_dict)
        mine = state_dict.pop("slamb_comm_topk", None)
        self.contract.forget_step()
        super().load_state_dict(state_dict)
        if mine is not None:
            if len(mine) != len(self._buckets):
                raise ValueError("the saved top-k state has a different number of buckets")
            for c, s in zip(self.communicators, mine):
                st = c.state_dict()
                st.update(seed=s["seed"], digest=s["digest"],
                          residual=None if s["residual"] is None else s["residual"].numpy())
                c.load_state_dict(st)  # the error buffer moves to the gradients' device at the next exchange


def amp_scale(grad_scaler, optimizer=None):
    """The loss scale the gradients carry now: ``grad_scaler.get_scale()`` of an enabled AMP
    ``GradScaler`` (one host read), else 1; also 1 once ``grad_scaler.unscale_(optimizer)`` ran
    in this iteration (read from the scaler's per-optimizer stage, which its ``update()``
    resets: :func:`slamb_comm.adapters.privates.scaler_stage`)."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return 1.0
    if optimizer is not None:
        stage = scaler_stage(grad_scaler, optimizer)  # GradScaler's own per-optimizer stage
        if stage is not None and getattr(stage, "name", "READY") != "READY":
            return 1.0  # unscaled already
    return float(grad_scaler.get_scale())


@contextlib.contextmanager
def loss_scaled(comm, scale):
    """While the block runs, ``comm``'s error buffer is in the units of gradients multiplied by
    ``scale`` (an AMP loss scale), so that an exchange of scaled gradients compensates with it;
    after, whatever happens, it is back in unscaled units. So the error buffer does not depend
    on the scale, and carries over exactly when a GradScaler halves or doubles it (its scales
    are powers of two: the two multiplications are exact)."""
    if scale == 1.0:
        yield
        return
    res = comm.residual  # scaled in place (the communicator's own buffer)
    if res is not None:
        res *= res.dtype.type(scale)
    try:
        yield
    finally:
        res = comm.residual  # the exchange may have made a new one
        if res is not None:
            res *= res.dtype.type(1.0 / scale)
