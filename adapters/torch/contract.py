"""Horovod's optimizer contract, shared by the three distributed optimizers.

What a user of ``hvd.DistributedOptimizer`` relies on, written once: the error messages,
``backward_passes_per_step`` and its per-parameter countdown, ``skip_synchronize()``, the
refusal of ``add_param_group`` after wrapping, the gradient hooks (registered only on ranks
inside the process set), and the once-per-step "trainable set grew" flag (one bit per rank,
plus a few words a caller may sum alongside).
"""

import contextlib
import itertools

import torch

from slamb_comm.errors import LayoutError, PeerError

__all__ = ["TOO_MANY", "ZERO_GRAD", "STEP_AFTER_SYNC", "skip_synchronize", "add_param_group_before_wrapping",
           "set_backward_passes_per_step", "register_hooks", "init_common", "launch_trainable_flag",
           "wait_trainable_flag", "at_end_of_backward", "grad_norms", "agree_finite", "reset_countdown",
           "count_backward", "end_of_backward", "agree_step", "ddp_modules_holding", "check_ddp_first_step"]

TOO_MANY = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
            "Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
             "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                   "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                   "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


@contextlib.contextmanager
def skip_synchronize(self):
    """``step()`` inside this context does not synchronize (call ``synchronize()`` first)."""
    self._should_synchronize = False
    try:
        yield
    finally:
        self._should_synchronize = True


def zero_grad_when_idle(self, set_to_none=True):
    """As ``torch.optim.Optimizer.zero_grad``; refused (AssertionError, like Horovod) between
    ``backward()`` and ``step()``/``synchronize()``, while exchanges are pending."""
    if self._pending:
        raise AssertionError(ZERO_GRAD)
    return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def add_param_group_before_wrapping(self, param_group):
    """Only during construction: the hooks and buckets of a wrapped optimizer are fixed once
    ``init_common`` has run (it sets ``_coll``)."""
    if getattr(self, "_coll", None) is not None:
        base = self.__class__.__mro__[1].__name__
        raise NotImplementedError(f"add parameter groups to the {base} optimizer before wrapping it in "
                                  "DistributedOptimizer")
    super(self.__class__, self).add_param_group(param_group)


def set_backward_passes_per_step(self, passes):
    """Change the number of backward passes accumulated per step (as in Horovod)."""
    self.backward_passes_per_step = passes
    for p in self._allreduce_delay:
        self._allreduce_delay[p] = passes


def register_hooks(opt, params=None):
    """Gradient hooks on ``params`` (default: every trainable parameter), as Horovod registers
    them: only on ranks inside the process set."""
    if not hasattr(opt, "_hook_handles"):
        opt._hook_handles = []
    if params is None:
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        opt._requires_update.append(p)
        opt._allreduce_delay[p] = opt.backward_passes_per_step
        if opt._member:
            opt._hook_handles.append(p.register_post_accumulate_grad_hook(opt._make_hook(p)))


_OPTIMIZERS = itertools.count()


def init_common(opt, coll):
    """What the distributed optimizers share: the framework's collectives, membership, the flag,
    the backward-pass countdown and the end-of-backward agreement's state."""
    opt._coll = coll
    opt._member = coll.member
    coll.recognise(opt)
    opt._flag = None  # this step's "trainable set grew" allreduce: None, (handle, buf), or False (consumed)
    opt._flag_name = f"slamb_comm.trainable.{next(_OPTIMIZERS)}"
    opt._requires_update = []
    opt._allreduce_delay = {}
    opt._fresh = True  # every countdown is full (nothing counted since the last reset)
    opt._pending = False  # gradients were counted and the step has not consumed them
    opt._in_backward = False  # between the first hook of a backward pass and its end
    opt._callback_queued = False
    opt._agreed = False  # this step's agreement (at the end of the backward pass) is done
    opt._agreements = itertools.count()  # numbers the agreement's collectives (Horovod matches names)


def reset_countdown(opt):
    """Every parameter's backward-pass countdown full again (after a step, a synchronize(), or a
    step that every rank will skip)."""
    for p in opt._allreduce_delay:
        opt._allreduce_delay[p] = opt.backward_passes_per_step
    opt._fresh = True
    opt._pending = False


