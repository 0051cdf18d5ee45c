"""Horovod's optimizer contract, one object per distributed optimizer: :class:`Contract`.

What a user of ``hvd.DistributedOptimizer`` relies on, written once and owned by each of the three
distributed optimizers (its ``contract``): the gradient hooks (registered only on ranks inside the
process set), ``backward_passes_per_step`` and its per-parameter countdown, the end-of-backward
callback, ``synchronize()``/``skip_synchronize()``'s bookkeeping, the refusal of ``zero_grad()``
while gradients are pending, the once-per-step "trainable set grew" flag (one bit per rank, plus a
few words the optimizer sums alongside), the finite-gradient agreement, and the error messages.
The contract holds its own state; what it needs of its optimizer (what to do when a parameter's
countdown completes, when the backward pass ends, how to abandon a step, which parameters it
knows) is handed to it as callables at construction. :func:`~.ddp_misuse.check_ddp_first_step`
refuses the silent misuses under DDP at the first step.
"""

import contextlib
import itertools
from typing import NamedTuple

import torch

from slamb_comm.errors import LayoutError, NonFiniteError, PeerError

from ...privates import foreach_norm, queue_autograd_callback, version_of
from .ddp_misuse import check_ddp_first_step

__all__ = ["TOO_MANY", "ZERO_GRAD", "STEP_AFTER_SYNC", "Contract", "make_contract", "DistributedMixin", "Flag",
           "GradientNotes", "grad_norms", "queue_callback", "flagged_ranks", "nonfinite_error"]

TOO_MANY = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
            "Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
             "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                   "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                   "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")

_OPTIMIZERS = itertools.count()


class Flag(NamedTuple):
    """The summed flag of a step: the parameters to adopt (those that became trainable on every
    rank; [] when none did) and the optimizer's extra words, summed over the ranks."""

    grown: list
    words: list


class _Pending(NamedTuple):
    handle: object
    buf: torch.Tensor


