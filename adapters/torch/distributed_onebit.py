"""Distributed 1-bit LAMB: the methods of the class that ``DistributedOptimizer(OneBitLAMB(...))`` builds.

Agrees on the step in ``synchronize()`` (one small allgather), then runs the core's dense
warm-up or 1-bit exchange and the update in ``step()``.
"""

import warnings

import torch

from slamb_comm.errors import ConfigError, PeerError

from . import contract
from .params import run_closure

__all__ = ["DistributedOneBit"]


class DistributedOneBit(torch.optim.Optimizer):
    """Methods of the class :func:`DistributedOptimizer` builds around a :class:`OneBitLAMB`.

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
        self._onebit_transport = coll.transport()
        self._onebit_names = self._names = names
        super(self.__class__, self).__init__(params)
        contract.init_common(self, coll)
        self.backward_passes_per_step = backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True
        self._plan = None
        contract.register_hooks(self)

    add_param_group = contract.add_param_group_before_wrapping

    set_backward_passes_per_step = contract.set_backward_passes_per_step
    skip_synchronize = contract.skip_synchronize

    def _make_hook(self, p):
        def hook(param):
            contract.count_backward(self, p)
            self._synchronized = False  # a new backward pass
        return hook

    _end_of_backward = contract.end_of_backward

    def synchronize(self):
        """Agree on this step with every rank (one allgather of a few numbers per bucket); the
        exchange itself happens in ``step()``. Raises on every rank alike (nothing changes):
        LayoutError/ConfigError on a rank whose parameter or options changed, PeerError on the
        others; ConfigError if the ranks' options, lr or step counts differ."""
        if not self._member:
            self._synchronized = True
            return
        if not self._agreed:  # no backward pass ran here: agree now, as the others did at theirs
            contract.agree_step(self)
        self._agreed = False
        try:
            try:
                problem, bad, have, prints = self._status()
            except Exception as err:  # noqa: BLE001 -- still take part, then raise it here
                k = len(self._engines)
                problem, bad, have, prints = err, False, [False] * k, [0.0] * k
            row = torch.tensor([float(problem is not None), float(bad)] + [float(h) for h in have] + prints,
                               dtype=torch.float64, device=self._coll.device)
            rows = self._coll.allgather(row, self._flag_name + ".onebit").reshape(self._coll.size, -1).tolist()
        finally:
            contract.reset_countdown(self)
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
        self._plan = ([r for r, w in enumerate(rows) if w[1]], [any(w[2 + b] for w in rows) for b in range(k)])
        self._synchronized = True

    @torch.no_grad()
    def step(self, closure=None):
        """Agree (unless already synchronized), then exchange and update every bucket.

        Outside the process set: the single-process step (P = 1)."""
        if not self._member:
            return super(self.__class__, self).step(closure)
        loss = run_closure(closure)
        if self._should_synchronize and self._synchronized:
            warnings.warn(contract.STEP_AFTER_SYNC)
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        plan, self._plan = self._plan, None
        self._apply(*plan)
        return loss

    zero_grad = contract.zero_grad_when_idle

    def load_state_dict(self, state_dict):
        """Forget any step in progress, then restore the state exactly (this rank's own error
        buffers; another rank's are reset to zero, with a warning)."""
        self._synchronized = self._agreed = False
        self._should_synchronize = True
        self._plan = None
        contract.reset_countdown(self)
        super(self.__class__, self).load_state_dict(state_dict)