def count_backward(opt, p):
    """The gradient hook of the 1-bit LAMB and top-k optimizers: Horovod's countdown of backward
    passes; when one completes, the agreement (:func:`agree_step`) runs at the end of the
    backward pass. A step that was agreed but never taken (a GradScaler skipped it) is dropped
    at the next backward pass."""
    if not opt._in_backward:
        opt._in_backward = True
        if opt._agreed and opt._fresh:
            opt._agreed = False
    if opt._allreduce_delay[p] <= 0:
        raise AssertionError(TOO_MANY)
    opt._allreduce_delay[p] -= 1
    opt._fresh = False
    opt._pending = True
    if opt._allreduce_delay[p] == 0:
        at_end_of_backward(opt)


def end_of_backward(opt):
    """The end-of-backward callback of the 1-bit LAMB and top-k optimizers (a method of theirs)."""
    opt._callback_queued = False
    opt._in_backward = False
    agree_step(opt)


def agree_step(opt):
    """The agreement of the 1-bit LAMB and top-k optimizers, once per step, before the gradients
    are exchanged: if some rank's gradient is not finite, every rank's gradients become NaN (so
    every rank's GradScaler skips, and a ``step()`` skips on every rank) and the countdown
    restarts. Collective: at the end of the backward pass, or at ``synchronize()`` if no
    backward pass ran on this rank."""
    if agree_finite(opt, opt._requires_update, opt._agreements):
        reset_countdown(opt)
    opt._agreed = True


