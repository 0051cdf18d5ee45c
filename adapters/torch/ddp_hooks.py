"""DDP communication hooks, each beside its state: :func:`slamb_hook`, :func:`topk_hook`.

:func:`slamb_hook` with :class:`SlambHookState` starts SLAMB's momentum exchange from DDP's
buckets; :func:`topk_hook` with :class:`TopKHookState` gives any optimizer top-k gradients
with error feedback. PyTorch's convention for compressed communication
(``ddp.register_comm_hook(state, hook)``), laid out as ``torch.distributed.algorithms.ddp_comm_hooks``.
"""

import logging
import weakref

import numpy as np
import torch

from slamb_comm import arrays as _arr
from slamb_comm.wire.codecs import Layout, TopK
from slamb_comm.exchange.communicator import Communicator
from slamb_comm.errors import NonFiniteError
from slamb_comm.wire.stats import Traffic

from .collectives import TorchTransport
from .distributed_slamb import DistributedSlamb
from .distributed_topk import amp_scale, loss_scaled
from .tensors import as_compute, cuda_scope, np_dtype, state_dtype, tensor_of

__all__ = ["SlambHookState", "slamb_hook", "TopKHookState", "topk_hook"]

_log = logging.getLogger("slamb_comm")


def _done(tensor):
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class SlambHookState:
    """State of :func:`slamb_hook`: the distributed SLAMB optimizer whose exchange the hook starts.

    Usage (two lines of a stock DDP script change)::

        opt = DistributedOptimizer(SLAMB(ddp.parameters(), lr=1e-3, ratio=0.1, beta3=0.9),
                                   named_parameters=ddp.module.named_parameters())
        ddp.register_comm_hook(SlambHookState(opt), slamb_hook)

    For frameworks that wrap the model in DDP before the optimizer exists (Lightning, Hugging
    Face), the state can be made first and bound later, before the first backward pass::

        state = SlambHookState()
        ddp.register_comm_hook(state, slamb_hook)
        ...                                    # the framework builds the optimizer
        state.bind(DistributedOptimizer(SLAMB(...), named_parameters=...))

    A backward pass that reaches the hook before :meth:`bind` raises RuntimeError naming the fix;
    so does the optimizer's first ``step()`` if DDP never called the hook (it was registered
    on another module, or a framework did not register it: Lightning's DDPStrategy registers
    comm hooks on CUDA only). ``calls`` counts the buckets the hook was handed.

    Tuning guide (SLAMB's knobs live on the optimizer):

    * ``ratio`` (k): the fraction of each large tensor's momentum averaged per step. The paper
      uses 0.1; the bytes per step are about ``k * N * value_bytes + 4 N / H``.
    * ``value_dtype='float16'`` halves the payload (values beyond +-65504 skip the step).
    * ``sync_interval`` (H): parameters are averaged every H steps (paper: 100).
    * ``beta3``: sweep it with the learning rate (0.9-0.999); it matters as much as lr at short
      budgets (docs/algorithm.md section 5).
    * DDP's ``bucket_cap_mb`` sets how soon a bucket's exchange starts; smaller buckets start
      earlier.

    The hook keeps the gradients local (SLAMB never averages gradients): DDP writes back each
    rank's own gradient. Gradient clipping then clips the local gradient, as with the Horovod
    adapter. The state pickles without the optimizer or its process group (it holds no state
    of its own: checkpoint ``opt.state_dict()``).
    """

    __slots__ = ("optimizer", "calls", "unpickled")

    def __init__(self, optimizer=None):
        self.optimizer = None
        self.calls = 0
        self.unpickled = False  # made by pickle, without its optimizer
        if optimizer is not None:
            self.bind(optimizer)

    def bind(self, optimizer):
        """Give the state its ``DistributedOptimizer(SLAMB(...))`` (before the first backward pass);
        returns the optimizer. From then on the hook, not the parameters' gradient hooks, launches
        its exchange."""
        if not isinstance(optimizer, DistributedSlamb):
            raise TypeError("SlambHookState takes the DistributedOptimizer(SLAMB(...)) that you step, "
                            f"got {type(optimizer).__name__}"
                            + (" (wrap it: slamb_comm.adapters.torch.DistributedOptimizer(opt, named_parameters=...))"
                               if type(optimizer).__name__ == "SLAMB" else ""))
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise RuntimeError("this SlambHookState is bound to another optimizer already; one state per optimizer")
        if self.calls:
            raise RuntimeError("SlambHookState.bind() after DDP already called slamb_hook: bind before the first "
                               "backward pass")
        optimizer.attach_hook_state(self)  # the hook launches the exchange; its first step() checks DDP called it
        self.optimizer = optimizer
        return optimizer

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.optimizer = None
        self.calls = 0
        self.unpickled = True


