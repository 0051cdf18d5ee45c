"""The distributed optimizers' factory: :func:`wrap` and :func:`DistributedOptimizer`.

:func:`DistributedOptimizer` is the torch.distributed front door; :func:`wrap`, on any
framework's collectives, picks the mixin (:mod:`.slamb`, :mod:`.onebit`, :mod:`.topk`) and builds the
class with ``type(name, (mixin, optimizer.__class__), ...)``, as Horovod builds its own from the
user's class; :func:`slamb_comm.adapters.horovod.DistributedOptimizer` calls it with Horovod's
collectives.
"""

from slamb_comm.wire.codecs import TopK

from ..optim.onebit_lamb import OneBitLAMB
from ..optim.slamb import LAMB, SLAMB
from ..params import check_named_parameters
from .collectives import TorchCollectives
from .onebit import DistributedOneBit
from .slamb import DistributedSlamb
from .topk import DistributedTopK

__all__ = ["wrap", "DistributedOptimizer"]


def wrap(optimizer, names, compression, backward_passes_per_step, coll, sum_op=False, gradient_predivide_factor=1.0,
         grad_scaler=None, methods=None):
    """The distributed optimizer around ``optimizer`` on the collectives ``coll``: an instance of
    ``type(name, (mixin, optimizer.__class__), {"step": mixin.distributed_step})``, so that it is an
    instance of the user's optimizer class, as Horovod builds its own. The mixin
    (:class:`~.slamb.DistributedSlamb`, :class:`~.onebit.DistributedOneBit`, :class:`~.topk.DistributedTopK`)
    takes what it needs in its constructor and shares the optimizer's ``param_groups``; it has no
    ``step`` of its own, so that ``super(type(opt), opt).step()`` -- how Horovod's
    ``broadcast_optimizer_state`` creates a missing state without starting this rank's collectives
    alone -- reaches the wrapped optimizer's own step. ``methods`` (name -> function of the mixin's
    method of that name; ``"step"`` for its ``distributed_step``) wraps some of its methods in the
    built class (Elastic Horovod's checks, :mod:`slamb_comm.adapters.horovod`)."""
    slamb, onebit = isinstance(optimizer, SLAMB), isinstance(optimizer, OneBitLAMB)
    mixin = DistributedSlamb if slamb else DistributedOneBit if onebit else DistributedTopK
    if grad_scaler is not None and mixin is not DistributedTopK:
        raise ValueError(f"grad_scaler= is for the top-k exchange's error buffers; {type(optimizer).__name__} "
                         "exchanges the unscaled gradients by itself (pass no grad_scaler)")
    extra = {"grad_scaler": grad_scaler} if mixin is DistributedTopK else {"fused": optimizer.fused} if slamb else {}
    own = {"step": mixin.distributed_step}
    attrs = dict(own, __doc__=f"{optimizer.__class__.__name__}, distributed by {mixin.__name__}")
    attrs.update({name: make(own.get(name) or getattr(mixin, name)) for name, make in (methods or {}).items()})
    user_cls = optimizer.__class__
    cls = type(user_cls.__name__, (mixin, user_cls), attrs)
    dist_opt = cls(optimizer.param_groups, names, compression, backward_passes_per_step, coll, sum_op,
                   gradient_predivide_factor, **extra)
    if (slamb or onebit) and optimizer.problem is None and optimizer.steps_taken() > 0:
        dist_opt.load_state_dict(optimizer.state_dict())  # keep what the optimizer had (e.g. a loaded checkpoint)
    return dist_opt


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         process_group=None, grad_scaler=None):
    """SLAMB, 1-bit LAMB or top-k exchange over ``torch.distributed``, in the form of Horovod's optimizer.

    For ``torchrun`` jobs that do not use DDP (a process group and your own loop), and together
    with :func:`slamb_hook` for DDP. Call ``torch.distributed.init_process_group`` first.

    * ``optimizer`` is a :class:`SLAMB`: SLAMB over the group -- each parameter's gradient hook
      (or, under DDP, :func:`slamb_hook`) updates its local moments and starts the asynchronous
      average of its momentum on the shared mask M_t; ``step()`` waits and applies the update
      and the periodic parameter sync.
    * ``optimizer`` is a :class:`OneBitLAMB`: 1-bit LAMB over the group -- at ``step()`` the
      dense gradient allreduce of the warm-up, then the 1-bit momentum exchange, and the update.
    * ``compression`` is a :class:`slamb_comm.TopK`: any optimizer; at ``step()`` (or
      ``synchronize()``) the gradients go through the error-feedback top-k exchange of
      docs/algorithm.md section 2 and the optimizer steps on their mean.

    Otherwise ValueError: for dense gradient averaging use ``DistributedDataParallel``.
    ``synchronize()`` / ``skip_synchronize()`` (gradient clipping), ``backward_passes_per_step``,
    ``zero_grad()``, checkpoints (``state_dict``), a NaN on one rank (the step is skipped on
    every rank) and process groups behave as in :mod:`slamb_comm.adapters.horovod`.

    Args:
        optimizer: a :class:`SLAMB` or :class:`OneBitLAMB`, or any torch optimizer with
            ``compression=TopK(...)``.
        named_parameters: ``(name, parameter)`` pairs naming every parameter (for errors and
            checkpoints); default names ``allreduce.noname.<group>.<index>``.
        compression: ``None`` or a :class:`slamb_comm.TopK`.
        backward_passes_per_step: gradients are accumulated locally over this many backward
            passes before the exchange.
        process_group: the group to exchange in (default: all ranks). Ranks outside it
            optimise alone, as Horovod's non-members do.
        grad_scaler: with ``compression=TopK(...)`` and an AMP ``GradScaler`` whose gradients
            are exchanged before ``unscale_`` (Horovod's idiom: ``synchronize()``, then
            ``scaler.unscale_``), the scaler: the error buffers are then kept in unscaled units,
            so a change of the scale (halved after a skipped step, doubled on growth) carries
            them over exactly. Not needed when ``step()`` exchanges (after ``unscale_``).
    """
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if isinstance(optimizer, LAMB):
        raise ValueError("LAMB is the dense baseline: it steps on gradients averaged densely. Under torch.distributed "
                         "wrap the model in DistributedDataParallel (no comm hook) and step LAMB alone; for the sparse "
                         "momentum exchange use DistributedOptimizer(SLAMB(...))")
    slamb = isinstance(optimizer, (SLAMB, OneBitLAMB))
    topk = isinstance(compression, TopK)
    if slamb and compression is not None:
        raise ValueError(f"{type(optimizer).__name__} compresses momenta itself: pass no compression "
                         "(use SLAMB(mask='topk') for a top-k mask)")
    if not slamb and not topk:
        raise ValueError("DistributedOptimizer needs a SLAMB or OneBitLAMB optimizer or "
                         f"compression=slamb_comm.TopK(...); got {type(optimizer).__name__} with "
                         f"compression={compression!r}. For dense gradient "
                         "averaging use torch.nn.parallel.DistributedDataParallel")
    names = check_named_parameters(named_parameters, optimizer.param_groups)
    return wrap(optimizer, names, compression, backward_passes_per_step, TorchCollectives(process_group),
                grad_scaler=grad_scaler)