def launch_trainable_flag(self, extra=None, device_words=None):
    """Once per step (from the first gradient hook, or from synchronize()): how many ranks have a
    parameter that became trainable after the optimizer was built (``requires_grad`` set later).
    One bit per rank (P / 31 int32 words, summed: distinct bits add up to their OR), asynchronous,
    so Horovod fuses it with the step's other tensors. ``extra``: further int32 values to sum
    alongside (their sums are left in ``self._flag_extra``); by default ``self._flag_words()``.
    ``device_words``: an int32 tensor on the collectives' device, summed after them (computed on
    the device: no host read before the flag leaves)."""
    if self._flag is not None:
        return
    if extra is None:
        extra = self._flag_words()
    known = self._known()
    self._grown = [p for p in self._all_params if p.requires_grad and p not in known]
    nw = (self._coll.size + 30) // 31
    nd = 0 if device_words is None else device_words.numel()
    buf = torch.zeros(nw + len(extra) + nd, dtype=torch.int32, device=self._coll.device)
    if len(extra):
        buf[nw:nw + len(extra)] = torch.tensor(list(extra), dtype=torch.int32)
    if nd:
        buf[nw + len(extra):] = device_words
    if self._grown:
        r = self._coll.rank
        buf[r // 31] = 1 << (r % 31)
    handle = self._coll.allreduce_async(buf, self._flag_name)
    self._flag = (handle, buf)


def wait_trainable_flag(self):
    """The parameters to adopt at this step: those that became trainable, when every rank has them;
    [] when no rank has. If only some ranks do, the caller's ``abandon()`` runs and every rank
    raises: LayoutError where the set grew, PeerError elsewhere."""
    launch_trainable_flag(self)
    handle, _ = self._flag
    self._flag = False
    words = self._coll.wait(handle).tolist()
    self._flag_extra = words[(self._coll.size + 30) // 31:]
    ranks = [r for r in range(self._coll.size) if words[r // 31] >> (r % 31) & 1]
    if not ranks:
        return []
    if len(ranks) == self._coll.size:
        return self._grown
    self._abandon()
    if self._grown:
        raise LayoutError(f"parameter(s) {[self._names.get(id(p), '?') for p in self._grown][:5]} became trainable "
                          f"(requires_grad) after the optimizer was built on rank(s) {ranks} but not on every rank; "
                          "set requires_grad alike everywhere; the step was abandoned on every rank")
    raise PeerError(f"rank(s) {ranks} have parameters that became trainable after the optimizer was built, the "
                    "others do not (see their error); the step was abandoned on every rank", ranks)


def at_end_of_backward(opt):
    """Have ``opt._end_of_backward()`` run once when the running backward pass ends (a callback
    of torch's autograd engine, as DDP's reducer uses): queued from the first gradient hook of
    a backward pass whose countdown completes, so it runs on every rank whose backward pass
    produced gradients, before ``backward()`` returns."""
    if not opt._callback_queued:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(opt._end_of_backward)
        except RuntimeError:  # not inside a backward pass (a hook called by hand): step() agrees instead
            return
        opt._callback_queued = True


def grad_norms(params, ord=2):
    """Per parameter of ``params`` that has a gradient, the norm of its gradient (float32, one
    multi-tensor ``_foreach_norm``, on the gradients' device; None if no parameter has one)."""
    grads = [p.grad.coalesce()._values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.stack([n.float() for n in torch._foreach_norm(grads, ord)])


def agree_finite(opt, params, counter, norms=None):
    """One collective: which gradients of ``params`` hold a NaN or Inf on some rank. Each such
    gradient becomes NaN on every rank (as Horovod's averaged gradient would), so that every
    rank's AMP ``GradScaler`` -- or any finiteness check -- sees the same and skips the step
    alike; returns whether there was any.

    ``norms``: this rank's :func:`grad_norms` of ``params`` if the caller has them (a norm is
    finite only if the gradient is; the default max-norm cannot overflow, an L2 norm may). One
    allreduce of one int32 per parameter and one host read; ``counter`` numbers the collective
    (Horovod matches collectives by name)."""
    have = [i for i, p in enumerate(params) if p.grad is not None]
    bad = torch.zeros(len(params), dtype=torch.int32, device=opt._coll.device)
    if have:
        norms = grad_norms(params, float("inf")) if norms is None else norms
        bad[torch.tensor(have, device=bad.device)] = (~torch.isfinite(norms)).to(device=bad.device, dtype=torch.int32)
    opt._coll.allreduce(bad, f"slamb_comm.finite.{next(counter)}")
    which = bad.nonzero().reshape(-1).tolist()  # the one host read
    with torch.no_grad():
        for i in which:
            if params[i].grad is not None:
                params[i].grad.fill_(float("nan"))
    return bool(which)


# ----------------------------------------------------------------------------- DDP misuse, at the first step
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


def ddp_modules_holding(params):
    """The live ``DistributedDataParallel`` modules that hold any of ``params``, each with the
    comm-hook states registered on it: ``[(ddp, [state, ...])]``. One scan of the garbage
    collector's objects (tens of milliseconds; run once per optimizer, at its first step)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(p) for p in params}
    out = []
    for obj in gc.get_objects():
        if not issubclass(type(obj), DistributedDataParallel):
            continue
        held = getattr(obj, "_module_parameters", None)
        if held is None:
            held = list(obj.module.parameters())
        if any(id(p) in wanted for p in held):
            out.append((obj, [s for _, s in getattr(obj, "_comm_hooks", [])]))
    return out


def check_ddp_first_step(opt):
    """At the first ``step()`` (or ``synchronize()``) of a distributed SLAMB or top-k optimizer
    that finds a gradient, once: refuse the silent misuses, with an error naming the fix
    (RuntimeError, raised alike on every rank that runs the same script, before this step's
    exchange starts):

    * its parameters belong to a DDP module without slamb_comm's hook bound to it (DDP then
      averages every gradient densely on top of slamb_comm's own exchange);
    * a ``SlambHookState`` bound to it that DDP never called (the hook was not registered on
      the module that ran the backward pass, e.g. Lightning's DDPStrategy off CUDA).

    Call from the distributed optimizer's ``step()`` after its closure ran, or from its
    ``synchronize()``."""
    if getattr(opt, "_ddp_checked", False) or not getattr(opt, "_member", True):
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(p.grad is None for p in params):
        return  # a step without a backward pass (e.g. to create state): nothing was exchanged yet
    opt._ddp_checked = True
    slamb = hasattr(opt, "_launch")
    what = f"the distributed {opt.__class__.__name__} optimizer"
    hook_state = getattr(opt, "_slamb_hook_state", None)
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
