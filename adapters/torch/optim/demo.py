"""DeMo as a torch optimizer (:class:`DeMo`), on the core's :class:`slamb_comm.methods.demo.DeMo`.

docs/algorithm.md section 13 has the math; this module moves torch tensors in and out of the
core's one exchange per step and applies the signum update per parameter group. Its parameters are
one layout on one device with m in one dtype (one core object over all of them, whose state is the
``'demo'`` entry of ``state_dict()``), so it needs none of :class:`~.base.BucketedOptimizer`'s
bucketing; it keeps its skipped steps and traffic as every optimizer does (:class:`~.ledger.StepLedger`).
"""

import torch
import torch.distributed as dist

from slamb_comm import arrays as _arr
from slamb_comm.wire.layout import Layout
from slamb_comm.methods import demo as core

from ...privates import foreach_add_, foreach_mul_
from ..transport import TorchTransport
from ..params import run_closure
from ..tensors import cuda_scope, np_dtype, state_dtype, tensor_of
from .ledger import StepLedger

__all__ = ["DeMo"]


class DeMo(torch.optim.Optimizer):
    r"""DeMo, Decoupled Momentum Optimization (Peng, Quesnelle & Kingma, 2024), as a ``torch.optim.Optimizer``
    over ``torch.distributed`` (docs/algorithm.md section 13).

    Each rank keeps its own momentum ``m = momentum * m + grad`` and sends, once per step, the
    ``topk`` largest DCT-II coefficients of every ``chunk x chunk`` block of it (int32 indices,
    ``value_dtype`` values, one all-gather for all parameters); what it sent leaves ``m``; every
    rank decodes the mean ``Q`` of all ranks' coefficients and steps
    ``p = (1 - lr * weight_decay) * p - lr * sign(Q)``. Do not average gradients beforehand (no
    DDP, or DDP under ``no_sync()``): each rank's own ``p.grad`` is what DeMo needs.

    Args:
        params: parameters or parameter groups; ``lr`` and ``weight_decay`` per group, read at
            every step (lr schedulers work). Parameters with ``requires_grad=False`` at
            construction are left alone; one without a gradient at a step counts as zeros.
        lr: the signum step (default 4e-4, the authors' OLMo configs).
        momentum: the decay beta of m (default 0.999, the paper's).
        weight_decay: decoupled weight decay (default 0).
        chunk, topk: s and k (defaults 64 and 32); ``1 <= topk <= chunk**2``.
        value_dtype: the payload's values, 'float32' (default) or 'float16' (or 'float64').
        process_group: the group to run over (default: the default group when
            ``torch.distributed`` is initialised; alone, P = 1, otherwise).
        on_nonfinite: 'skip' (default): a step with a NaN/Inf on any rank is skipped on every
            rank (logged, counted in :attr:`skipped_steps`); 'raise': every rank raises
            :class:`slamb_comm.NonFiniteError`. Either way nothing changes.

    The parameters must sit on one device; m is kept in float32 (float64 if every parameter is
    float64), and 16-bit parameters are updated in their own dtype. :meth:`step_traffic` gives
    the bytes of the step just finished.
    """

    def __init__(self, params, lr=4e-4, momentum=0.999, weight_decay=0.0, chunk=64, topk=32, value_dtype="float32",
                 process_group=None, on_nonfinite="skip"):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"lr and weight_decay must be >= 0, got {lr}, {weight_decay}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._sizes = [p.numel() for p in self._params]
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"DeMo needs every parameter on one device, got {sorted(map(str, devices))}")
        self._device = devices.pop() if devices else torch.device("cpu")
        kinds = {state_dtype(p.dtype) for p in self._params}
        self._dtype = torch.float64 if kinds == {torch.float64} else torch.float32
        if process_group is not None or (dist.is_available() and dist.is_initialized()):
            transport = TorchTransport(process_group)
        else:
            transport = None
        layout = Layout([tuple(p.shape) for p in self._params], np_dtype(self._dtype),
                        names=[str(i) for i in range(len(self._params))])
        self.ledger = StepLedger("DeMo")
        with cuda_scope(self._device):
            self._core = core.DeMo(transport, layout, lr=lr, beta=momentum, weight_decay=weight_decay, chunk=chunk,
                                   topk=topk, value_dtype=value_dtype, on_nonfinite=on_nonfinite)

    @property
    def skipped_steps(self):
        """Steps skipped on every rank for non-finite values (the core rule counts them)."""
        return self.ledger.skipped_steps([self._core])

    @property
    def traffic(self):
        """The core's :class:`slamb_comm.Stats` (every exchange since construction)."""
        return self._core.stats

    def step_traffic(self):
        """Bytes of the step just finished (a :class:`slamb_comm.Traffic`), and start counting anew."""
        return self.ledger.traffic([self._core.stats])

    @torch.no_grad()
    def step(self, closure=None):
        """One DeMo step over all ranks of the group (collective: every rank calls it). Returns
        the closure's loss, if one was given."""
        loss = run_closure(closure)
        grads = [(p.grad.detach().to_dense() if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                 for p in self._params]
        with cuda_scope(self._device):
            flat = torch.cat([g.to(self._dtype) for g in grads]) if grads else torch.zeros(0, dtype=self._dtype)
            u = self._core.direction(_arr.as_array(flat))
            if u is None:
                return loss
            u = tensor_of(u)
            ds = dict(zip(self._params, u.split(self._sizes)))
            for group in self.param_groups:  # one multi-tensor update per group, not one per parameter
                lr, wd = group["lr"], group["weight_decay"]
                ps = [p for p in group["params"] if p in ds]
                if not ps:
                    continue
                if wd:
                    foreach_mul_(ps, 1.0 - lr * wd)
                foreach_add_(ps, [ds[p].view_as(p).to(p.dtype) for p in ps], -lr)
        return loss

    def state_dict(self):
        """torch's state (param groups) plus this rank's DeMo state under ``'demo'``: step,
        skipped steps and the momentum m (a flat CPU tensor), bitwise."""
        sd = super().state_dict()
        core = dict(self._core.state_dict())
        if core["m"] is not None:
            core["m"] = torch.from_numpy(core["m"])
        sd["demo"] = core
        return sd

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output (this rank's own, for a bitwise resume)."""
        sd = dict(state_dict)
        core = sd.pop("demo", None)
        super().load_state_dict(sd)
        if core is not None:
            core = dict(core)
            if core["m"] is not None:
                core["m"] = torch.as_tensor(core["m"]).detach().cpu().numpy()
            self._core.load_state_dict(core)
