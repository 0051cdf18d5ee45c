"""The silent misuses under DDP, refused at the first step with an error naming the fix.

A SLAMB or top-k distributed optimizer whose parameters sit in a ``DistributedDataParallel`` module
without slamb_comm's hook (DDP would average every gradient densely on top of slamb_comm's own
exchange), and a hook state that DDP never called: :func:`check_ddp_first_step`.
"""

__all__ = ["DDP_WITHOUT_SLAMB_HOOK", "DDP_WITH_TOPK_OPTIMIZER", "HOOK_NEVER_CALLED", "comm_hook_states",
           "ddp_modules_holding", "check_ddp_first_step"]

from ...privates import ddp_comm_hooks

DDP_WITHOUT_SLAMB_HOOK = (
    "{what}'s parameters {names} belong to a torch DistributedDataParallel module that has no slamb_comm "
    "slamb_hook bound to this optimizer{found}: DDP averages every gradient densely, and SLAMB then exchanges "
    "its momenta on top (more bytes than plain DDP, and SLAMB sees averaged gradients instead of each rank's "
    "own). Fix: ddp.register_comm_hook(slamb_comm.adapters.torch.SlambHookState(optimizer), "
    "slamb_comm.adapters.torch.slamb_hook) before the first backward pass; under Lightning use "
    "slamb_comm.adapters.lightning.SlambDDPStrategy(), under Hugging Face slamb_comm.adapters.huggingface "
    "(SlambTrainer, or install() after accelerator.prepare); see docs/integrations.md")
DDP_WITH_TOPK_OPTIMIZER = (
    "{what}'s parameters {names} belong to a torch DistributedDataParallel module: DDP averages every gradient "
    "densely, and the top-k exchange then runs again on the average (more bytes than plain DDP). Fix: under DDP "
    "keep your own optimizer unwrapped and register the top-k hook instead: ddp.register_comm_hook("
    "slamb_comm.adapters.torch.TopKHookState(model.named_parameters(), slamb_comm.TopK(...)), "
    "slamb_comm.adapters.torch.topk_hook); without DDP keep DistributedOptimizer(..., compression=TopK(...)) "
    "and do not wrap the model in DDP; see docs/integrations.md")
HOOK_NEVER_CALLED = (
    "{hook} was handed to DDP (a {state}) but DDP never called it before the first optimizer step(): the "
    "gradients were averaged densely by DDP (or not exchanged at all). Register it on the DistributedDataParallel "
    "module that runs the forward and backward passes: ddp.register_comm_hook(state, {hook}). Under Lightning, "
    "whose DDPStrategy registers comm hooks on CUDA only, use slamb_comm.adapters.lightning.SlambDDPStrategy; "
    "under Hugging Face, slamb_comm.adapters.huggingface; see docs/integrations.md")


def comm_hook_states(ddp):
    """The states of the comm hooks registered on the ``DistributedDataParallel`` module ``ddp``."""
    return [state for _, state in ddp_comm_hooks(ddp)]


def ddp_modules_holding(params):
    """The live ``DistributedDataParallel`` modules that reduce any of ``params`` (trainable, not in
    their ``parameters_to_ignore``), each with the comm-hook states registered on it:
    ``[(ddp, [state, ...])]``. One scan of the garbage collector's objects (tens of
    milliseconds; run once per optimizer, at its first step)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(p) for p in params}
    out = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), DistributedDataParallel):
            continue
        ignored = obj.parameters_to_ignore
        if any(id(p) in wanted for n, p in obj.module.named_parameters() if p.requires_grad and n not in ignored):
            out.append((obj, comm_hook_states(obj)))
    return out


def check_ddp_first_step(opt, params, slamb, hook_state):
    """At the first ``step()`` (or ``synchronize()``) of a distributed SLAMB or top-k optimizer
    ``opt`` that finds a gradient among its ``params``, once: refuse the silent misuses, with an
    error naming the fix (RuntimeError, raised alike on every rank that runs the same script,
    before this step's exchange starts):

    * its parameters belong to a DDP module without slamb_comm's hook bound to it (DDP then
      averages every gradient densely on top of slamb_comm's own exchange); for the top-k
      optimizer (``slamb`` False) any DDP module does;
    * ``hook_state``, a ``SlambHookState`` bound to it, that DDP never called (the hook was not
      registered on the module that ran the backward pass, e.g. Lightning's DDPStrategy off CUDA).
    """
    what = f"the distributed {opt.__class__.__name__} optimizer"
    for ddp, states in ddp_modules_holding(params):
        mine = {id(p) for p in params}
        names = [n for n, p in ddp.module.named_parameters() if id(p) in mine][:3]
        if not slamb:
            raise RuntimeError(DDP_WITH_TOPK_OPTIMIZER.format(what=what, names=names))
        if not any(getattr(s, "optimizer", None) is opt for s in states):
            found = f" (its comm hook states: {[type(s).__name__ for s in states]})" if states else ""
            raise RuntimeError(DDP_WITHOUT_SLAMB_HOOK.format(what=what, names=names, found=found))
    if hook_state is not None and hook_state.calls == 0:
        raise RuntimeError(HOOK_NEVER_CALLED.format(hook="slamb_hook", state="SlambHookState"))