class Contract:
    """Horovod's optimizer contract of one distributed optimizer (see the module docstring).

    Args:
        coll: the framework's collectives (``TorchCollectives``, Horovod's); replaced by
            :meth:`rebind` when an elastic job changes size.
        names: ``id(parameter) -> name``, for error messages.
        backward_passes_per_step: backward passes accumulated per step (Horovod's).
        ready: ``ready(p)``, called from ``p``'s gradient hook when its countdown completes.
        end_of_backward: called once when a backward pass whose countdown completed ends.
        abandon: drops the step in flight on this rank (called before a collective refusal).
        known: ``known()`` -> the parameters the optimizer already steps (for the flag).
    """

    def __init__(self, coll, names, backward_passes_per_step, ready, end_of_backward, abandon, known):
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.coll, self.member, self.names = coll, coll.member, names
        self.passes = backward_passes_per_step
        self._ready, self._end, self._abandon, self._known = ready, end_of_backward, abandon, known
        self.params = []  # the parameters whose gradients the optimizer exchanges (requires_grad at hook time)
        self.hook_handles = []
        self._left = {}  # parameter -> backward passes left before its exchange
        self.fresh = True  # every countdown is full (nothing counted since the last reset)
        self.pending = False  # gradients were counted and the step has not consumed them
        self.in_backward = False  # between the first hook of a backward pass and its end
        self.agreed = False  # this step's agreement (at the end of the backward pass) is done
        self.synchronized = False  # synchronize() ran and step() has not consumed it
        self.should_synchronize = True  # False inside skip_synchronize()
        self._callback_queued = False
        self._flag = None  # this step's flag: None (not launched), _Pending, or False (consumed)
        self._grown = []
        self.flag_name = f"slamb_comm.trainable.{next(_OPTIMIZERS)}"
        self.agreements = itertools.count()  # numbers the agreement's collectives (Horovod matches names)
        self._ddp_checked = False
        #: what the last :meth:`agree_finite` found: the ranks whose gradients were not finite, and the tensors
        self.nonfinite = ([], [])

    def rebind(self, coll, tag):
        """Use ``coll`` from now on (an elastic job changed size), naming the collectives by ``tag``
        (the same on every worker)."""
        self.coll, self.member = coll, coll.member
        self.flag_name, self.agreements = f"{tag}.trainable", itertools.count()

    # ------------------------------------------------------------------ hooks and the countdown
    def register_hooks(self, params):
        """Gradient hooks on ``params``, as Horovod registers them: only on ranks inside the process set."""
        for p in params:
            self.params.append(p)
            self._left[p] = self.passes
            if self.member:
                self.hook_handles.append(p.register_post_accumulate_grad_hook(self._hook(p)))

    def _hook(self, p):
        def hook(param):
            self._ready(p)
        return hook

    def set_passes(self, passes):
        """Change the number of backward passes accumulated per step (as in Horovod)."""
        self.passes = passes
        self.reset_countdown()

    def reset_countdown(self):
        """Every parameter's countdown full again (after a step, a synchronize(), or a step that every
        rank skips)."""
        for p in self._left:
            self._left[p] = self.passes
        self.fresh = True
        self.pending = False

    def count(self, p):
        """One backward pass of ``p`` (its gradient hook). Returns True when its countdown completes;
        then the end-of-backward callback is queued. AssertionError (as Horovod's) past the count."""
        if self._left[p] <= 0:
            raise AssertionError(TOO_MANY)
        self._left[p] -= 1
        self.fresh = False
        self.pending = True
        if self._left[p] == 0:
            self.queue_end_of_backward()
            return True
        return False

    def count_backward(self, p):
        """The gradient hook of the 1-bit LAMB and top-k optimizers: :meth:`count`, and at the first
        hook of a backward pass a step that was agreed but never taken (a GradScaler skipped it) is
        dropped. Returns whether ``p``'s countdown completed."""
        if not self.in_backward:
            self.in_backward = True
            if self.agreed and self.fresh:
                self.agreed = False
        return self.count(p)

    def queue_end_of_backward(self):
        """Have the end-of-backward callback run once when the running backward pass ends (a callback
        of torch's autograd engine, as DDP's reducer uses), so it runs on every rank whose backward
        pass produced gradients, before ``backward()`` returns."""
        if not self._callback_queued:
            try:
                queue_callback(self._ended)
            except RuntimeError:  # not inside a backward pass (a hook called by hand): step() agrees instead
                return
            self._callback_queued = True

    def _ended(self):
        self._callback_queued = False
        self.in_backward = False
        self._end()

    def check_ddp_once(self, opt, params, slamb, hook_state=None):
        """:func:`check_ddp_first_step` at the first step that finds a gradient, once."""
        if self._ddp_checked or not self.member or all(p.grad is None for p in params):
            return
        self._ddp_checked = True
        check_ddp_first_step(opt, params, slamb, hook_state)

    # ------------------------------------------------------------------ synchronize / zero_grad
    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (call ``synchronize()`` first)."""
        self.should_synchronize = False
        try:
            yield
        finally:
            self.should_synchronize = True

    def check_zero_grad(self, idle):
        """AssertionError (Horovod's) unless ``idle``: ``zero_grad()`` between ``backward()`` and
        ``step()``/``synchronize()`` would race with exchanges in flight."""
        if not idle:
            raise AssertionError(ZERO_GRAD)

    def forget_step(self):
        """A loaded state or a reset: no step in progress, nothing agreed or synchronized."""
        self.synchronized = self.agreed = False
        self.should_synchronize = True
        self.reset_countdown()

    # ------------------------------------------------------------------ the flag
    def launch_flag(self, all_params, extra, device_words=None):
        """Once per step (from the first gradient hook, or from synchronize()): how many ranks have a
        parameter that became trainable after the optimizer was built (``requires_grad`` set later).
        One bit per rank (P / 31 int32 words, summed: distinct bits add up to their OR),
        asynchronous, so Horovod fuses it with the step's other tensors. ``extra``: further int32
        values summed alongside; ``device_words``: an int32 tensor on the collectives' device,
        summed after them (computed on the device: no host read before the flag leaves)."""
        if self._flag is not None:
            return
        known = self._known()
        self._grown = [p for p in all_params if p.requires_grad and p not in known]
        coll = self.coll
        nw = (coll.size + 30) // 31
        nd = 0 if device_words is None else device_words.numel()
        buf = torch.zeros(nw + len(extra) + nd, dtype=torch.int32, device=coll.device)
        if len(extra):
            buf[nw:nw + len(extra)] = torch.tensor(list(extra), dtype=torch.int32)
        if nd:
            buf[nw + len(extra):] = device_words
        if self._grown:
            buf[coll.rank // 31] = 1 << (coll.rank % 31)
        self._flag = _Pending(coll.allreduce_async(buf, self.flag_name), buf)

    @property
    def flag_launched(self):
        """Whether this step's flag is in flight (launched and not waited for)."""
        return bool(self._flag)

    def wait_flag(self):
        """The step's :class:`Flag`. If only some ranks have new trainable parameters, the step is
        abandoned and every rank raises: LayoutError where the set grew, PeerError elsewhere."""
        pending, self._flag = self._flag, False
        words = self.coll.wait(pending.handle).tolist()
        nw = (self.coll.size + 30) // 31
        ranks = [r for r in range(self.coll.size) if words[r // 31] >> (r % 31) & 1]
        if not ranks or len(ranks) == self.coll.size:
            return Flag(self._grown if ranks else [], words[nw:])
        self._abandon()
        if self._grown:
            names = [self.names.get(id(p), "?") for p in self._grown][:5]
            raise LayoutError(f"parameter(s) {names} became trainable (requires_grad) after the optimizer was built "
                              f"on rank(s) {ranks} but not on every rank; set requires_grad alike everywhere; the step "
                              "was abandoned on every rank")
        raise PeerError(f"rank(s) {ranks} have parameters that became trainable after the optimizer was built, the "
                        "others do not (see their error); the step was abandoned on every rank", ranks)

    def drop_flag(self):
        """Forget this step's flag (waiting for it if it is in flight): the next :meth:`launch_flag`
        launches one."""
        if self._flag:
            self.coll.wait(self._flag.handle)
        self._flag = None

    def hold_flag(self):
        """This step's flag was used: :meth:`launch_flag` launches none until :meth:`drop_flag`."""
        self._flag = False

    # ------------------------------------------------------------------ agreement
    def agree_finite(self, params, norms=None):
        """One collective: which gradients of ``params`` hold a NaN or Inf on some rank, and on which
        ranks. Each such gradient becomes NaN on every rank (as Horovod's averaged gradient would), so
        that every rank's AMP ``GradScaler`` -- or any finiteness check -- sees the same and skips the
        step alike; returns the ranks whose gradients were not finite ([] when none), which
        :attr:`nonfinite` keeps with the tensors' names. ``norms``: this rank's :func:`grad_norms` of
        ``params`` if the caller has them (a norm is finite only if the gradient is). One allreduce of
        one int32 per parameter and one bit per rank, and one host read."""
        have = [i for i, p in enumerate(params) if p.grad is not None]
        n, coll = len(params), self.coll
        bad = torch.zeros(n + (coll.size + 30) // 31, dtype=torch.int32, device=coll.device)
        if have:
            norms = grad_norms(params, float("inf")) if norms is None else norms
            flags = (~torch.isfinite(norms)).to(device=bad.device, dtype=torch.int32)
            bad[torch.tensor(have, device=bad.device)] = flags
            bad[n + coll.rank // 31] = flags.max() << (coll.rank % 31)  # this rank's bit (distinct bits sum to an OR)
        coll.allreduce(bad, f"slamb_comm.finite.{next(self.agreements)}")
        words = bad.tolist()  # the one host read
        which = [i for i in range(n) if words[i]]
        ranks = [r for r in range(coll.size) if words[n + r // 31] >> (r % 31) & 1]
        self.nonfinite = (ranks, [self.names.get(id(params[i]), "?") for i in which])
        with torch.no_grad():
            for i in which:
                if params[i].grad is not None:
                    params[i].grad.fill_(float("nan"))
        return ranks

    def agree_step(self):
        """The agreement of the 1-bit LAMB and top-k optimizers, once per step, before the gradients
        are exchanged: if some rank's gradient is not finite, every rank's gradients become NaN (so
        every rank's GradScaler skips, and a ``step()`` skips on every rank) and the countdown
        restarts. Collective: at the end of the backward pass, or at ``synchronize()`` if no
        backward pass ran on this rank."""
        if self.agree_finite(self.params):
            self.reset_countdown()
        self.agreed = True


def make_contract(opt, coll, names, backward_passes_per_step, ready, end_of_backward, abandon, known):
    """The :class:`Contract` of the distributed optimizer ``opt`` (the framework's collectives may mark
    ``opt`` as one of theirs: Horovod's ``broadcast_optimizer_state`` recognises its own optimizers)."""
    coll.recognise(opt)
    return Contract(coll, names, backward_passes_per_step, ready, end_of_backward, abandon, known)


class DistributedMixin:
    """What the three distributed optimizers (:class:`~.slamb.DistributedSlamb`,
    :class:`~.onebit.DistributedOneBit`, :class:`~.topk.DistributedTopK`) offer alike, on their
    :class:`Contract` (``contract``): Horovod's ``backward_passes_per_step`` (and its setter),
    ``skip_synchronize()``, and the refusal of ``add_param_group`` once wrapped (the hooks and buckets
    are fixed then). The base of each, so that ``super()`` in them reaches the wrapped optimizer's
    class (:func:`~.optimizer.wrap` builds ``(the distributed optimizer, the user's class)``)."""

    #: the optimizer's :class:`Contract` (set by each distributed optimizer's constructor)
    contract = None

    @property
    def backward_passes_per_step(self):
        """Backward passes accumulated locally per step (Horovod's)."""
        return self.contract.passes

    def set_backward_passes_per_step(self, passes):
        """Change the number of backward passes accumulated per step (as in Horovod)."""
        self.contract.set_passes(passes)

    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (call ``synchronize()`` first)."""
        return self.contract.skip_synchronize()

    def add_param_group(self, param_group):
        """Only before wrapping: add parameter groups to the optimizer, then wrap it."""
        if self.contract is not None:
            raise NotImplementedError(f"add parameter groups to the {type(self).__name__} optimizer before wrapping "
                                      "it in DistributedOptimizer")
        super().add_param_group(param_group)


def queue_callback(fn):
    """Have ``fn()`` run when the running backward pass ends (RuntimeError outside one)."""
    queue_autograd_callback(fn)  # autograd's own queue, as DDP's reducer uses it


def flagged_ranks(coll, mine, name):
    """The ranks of ``coll`` that say ``mine`` (one allgather of one int32, under ``name``: for a failure
    path that every rank takes alike)."""
    flag = torch.tensor([int(bool(mine))], dtype=torch.int32, device=coll.device)
    return [r for r, c in enumerate(coll.allgather(flag, name).tolist()) if c]


def nonfinite_error(what, ranks, names, tail):
    """The NonFiniteError of a step that non-finite values stopped on every rank, naming the ``ranks`` whose
    own values were not (none: the sum over the ranks overflowed) and the tensors ``names``; ``tail`` says
    what was done about it."""
    where = f" in {list(names)[:5]}" if names else ""
    src = f"from rank(s) {list(ranks)}" if ranks else "in the sum over the ranks (no rank's own values were)"
    return NonFiniteError(f"{what}: non-finite values (NaN/Inf) {src}{where}; {tail}", ranks, names)


def grad_norms(params, ord=2):
    """Per parameter of ``params`` that has a gradient, the norm of its gradient (float32, one
    multi-tensor ``_foreach_norm``, on the gradients' device; None if no parameter has one)."""
    grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    return torch.stack([n.float() for n in foreach_norm(grads, ord)])


class GradientNotes:
    """What a step's agreement saw of the gradients, to tell whether this rank changed them
    before ``step()``. In-place changes through torch's operators bump a gradient's version
    counter (``clip_grad_norm_`` does, even when it leaves the values as they are);
    ``GradScaler.unscale_`` and writes through ``.data`` do not, so the gradients' L2 norms are
    compared as well (one read of every gradient)."""

    __slots__ = ("_versions", "_norms")

    def __init__(self):
        self._versions = {}  # parameter -> (its gradient, the gradient's version) when noted
        self._norms = None

    def take(self, params, norms=None):
        """Note ``params``' gradients now (``norms``: their :func:`grad_norms`, if known)."""
        self._versions = {p: _version(p) for p in params}
        self._norms = grad_norms(params) if norms is None else norms

    def clear(self):
        self._versions, self._norms = {}, None

    def changed(self, params):
        """Whether some gradient of ``params`` is not as noted."""
        if any(not _same(_version(p), self._versions.get(p)) for p in params):
            return True
        norms = grad_norms(params)
        if norms is None or self._norms is None:
            return (norms is None) != (self._norms is None)
        return not torch.equal(norms, self._norms)


def _version(p):
    """``p``'s gradient and its in-place version counter (None without a gradient)."""
    g = p.grad
    return None if g is None else (g, version_of(g))  # autograd's in-place counter


def _same(a, b):
    """Whether two :func:`_version` notes are of the same gradient tensor, unchanged."""
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] == b[1]
