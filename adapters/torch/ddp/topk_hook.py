"""Top-k's DDP communication hook beside its state: :func:`topk_hook`, :class:`TopKHookState`.

Any optimizer gets top-k gradients with error feedback (docs/algorithm.md section 2): each DDP
bucket becomes the mean of the ranks' decoded top-k. PyTorch's convention for compressed
communication (``ddp.register_comm_hook(state, hook)``), one file per hook family.
"""

import logging
import weakref

import numpy as np
import torch

from slamb_comm import arrays as _arr
from slamb_comm.wire.codecs import TopK
from slamb_comm.wire.layout import Layout
from slamb_comm.exchange.communicator import Communicator
from slamb_comm.errors import NonFiniteError

from ..distributed.topk import amp_scale, loss_scaled
from ..transport import TorchTransport
from ..optim.ledger import StepLedger
from ..tensors import as_compute, cuda_scope, np_dtype, state_dtype, tensor_of
from ..distributed.ddp_misuse import HOOK_NEVER_CALLED
from .slamb_hook import done

__all__ = ["TopKHookState", "topk_hook"]

_log = logging.getLogger("slamb_comm")


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
                 "ledger", "_comms", "_warned", "__weakref__")

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
        self.ledger = StepLedger("top-k")  # the bytes of its exchanges
        self.first_step_check = _watch_first_step(self)  # the optimizer step hook that checks DDP called the hook

    def step_traffic(self):
        """Bytes of the step just finished, summed over the buckets' exchanges (a
        :class:`slamb_comm.Traffic`), and start counting anew."""
        return self.ledger.traffic([comm.stats for comm in self._comms.values()])

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
        self.ledger = StepLedger("top-k")
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
            if c.problem is not None:  # this rank's invalid option: raised in the agreement, PeerError on the others
                Communicator(TorchTransport(self.process_group), [], problem=c.problem)
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
        return done(buf)
    for g, m in zip(bucket.gradients(), mean):
        g.copy_(tensor_of(m).view(g.shape))
    lay = comm.layout
    for n, v in zip(names, lay.flat_views(comm.residual)):
        state.residuals[n] = v
    return done(buf)


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