def slamb_hook(state, bucket):
    """DDP communication hook for SLAMB: start the masked momentum exchange of the bucket's
    parameters (asynchronously) and return the bucket's local gradients unchanged. The step's
    agreement follows at the end of the backward pass (see the distributed optimizer)."""
    opt = state.optimizer
    if opt is None:
        if state.unpickled:
            raise RuntimeError("this SlambHookState was unpickled without its optimizer; build a new one")
        raise RuntimeError("slamb_hook ran before its SlambHookState was bound to an optimizer: call "
                           "state.bind(slamb_comm.adapters.torch.DistributedOptimizer(SLAMB(...), "
                           "named_parameters=...)) before the first backward pass (Lightning: SlambDDPStrategy "
                           "binds it for you)")
    state.calls += 1
    opt.ddp_bucket(bucket)  # the optimizer's own method: the hook is its DDP front end
    return _done(bucket.buffer())


class TopKHookState:
    """State of :func:`topk_hook`: top-k with error feedback for DDP, under any optimizer.

    Args:
        named_parameters: the model's ``(name, parameter)`` pairs (``ddp.module.named_parameters()``):
            error buffers are kept per parameter name, so they survive DDP's bucket rebuild
            after the first iteration and go into a checkpoint (:meth:`state_dict`).
        compression: a :class:`slamb_comm.TopK` (ratio, payload dtype, non-finite policy,
            always-dense rule).
        process_group: the group DDP uses (default: all ranks).
        grad_scaler: the AMP ``GradScaler`` that scales the loss, if any: the hook exchanges
            the gradients before ``scaler.unscale_``, so it keeps the error buffers in unscaled
            units, and a change of the scale (halved after a skipped step, doubled on growth)
            carries them over exactly. Without it they are kept in the units of the scale they
            were made at (off by the ratio after each change); a skipped step then warns.

    Tuning guide: the allgather's bytes grow with the number of ranks P, so top-k beats a
    dense allreduce only while ``P * ratio * (value + 4 index bytes) < 8`` (fp32): ratio 0.01
    or below for tens of ranks. ``value_dtype='float16'`` saves a third of the payload.
    Error feedback keeps what is not sent, so nothing is lost, only delayed. A non-finite
    gradient on any rank makes every rank's bucket NaN (so an AMP GradScaler skips the step
    everywhere) with ``on_nonfinite='skip'``; with ``'raise'`` the hook's future carries
    :class:`slamb_comm.NonFiniteError`. Either way no error buffer changes.

    Pickling keeps the compression and the error buffers (host copies), not the process group.
    """

    __slots__ = ("compression", "names", "process_group", "grad_scaler", "residuals", "calls", "first_step_check",
                 "_comms", "_warned", "__weakref__")

    def __init__(self, named_parameters, compression, process_group=None, grad_scaler=None):
        if not isinstance(compression, TopK):
            raise TypeError(f"compression must be a slamb_comm.TopK, got {compression!r}")
        self.compression = compression
        self.names = {id(p): n for n, p in named_parameters}
        self.process_group = process_group
        self.grad_scaler = grad_scaler
        self._warned = False
        self.residuals = {}  # parameter name -> its error buffer (a view into its bucket's, or a host copy)
        self._comms = {}
        self.calls = 0  # buckets the hook was handed
        self.first_step_check = _watch_first_step(self)  # the optimizer step hook that checks DDP called the hook

    def step_traffic(self):
        """Bytes of the step just finished, summed over the buckets' exchanges (a
        :class:`slamb_comm.Traffic`), and start counting anew."""
        total = Traffic()
        for comm in self._comms.values():
            total = total + comm.stats.new_step()
        return total

    def state_dict(self):
        """The error buffers, per parameter name, as CPU tensors."""
        return {n: torch.from_numpy(_arr.to_host(r).copy()) for n, r in self.residuals.items()}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` output (the buffers move to the gradients' device at the next exchange)."""
        self.residuals = {n: np.asarray(t.numpy(), copy=True) for n, t in state.items()}
        self._comms = {}

    def __getstate__(self):
        return {"compression": self.compression, "names": {}, "residuals": self.state_dict()}

    def __setstate__(self, state):
        self.compression = state["compression"]
        self.names, self.process_group, self._comms = state["names"], None, {}
        self.grad_scaler, self._warned = None, False
        self.calls, self.first_step_check = 0, None
        self.load_state_dict(state["residuals"])

    def skipped_without_scaler(self):
        """A step was made NaN on every rank: once, if no GradScaler was given, say what a scaler's
        halving does to the error buffers."""
        if self.grad_scaler is None and not self._warned:
            self._warned = True
            _log.warning("slamb_comm: if an AMP GradScaler scales this loss, pass it to TopKHookState(..., "
                         "grad_scaler=scaler): it halves its scale now, and the error buffers, made at the old "
                         "scale, are otherwise carried over twice too large")

    def communicator(self, params, dtype):
        """The top-k communicator of a DDP bucket of ``params`` (built at its first exchange, with
        the error buffers of its parameters kept so far; collective then, as DDP hands every rank
        the same bucket at the same point), and the parameters' names."""
        names = tuple(self.names.get(id(p), f"param{i}") for i, p in enumerate(params))
        key = (names, str(dtype))
        comm = self._comms.get(key)
        if comm is None:  # collective: every rank meets the same bucket at the same point
            for k in [k for k in self._comms if set(k[0]) & set(names)]:  # DDP rebuilt its buckets
                del self._comms[k]
            c = self.compression
            layout = Layout([tuple(p.shape) for p in params], np_dtype(dtype), names=list(names),
                            dense_threshold=c.dense_threshold or 0)
            comm = Communicator(TorchTransport(self.process_group), layout, ratio=c.ratio,
                                value_dtype=c.value_dtype, seed=0, topk_dense=c.dense_threshold is not None)
            if any(n in self.residuals for n in names):  # error buffers from an earlier bucket or a checkpoint
                res = np.zeros(layout.total, layout.dtype)
                for n, (o, k) in zip(names, layout.segments()):
                    if n in self.residuals:
                        res[o:o + k] = _arr.to_host(self.residuals[n]).reshape(-1)
                comm.load_state_dict(dict(comm.state_dict(), residual=res))
            self._comms[key] = comm
        return comm, names


def topk_hook(state, bucket):
    """DDP communication hook: the bucket becomes the mean over ranks of every rank's decoded
    top-k of (gradient + error buffer), docs/algorithm.md section 2."""
    buf = bucket.buffer()
    params = bucket.parameters()
    state.calls += 1
    _drop_finished_watches()
    dt = state_dtype(buf.dtype)
    comm, names = state.communicator(params, dt)
    grads = [_arr.as_array(as_compute(g, dt)) for g in bucket.gradients()]
    try:
        with cuda_scope(buf.device), loss_scaled(comm, amp_scale(state.grad_scaler)):
            mean = comm.sparse_allgather(grads)
    except NonFiniteError as err:  # on every rank alike; no error buffer changed
        if state.compression.on_nonfinite == "raise":
            fut = torch.futures.Future()
            fut.set_exception(err)
            return fut
        _log.warning("slamb_comm: top-k step made NaN on every rank (an AMP GradScaler skips it): %s", err)
        state.skipped_without_scaler()
        buf.fill_(float("nan"))
        return _done(buf)
    for g, m in zip(bucket.gradients(), mean):
        g.copy_(tensor_of(m).view(g.shape))
    lay = comm.layout
    for n, v in zip(names, lay.flat_views(comm.residual)):
        state.residuals[n] = v
    return _done(buf)


_FINISHED_WATCHES = []  # handles of first-step checks that are done, removed outside torch's hook iteration


def _drop_finished_watches():
    while _FINISHED_WATCHES:
        _FINISHED_WATCHES.pop().remove()


def _watch_first_step(state):
    """A global optimizer step post-hook, retired after the first ``step()`` of an optimizer over
    the state's parameters with a gradient: if DDP never called :func:`topk_hook` by then,
    RuntimeError naming the fix (the gradients were averaged densely, or not at all). Holds the
    state weakly. A finished check is removed later (at the next hook call or registration), not
    from inside torch's iteration over its global hooks, which a removal would mutate."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from .contract import HOOK_NEVER_CALLED

    _drop_finished_watches()
    ref = weakref.ref(state)
    ids = set(state.names)
    box = {"handle": None, "done": False}

    def retire():
        if not box["done"]:
            box["done"] = True
            _FINISHED_WATCHES.append(box["handle"])

    def check(optimizer, args, kwargs):
        st = ref()
        if box["done"]:
            return
        if st is None:
            retire()
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if ids.isdisjoint(map(id, params)):
            return
        if st.calls == 0 and all(p.grad is None for p in params if id(p) in ids):
            return  # a step without a backward pass: nothing DDP could have exchanged yet
        retire()
        st.first_step_check = None
        if st.calls == 0:
            raise RuntimeError(HOOK_NEVER_CALLED.format(hook="topk_hook", state="TopKHookState"))

    box["handle"] = register_optimizer_step_post_hook(check)
    return box["handle"]
