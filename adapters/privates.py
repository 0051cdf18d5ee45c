"""Every private attribute of a framework that the adapters read or write, in one place, each with why.

Nothing else in ``adapters/`` touches another object's private attribute (an underscored name its own
class does not define): what the frameworks keep private and slamb_comm still needs goes through the
functions below, each naming the attribute, what it is for, and why no public form serves. The
frameworks are imported by the callers, never here, so this module imports none of them.

Besides these accesses, two adapters override a framework's own protected hooks, which is how those
frameworks are extended (named here so that the list is whole): Lightning's ``ModelParallelStrategy``
(``_data_parallel_size``, ``_tensor_parallel_size`` and ``_device_mesh``, set in
``SlambModelParallelStrategy.setup_environment`` as Lightning's own ``setup_environment`` sets them)
and ``transformers.Trainer`` (``_save``, ``_save_optimizer_and_scheduler``,
``_load_optimizer_and_scheduler``, overridden by ``SlambTrainer`` to write and read the per-rank state
beside the Trainer's checkpoint).
"""

import sys

__all__ = ["foreach_copy_", "foreach_mul_", "foreach_add_", "foreach_norm", "version_of", "queue_autograd_callback",
           "ddp_comm_hooks", "scaler_stage", "mark_lr_scheduler_step", "hand_mesh_to_module",
           "saves_distributed_checkpoint", "trainer_save", "trainer_save_optimizer_and_scheduler",
           "trainer_load_optimizer_and_scheduler", "exit_now"]


def _torch():
    return sys.modules["torch"]  # imported by every caller before it calls


# ----------------------------------------------------------------------------- torch
def foreach_copy_(dst, src):
    """``torch._foreach_copy_``: one multi-tensor copy of ``src`` into ``dst`` (a flat buffer's
    parameters and gradients). torch's own optimizers use the ``_foreach_`` family for their
    multi-tensor paths; torch has no public multi-tensor copy."""
    _torch()._foreach_copy_(dst, src)


def foreach_mul_(tensors, scalar):
    """``torch._foreach_mul_``: one multi-tensor in-place scale (DeMo's decoupled weight decay)."""
    _torch()._foreach_mul_(tensors, scalar)


def foreach_add_(tensors, others, alpha):
    """``torch._foreach_add_``: one multi-tensor in-place ``tensors += alpha * others`` (DeMo's update)."""
    _torch()._foreach_add_(tensors, others, alpha=alpha)


def foreach_norm(tensors, ord):
    """``torch._foreach_norm``: every tensor's norm in one multi-tensor launch (the finiteness
    agreement's norms); ``torch.linalg.vector_norm`` takes one tensor at a time."""
    return _torch()._foreach_norm(tensors, ord)


def version_of(t):
    """``Tensor._version``: autograd's in-place version counter of ``t``, bumped by every in-place
    operator (``clip_grad_norm_`` on a gradient). How a step sees that a recipe changed a gradient
    after the exchange took it; autograd has no public equivalent."""
    return t._version


def queue_autograd_callback(fn):
    """``torch.autograd.Variable._execution_engine.queue_callback``: have ``fn()`` run when the running
    backward pass ends (RuntimeError outside one). DDP's reducer uses the same queue for its own
    end-of-backward work; autograd exposes no public callback at the end of a backward pass."""
    _torch().autograd.Variable._execution_engine.queue_callback(fn)


def ddp_comm_hooks(ddp):
    """``DistributedDataParallel._comm_hooks``: the ``(hook, state)`` pairs registered on ``ddp``
    (to refuse a SLAMB optimizer under a DDP without slamb_comm's hook). DDP has no accessor."""
    return list(getattr(ddp, "_comm_hooks", []))


def scaler_stage(grad_scaler, optimizer):
    """``GradScaler._per_optimizer_states[id(optimizer)]["stage"]``: whether ``grad_scaler.unscale_``
    already ran for ``optimizer`` in this iteration (its ``update()`` resets it); None where it has
    no entry (none is made). torch has kept it since AMP's first release; there is no public query."""
    state = dict.get(getattr(grad_scaler, "_per_optimizer_states", {}), id(optimizer))
    return None if state is None else state.get("stage")


def mark_lr_scheduler_step(opt, wrapper):
    """``LRScheduler``'s marks on an optimizer's ``step`` (torch's ``_opt_called`` on the optimizer,
    ``_wrapped_by_lr_sched`` on the step): a scheduler moved onto the distributed optimizer then does
    not warn that it stepped before the optimizer. torch reads them in ``LRScheduler.step``; it has no
    public way to say that a step is tracked. Returns ``wrapper`` (the tracked step) marked."""
    def tracked(*args, **kwargs):
        opt._opt_called = True  # the optimizer stepped
        return wrapper(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # the step is tracked
    return tracked


# ----------------------------------------------------------------------------- Lightning
def hand_mesh_to_module(module, mesh):
    """``LightningModule._device_mesh``: hand the strategy's mesh to the module, as Lightning's own
    ``ModelParallelStrategy.setup_environment`` does (``configure_model`` reads ``self.device_mesh``);
    Lightning has no setter."""
    module._device_mesh = mesh


def saves_distributed_checkpoint(strategy):
    """``ModelParallelStrategy._save_distributed_checkpoint``: whether the strategy writes a
    ``torch.distributed.checkpoint`` folder or one file (its constructor's ``save_distributed_checkpoint``);
    Lightning keeps no public copy."""
    return strategy._save_distributed_checkpoint


# ----------------------------------------------------------------------------- Hugging Face
def trainer_save(cls, trainer, output_dir, state_dict):
    """``transformers.Trainer._save`` as ``super(cls, trainer)`` has it: the override's call of the
    Trainer's own (protected) save of the model, the Trainer's extension point."""
    return super(cls, trainer)._save(output_dir, state_dict=state_dict)


def trainer_save_optimizer_and_scheduler(cls, trainer, output_dir):
    """``transformers.Trainer._save_optimizer_and_scheduler`` as ``super(cls, trainer)`` has it."""
    return super(cls, trainer)._save_optimizer_and_scheduler(output_dir)


def trainer_load_optimizer_and_scheduler(cls, trainer, checkpoint):
    """``transformers.Trainer._load_optimizer_and_scheduler`` as ``super(cls, trainer)`` has it."""
    return super(cls, trainer)._load_optimizer_and_scheduler(checkpoint)


# ----------------------------------------------------------------------------- Python
def exit_now(code):
    """``os._exit``: end the process at once, without atexit handlers (Python's documented API for a
    child or a failing rank, despite its underscore; see the Horovod adapter's ``abort_on_exception``)."""
    import os

    os._exit(code)
