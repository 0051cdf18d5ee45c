"""Distributed 1-bit LAMB: the mixin of the class that ``DistributedOptimizer(OneBitLAMB(...))`` builds.

Agrees on the step in ``synchronize()`` (one small allgather), then runs the core's dense
warm-up or 1-bit exchange and the update in ``step()``.
"""

import warnings

import torch

from slamb_comm.errors import ConfigError, PeerError

from ..params import run_closure
from .contract import STEP_AFTER_SYNC, DistributedMixin, make_contract

__all__ = ["DistributedOneBit"]


class DistributedOneBit(DistributedMixin):
    """The distributed 1-bit LAMB: with the user's :class:`OneBitLAMB` class, the bases of the class
    :func:`DistributedOptimizer` builds around a OneBitLAMB (its ``step`` this one's :meth:`distributed_step`).

    ``synchronize()`` (or ``step()``) agrees on the step in one small allgather: whether some
    rank's parameter or options changed (then LayoutError/ConfigError there, PeerError
    elsewhere, and nothing changes), whether some rank's gradient is not finite (with several
    buckets), which buckets have a gradient anywhere, and that every rank has the same options,
    lr and step count. ``step()`` then runs the core's step per bucket: the dense gradient
    allreduce (warm-up) or the 1-bit momentum exchange, and the update. Nothing overlaps the
    backward pass; the gradient hooks only count backward passes (``backward_passes_per_step``,
    and ``zero_grad()`` refused before the step, as Horovod does). ``p.grad`` is never
    replaced: each rank's gradient stays its own.
    """

    def __init__(self, params, names, compression, backward_passes_per_step, coll, sum_op=False,
                 gradient_predivide_factor=1.0):
        if gradient_predivide_factor != 1.0:
            raise ValueError("OneBitLAMB averages gradients and momenta itself: gradient_predivide_factor must be 1")
        # A rank outside the process set optimises alone (P = 1), as Horovod's non-members do.
        super().__init__(params, transport=coll.transport(), names=names)
        self.contract = make_contract(self, coll, names, backward_passes_per_step, self._ready, self._contract_agrees,
                                      self._reset, lambda: ())
        self._plan = None
        self.contract.register_hooks([p for g in self.param_groups for p in g["params"] if p.requires_grad])

    def _reset(self):
        self.contract.reset_countdown()

    def _ready(self, p):
        self.contract.count_backward(p)
        self.contract.synchronized = False  # a new backward pass

    def _contract_agrees(self):
        self.contract.agree_step()

    def synchronize(self):
        """Agree on this step with every rank (one allgather of a few numbers per bucket); the
        exchange itself happens in ``step()``. Raises on every rank alike (nothing changes):
        LayoutError/ConfigError on a rank whose parameter or options changed, PeerError on the
        others; ConfigError if the ranks' options, lr or step counts differ."""
        c = self.contract
        if not c.member:
            c.synchronized = True
            return
        if not c.agreed:  # no backward pass ran here: agree now, as the others did at theirs
            c.agree_step()
        c.agreed = False
        try:
            try:
                problem, bad, have, prints = self.step_status()
            except Exception as err:  # noqa: BLE001 -- still take part, then raise it here
                k = len(self.buckets)
                problem, bad, have, prints = err, False, [False] * k, [0.0] * k
            row = torch.tensor([float(problem is not None), float(bad)] + [float(h) for h in have] + prints,
                               dtype=torch.float64, device=c.coll.device)
            rows = c.coll.allgather(row, c.flag_name + ".onebit").reshape(c.coll.size, -1).tolist()
        finally:
            c.reset_countdown()
        failed = [r for r, w in enumerate(rows) if w[0]]
        if problem is not None:
            raise problem
        if failed:
            raise PeerError(f"OneBitLAMB: rank(s) {failed} have a parameter or an option that changed after the "
                            "optimizer was built (see their error); the step was abandoned on every rank and nothing "
                            "was changed", failed)
        k = len(have)
        differ = [r for r, w in enumerate(rows) if w[2 + k:] != rows[0][2 + k:]]
        if differ:
            raise ConfigError(f"OneBitLAMB: rank(s) {differ} differ from rank 0 in the options, lr or step count of a "
                              "bucket; set them alike on every rank (nothing was changed)")
        # the ranks whose gradients were not finite: the agreement's (it made every rank's NaN since), else the rows'
        nonfinite = c.nonfinite[0] or [r for r, w in enumerate(rows) if w[1]]
        self._plan = (nonfinite, [any(w[2 + b] for w in rows) for b in range(k)])
        c.synchronized = True

    @torch.no_grad()
    def distributed_step(self, closure=None):
        """Agree (unless already synchronized), then exchange and update every bucket (the built
        class's ``step``).

        Outside the process set: the single-process step (P = 1)."""
        c = self.contract
        if not c.member:
            return super().step(closure)
        loss = run_closure(closure)
        if c.should_synchronize and c.synchronized:
            warnings.warn(STEP_AFTER_SYNC)
        if not c.synchronized:
            self.synchronize()
        c.synchronized = False
        plan, self._plan = self._plan, None
        self.apply_step(*plan)
        return loss

    def zero_grad(self, set_to_none=True):
        """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
        ``backward()`` and ``step()``/``synchronize()``, while gradients are pending."""
        self.contract.check_zero_grad(not self.contract.pending)
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        """Forget any step in progress, then restore the state exactly (this rank's own error
        buffers; another rank's are reset to zero, with a warning)."""
        self.contract.forget_step()
        self._plan = None
        super().load_state_dict(state_dict)
