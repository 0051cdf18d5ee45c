"""Horovod + PyTorch adapter: SLAMB and sparse top-k exchange behind Horovod's optimizer API.

A Horovod PyTorch script changes one line::

    # before
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    # after: SLAMB (momentum exchanged on a shared random mask, ICML 2023)
    opt = slamb_comm.adapters.horovod.DistributedOptimizer(
        slamb_comm.adapters.horovod.SLAMB(model.parameters(), lr=1e-3, ratio=0.1),
        named_parameters=model.named_parameters())
    # or: keep your optimizer, exchange top-k gradients with error feedback
    opt = slamb_comm.adapters.horovod.DistributedOptimizer(
        torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
        compression=slamb_comm.TopK(0.01))

Everything else in the script (``hvd.init()``, ``hvd.broadcast_parameters``,
``hvd.broadcast_optimizer_state``, ``synchronize()`` / ``skip_synchronize()`` for gradient
clipping, ``backward_passes_per_step``, lr schedulers) stays as it was.

What this module holds:

* :class:`HorovodTransport` -- slamb_comm's transport protocol (allreduce, allgather,
  alltoall, broadcast, barrier) on Horovod's public collectives, so a
  :class:`slamb_comm.Communicator` can run inside a Horovod job.
* :class:`SLAMB` -- the torch optimizer of :mod:`slamb_comm.adapters.torch`, re-exported:
  alone it is a correct single-process optimizer (ratio 1: LAMB), wrapped by
  :func:`DistributedOptimizer` it is SLAMB.
* :class:`SAdamW` -- SLAMB's exchange under AdamW's update, likewise re-exported.
* :class:`LAMB` -- dense LAMB, the baseline: ``DistributedOptimizer(LAMB(...))`` is Horovod's own
  dense gradient allreduce under LAMB's step.
* :class:`OneBitLAMB` -- 1-bit LAMB, likewise re-exported from :mod:`slamb_comm.adapters.torch`.
* :class:`TopK` -- a ``compression=`` value selecting the error-feedback top-k gradient
  exchange (docs/algorithm.md section 2) for any optimizer.
* :func:`DistributedOptimizer` -- the drop-in for ``hvd.DistributedOptimizer``: the
  distributed optimizers of :mod:`slamb_comm.adapters.torch` on Horovod's collectives.
* :func:`averaged_state_dict` -- the model to save: the float64 mean of the ranks' replicas
  (SLAMB's differ between its periodic syncs), called on every rank; the live model is not touched.
* Elastic Horovod: under ``horovodrun --min-np/--max-np/--host-discovery-script`` the SLAMB and
  TopK optimizers are built for their worker alone, and Horovod's own
  ``hvd.elastic.TorchState(model=..., optimizer=...)`` syncs them at every reset through its
  public handler registry: communicators rebuilt for the new world, state made by
  docs/algorithm.md section 10's rule from the workers that held one (:func:`_elastic_sync`).

Everything torch-level (the SLAMB optimizer, dtype handling, the distributed optimizers'
hooks and steps) lives in :mod:`slamb_comm.adapters.torch`; this module holds only what is
Horovod's. Only Horovod's public API is used (``allreduce_async_``, ``allgather``,
``alltoall``, ``broadcast_``, ``synchronize``, ``Average``/``Sum``, ``Compression``);
Horovod's optimizer is neither copied nor patched. Like Horovod, the distributed optimizer
is a class built at run time with ``type(name, (optimizer.__class__,), ...)``, so
``isinstance(opt, torch.optim.Adam)`` still holds.

Data types: Horovod's collectives carry no bfloat16 and no bool. bfloat16 (and float16)
parameters and gradients are converted to float32 for the exchange and for SLAMB's
optimizer state (moments and freshness are kept in float32); results are cast back to the
parameter's dtype. With Horovod's own compressions, bfloat16 gradients are sent as float32
(or float16 with ``hvd.Compression.fp16``) and cast back.
"""

import abc
import contextlib
import hashlib
import itertools
import logging
import os
import sys
import weakref

import torch

import horovod.torch as hvd

from slamb_comm.codecs import TopK
from slamb_comm.transports import check_alltoall, check_buffer
from slamb_comm.adapters.torch import LAMB, SLAMB, OneBitLAMB, SAdamW
from slamb_comm.adapters.torch.averaging import ReplicaGroup, mean_of_replicas
from slamb_comm.adapters.torch.distributed import wrap
from slamb_comm.adapters.torch.params import check_named_parameters
from slamb_comm.adapters.torch.tensors import torch_view

__all__ = ["HorovodTransport", "SLAMB", "SAdamW", "LAMB", "OneBitLAMB", "TopK", "DistributedOptimizer",
           "averaged_state_dict"]

_log = logging.getLogger("slamb_comm")


# ---------------------------------------------------------------------------- transport
class HorovodTransport:
    """slamb_comm's transport protocol over Horovod's collectives (call ``hvd.init()`` first).

    Buffers are NumPy arrays (viewed as CPU tensors with ``torch.from_numpy``, no copy) or
    CuPy arrays (viewed as CUDA tensors through DLPack; needs Horovod built with CUDA, and
    is not exercised by this package's tests). Every collective gets a unique,
    deterministic name ``<prefix>.<op>.<counter>``: Horovod matches tensors across ranks by
    name, and the ranks call the collectives of one transport in the same order, so the
    counters agree.

    Horovod has no uint8 allreduce: a uint8 buffer is summed as int32 and wraps modulo 256,
    as an MPI sum of bytes would.

    Args:
        process_set: a Horovod process set (default: all ranks).
    """

    name = "horovod"
    _created = itertools.count()

    def __init__(self, process_set=None):
        if not hvd.is_initialized():
            raise RuntimeError("HorovodTransport needs hvd.init() to have been called")
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        if not self.process_set.included():
            raise ValueError("this rank is not in the given Horovod process set")
        self.rank = int(self.process_set.rank())
        self.size = int(self.process_set.size())
        # names shared by every rank that creates its transports in the same order
        self.prefix = f"slamb_comm.t{next(HorovodTransport._created)}"
        self._calls = itertools.count()

    def _name(self, op):
        return f"{self.prefix}.{op}.{next(self._calls)}"

    def allreduce(self, buf):
        """In place: the element-wise sum over ranks."""
        check_buffer(buf)
        t = torch_view(buf)
        if t.dtype == torch.uint8:
            wide = t.to(torch.int32)
            hvd.allreduce_(wide, op=hvd.Sum, name=self._name("allreduce"), process_set=self.process_set)
            t.copy_(wide.remainder_(256).to(torch.uint8))
            return
        hvd.allreduce_(t, op=hvd.Sum, name=self._name("allreduce"), process_set=self.process_set)

    def allgather(self, sendbuf, recvbuf):
        """``recvbuf[r * n:(r + 1) * n]`` = rank r's ``sendbuf`` (n = ``sendbuf.size``).

        While some rank is in ``hvd.join()``, Horovod refuses allgathers (and keeps running);
        then the ranks still working gather through an allreduce of a zero-padded buffer
        instead (twice the bytes, on those steps only), in which the joined ranks' slots are
        zeros, as Horovod's joined ranks contribute zeros to every allreduce."""
        check_buffer(sendbuf)
        check_buffer(recvbuf)
        if recvbuf.size != sendbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError("allgather needs recvbuf of size * sendbuf.size elements of the same dtype")
        name = self._name("allgather")
        try:
            out = hvd.allgather(torch_view(sendbuf), name=name, process_set=self.process_set)
        except hvd.HorovodInternalError as err:
            if "not supported with Join" not in str(err):
                raise
            # Every rank that is not joined got this error for this allgather: gather by summing.
            mine = torch_view(sendbuf).reshape(-1).view(torch.uint8)
            words = mine.numel() % 4 == 0  # summed as int32 words (x + 0 is exact), else byte by byte
            slots = torch.zeros(self.size, mine.numel() // 4 if words else mine.numel(), dtype=torch.int32,
                                device=mine.device)
            slots[self.rank].copy_(mine.view(torch.int32) if words else mine)
            hvd.allreduce_(slots, op=hvd.Sum, name=name + ".joined", process_set=self.process_set)
            out = (slots if words else slots.to(torch.uint8)).reshape(-1).view(torch.uint8)
            out = out.view(torch_view(sendbuf).dtype)
        torch_view(recvbuf).copy_(out.reshape(-1))

    def alltoall(self, sendbuf, recvbuf):
        """Rank r's ``sendbuf[j * n:(j + 1) * n]`` arrives in rank j's ``recvbuf[r * n:(r + 1) * n]``
        (n = ``sendbuf.size // size``), through ``hvd.alltoall`` with equal splits.

        While some rank is in ``hvd.join()``, Horovod refuses all-to-alls as it refuses
        allgathers; the ranks still working then exchange through an allreduce of a
        zero-padded ``size x sendbuf`` buffer instead (``size`` times the bytes, on those steps
        only), in which the joined ranks' blocks are zeros, as Horovod's joined ranks
        contribute zeros to every allreduce."""
        check_alltoall(sendbuf, recvbuf, self.size)
        name = self._name("alltoall")
        src = torch_view(sendbuf)
        try:
            out = hvd.alltoall(src, name=name, process_set=self.process_set)
        except hvd.HorovodInternalError as err:
            if "not supported with Join" not in str(err):
                raise
            # Every rank that is not joined got this error: each puts its whole sendbuf in its own
            # row of a zero buffer, one sum gives every row to everyone, and each keeps column block r.
            mine = src.reshape(-1).view(torch.uint8)
            words = mine.numel() % (4 * self.size) == 0  # summed as int32 words (x + 0 is exact)
            slots = torch.zeros(self.size, mine.numel() // 4 if words else mine.numel(), dtype=torch.int32,
                                device=mine.device)
            slots[self.rank].copy_(mine.view(torch.int32) if words else mine)
            hvd.allreduce_(slots, op=hvd.Sum, name=name + ".joined", process_set=self.process_set)
            block = slots.shape[1] // self.size
            rows = slots[:, self.rank * block:(self.rank + 1) * block].contiguous()
            out = (rows if words else rows.to(torch.uint8)).reshape(-1).view(torch.uint8).view(src.dtype)
        torch_view(recvbuf).copy_(out.reshape(-1))

    def broadcast(self, buf, root=0):
        """In place: every rank gets ``root``'s buffer."""
        check_buffer(buf)
        if not 0 <= int(root) < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        hvd.broadcast_(torch_view(buf), int(root), name=self._name("broadcast"), process_set=self.process_set)

    def barrier(self):
        """Wait until every rank of the process set has arrived."""
        hvd.barrier(process_set=self.process_set)


class _HorovodCollectives:
    """The collectives the distributed optimizers of :mod:`slamb_comm.adapters.torch` use, on
    Horovod's (see :class:`slamb_comm.adapters.torch.collectives.TorchCollectives` for the interface)."""

    device = torch.device("cpu")

    def __init__(self, process_set):
        self.process_set = process_set
        self.member = bool(process_set.included())
        self.size = int(process_set.size()) if self.member else 1
        self.rank = int(process_set.rank()) if self.member else 0

    @staticmethod
    def batch():
        """Nothing to do: Horovod's own tensor fusion batches the allreduces in flight."""
        return contextlib.nullcontext()

    def allreduce_async(self, t, name, average=False, prescale=1.0, postscale=1.0):
        return hvd.allreduce_async_(t, name=name, op=hvd.Average if average else hvd.Sum, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=self.process_set)

    def wait(self, handle):
        return hvd.synchronize(handle)

    def allreduce(self, t, name):
        hvd.allreduce_(t, op=hvd.Sum, name=name, process_set=self.process_set)

    def allgather(self, t, name):
        return hvd.allgather(t, name=name, process_set=self.process_set)

    def transport(self):
        """A HorovodTransport for members; None elsewhere (which still takes a transport number,
        so that every rank numbers its later transports alike)."""
        if self.member:
            return HorovodTransport(self.process_set)
        next(HorovodTransport._created)
        return None

    def recognise(self, opt):
        # hvd.broadcast_optimizer_state recognises Horovod's own distributed optimizers by this
        # attribute and then creates missing state with the *wrapped* optimizer's step(), locally,
        # without the collectives a distributed step() would start on only some ranks (which hung).
        opt.__module__ = hvd.DistributedOptimizer.__module__


class _Bf16Safe:
    """Wraps a Horovod compressor so bfloat16 gradients travel as float32 (Horovod has no bf16)."""

    def __init__(self, inner):
        self.inner = inner

    def compress(self, tensor):
        if tensor.dtype == torch.bfloat16:
            t, ctx = self.inner.compress(tensor.float())
            return t, (ctx, torch.bfloat16)
        t, ctx = self.inner.compress(tensor)
        return t, (ctx, None)

    def decompress(self, tensor, ctx):
        inner, dt = ctx
        out = self.inner.decompress(tensor, inner)
        return out.to(dt) if dt is not None else out


# ---------------------------------------------------------------------------- Elastic Horovod
class _AloneUntilSynced(_HorovodCollectives):
    """Collectives of an optimizer built under Elastic Horovod before it joined the world: this
    rank alone (no transport, so building it is not collective). Nothing is exchanged through
    them: every hook, ``synchronize()`` and ``step()`` joins the world first."""

    def __init__(self, process_set):  # noqa: super() would read the world's size
        self.process_set, self.member, self.size, self.rank = process_set, True, 1, 0

    def transport(self):
        return None


class _Elastic(abc.ABC):
    """What Horovod's elastic ``TorchState`` recognises as slamb_comm's distributed optimizers
    (their classes are registered as they are built)."""


_ELASTIC_COUNT = itertools.count()  # numbers the elastic optimizers alike on every worker (by construction order)
_ELASTIC_OPTIMIZERS = weakref.WeakSet()  # those that a TorchState holds: their model's parameters sync with them


def _elastic_check(opt):
    """Before a hook, ``synchronize()`` or ``step()``: join the world if this optimizer has not
    yet, or again if it changed (a reset that removed workers skips TorchState's sync)."""
    if not opt._elastic_synced or hvd.size() != opt._coll.size or hvd.rank() != opt._coll.rank:
        _elastic_sync(opt, params=False)  # no parameter is written here: a backward pass may be running


def _checked_hook(make_hook):
    def _make_hook(self, p):
        hook = make_hook(self, p)

        def checked(param):
            _elastic_check(self)
            return hook(param)
        return checked
    return _make_hook


def _checked(method):
    def checked(self, *args, **kwargs):
        _elastic_check(self)
        return method(self, *args, **kwargs)
    checked.__name__, checked.__doc__ = method.__name__, method.__doc__
    return checked


_ELASTIC_METHODS = {"_make_hook": _checked_hook, "synchronize": _checked, "step": _checked}


def _elastic_sync(opt, params=True):
    """Collective over the workers of the reset world: rebuild ``opt``'s communicators for it
    (the layout and option agreement run again) and give every worker docs/algorithm.md section
    10's state, made from the workers that held one ("holders": those that trained before the
    reset) -- floating-point state that differs between them averaged in float64 (m, v, TopK's
    error buffers; with ``params``, the parameters), everything else from the first holder.
    At the first sync, nobody holds state yet: everyone takes the first worker's."""
    holder = bool(opt._elastic_synced)
    before = opt._coll.size
    coll = _HorovodCollectives(opt.process_set)
    tag = f"slamb_comm.elastic{opt._elastic_index}"
    opt._coll, opt._member = coll, coll.member
    opt._flag_name, opt._agreements = f"{tag}.trainable", itertools.count()
    transport = coll.transport()
    transport.prefix, transport._calls = f"{tag}.t", itertools.count()  # the same names on every worker
    if hasattr(opt, "_slamb_transport"):  # SLAMB
        opt._slamb_transport, opt._exchanges = transport, itertools.count()
        opt._build_engines()  # collective; keeps this worker's state
        opt._index_params()
        opt._options_agreed = False
        opt._in_hooks = not opt._flat_mode()
    else:  # TopK
        opt._transport, opt._topk, opt._bucketed = transport, [], set()
        opt._add_buckets(opt._requires_update)  # collective; the error buffers come back from the state below
    plist = [p for g in opt.param_groups for p in g["params"]]
    state = {"opt": opt.state_dict(), "params": [p.detach() for p in plist] if params else []}
    merged, holders, taken = _merge(state, holder, tag)
    for p, v in zip(plist, merged["params"]):
        p.data.copy_(v)
    opt.load_state_dict(merged["opt"])
    opt._elastic_synced = True
    if holders is not None:
        _log.warning("slamb_comm: Elastic Horovod reset: %s %s %d workers; the state of the %d that held one "
                     "averaged%s (docs/algorithm.md section 10)%s", type(opt).__name__,
                     f"from {before} to" if holder else "joined by this worker, now", coll.size, len(holders),
                     ", with the parameters" if params else "",
                     f"; taken from worker {holders[0]}, as it differed: {taken[:5]}" if taken else "")


class _Slot:
    """A tensor's place in a state's skeleton (shape and dtype: what a worker without it allocates;
    its path, for the log)."""

    def __init__(self, i, t, path):
        self.i, self.shape, self.dtype, self.path = i, tuple(t.shape), t.dtype, path


def _skeleton(v, leaves, path=""):
    if isinstance(v, torch.Tensor):
        leaves.append(v.detach())
        return _Slot(len(leaves) - 1, v, path)
    if isinstance(v, dict):
        return type(v)((k, _skeleton(x, leaves, f"{path}.{k}" if path else str(k))) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return type(v)(_skeleton(x, leaves, f"{path}[{i}]") for i, x in enumerate(v))
    return v


def _fill(v, values):
    if isinstance(v, _Slot):
        return values[v.i]
    if isinstance(v, dict):
        return type(v)((k, _fill(x, values)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return type(v)(_fill(x, values) for x in v)
    return v


def _digest(t):
    a = t.detach().cpu().contiguous()
    if a.dtype in (torch.bfloat16, torch.bool):
        a = a.view(torch.uint8) if a.dtype == torch.bool else a.view(torch.int16)
    return hashlib.sha1(str((tuple(a.shape), str(t.dtype))).encode() + a.numpy().tobytes()).hexdigest()


_WIRE = {torch.bool: torch.uint8, torch.bfloat16: torch.float32}  # what Horovod's collectives cannot carry


def _merge(state, holder, tag):
    """The merged state (see :func:`_elastic_sync`), the holders (None at the first sync) and the
    paths of non-float entries that differed between holders. Collective; raises on every worker."""
    me, size = hvd.rank(), hvd.size()
    flags = hvd.allgather_object(holder, name=f"{tag}.holders")
    holders = [r for r, f in enumerate(flags) if f]
    first = not holders
    holders = holders or list(range(size))
    root = holders[0]
    mine = me in holders
    leaves = []
    skel = _skeleton(state, leaves)
    skel = hvd.broadcast_object(skel if me == root else None, root_rank=root, name=f"{tag}.skeleton")
    slots = _slots(skel, [])
    problem = None
    if mine and [(tuple(t.shape), t.dtype) for t in leaves] != [(s.shape, s.dtype) for s in slots]:
        problem = (f"worker {me}'s optimizer state differs in structure from worker {root}'s (other parameters, "
                   "options or buckets)")
    digests = hvd.allgather_object((problem, [_digest(t) for t in leaves] if mine and problem is None else None),
                                   name=f"{tag}.digests")
    problems = [f"{r}: {p}" for r, (p, _) in enumerate(digests) if p]
    if problems:
        raise RuntimeError("slamb_comm: Elastic Horovod cannot merge the workers' states: " + "; ".join(problems))
    values, pending, taken = [None] * len(slots), [], []
    for s in slots:
        differ = len({digests[r][1][s.i] for r in holders}) > 1
        if differ and s.dtype.is_floating_point and not first:  # averaged over the holders, in float64
            acc = leaves[s.i].to(torch.float64, copy=True) if mine else torch.zeros(s.shape, dtype=torch.float64)
            pending.append((s, acc, hvd.allreduce_async_(acc, op=hvd.Sum, name=f"{tag}.mean.{s.i}"), len(holders)))
        else:  # equal on every holder, not a number, or the first sync: the first holder's
            if differ and not first:
                taken.append(s.path)
            wire = _WIRE.get(s.dtype, s.dtype)
            buf = leaves[s.i].to(wire, copy=True) if me == root else torch.empty(s.shape, dtype=wire)
            pending.append((s, buf, hvd.broadcast_async_(buf, root_rank=root, name=f"{tag}.take.{s.i}"), 0))
    for s, buf, handle, n in pending:
        hvd.synchronize(handle)
        values[s.i] = (buf / n if n else buf).to(s.dtype)
    return _fill(skel, values), None if first else holders, taken


def _slots(v, out):
    if isinstance(v, _Slot):
        out.append(v)
    elif isinstance(v, dict):
        for x in v.values():
            _slots(x, out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _slots(x, out)
    return out


def _install_elastic_handlers():
    """Once per process: Horovod's ``TorchState`` syncs slamb_comm's distributed optimizers (and
    the parameters they train) with :func:`_elastic_sync`, through its public handler registry.
    (Imported here: horovod.torch.elastic is only needed under Elastic Horovod.)"""
    from horovod.torch.elastic.state import (ModelStateHandler, OptimizerStateHandler, get_handler_registry,
                                             set_handler_registry)

    if any(getattr(h, "_slamb_comm", False) for _, h in get_handler_registry()):
        return

    class _ModelHandler(ModelStateHandler):
        """A model in a ``TorchState``: the parameters that a slamb_comm optimizer of a TorchState
        trains are synced with that optimizer's state (averaged over the holders, section 10);
        the rest (buffers, other parameters) is broadcast from rank 0, as Horovod's own handler does."""

        _slamb_comm = True

        def sync(self):
            ours = {id(p) for opt in list(_ELASTIC_OPTIMIZERS) for g in opt.param_groups for p in g["params"]}
            if not {id(p) for p in self.value.parameters()} & ours:
                return super().sync()
            rest = {k: v for k, v in self.value.state_dict(keep_vars=True).items() if id(v) not in ours}
            hvd.broadcast_parameters(rest, root_rank=0)

    class _OptimizerHandler(OptimizerStateHandler):
        """A slamb_comm distributed optimizer in a ``TorchState``: its sync is :func:`_elastic_sync`."""

        _slamb_comm = True

        def __init__(self, optimizer):
            super().__init__(optimizer)
            _ELASTIC_OPTIMIZERS.add(optimizer)

        def sync(self):
            _elastic_sync(self.value, params=True)

    set_handler_registry([(_Elastic, _OptimizerHandler), (torch.nn.Module, _ModelHandler)]
                         + list(get_handler_registry()))


# ---------------------------------------------------------------------------- the factory
def DistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=hvd.global_process_set,
                         grad_scaler=None, abort_on_exception=True):
    """A drop-in for ``hvd.DistributedOptimizer`` (same arguments) with slamb_comm's exchanges.

    Three behaviours, chosen by the arguments:

    * ``optimizer`` is a :class:`SLAMB`: SLAMB over all ranks -- masked momentum is
      exchanged instead of gradients, launched from each parameter's gradient hook
      (``hvd.allreduce_async_``, ``op=hvd.Average``) and finished in ``step()``.
      ``op`` must be ``hvd.Average``; ``compression=hvd.Compression.fp16`` means
      ``value_dtype='float16'``.
    * ``optimizer`` is a :class:`OneBitLAMB`: 1-bit LAMB over all ranks, exchanged in
      ``step()`` (``op=hvd.Average``, no compression).
    * ``compression`` is a :class:`TopK`: any optimizer; gradients go through the
      error-feedback top-k exchange of docs/algorithm.md section 2, and the optimizer steps on
      the mean (``op=hvd.Sum``: the sum).
    * otherwise (``LAMB``, the dense baseline, included): exactly ``hvd.DistributedOptimizer(...)``
      (what is returned is Horovod's own object), except that bfloat16 gradients travel as float32 when the model has any.

    The Horovod contract holds in the first two cases as well: unnamed, duplicate or
    non-tuple ``named_parameters`` raise ``ValueError``; every rank submits every tensor
    (zeros for a parameter without a gradient); ``synchronize()`` / ``skip_synchronize()``,
    ``zero_grad()``, ``backward_passes_per_step``, ``hvd.broadcast_parameters`` and
    ``hvd.broadcast_optimizer_state`` work (Horovod recognises the result as one of its own
    distributed optimizers, so a rank without state creates it with the wrapped optimizer's
    own local step, never with collectives that only some ranks would start); ``hvd.join()``
    and ``process_set=`` work as the README's Horovod table says. ``groups`` / ``num_groups`` are accepted and
    ignored there (slamb_comm fuses each bucket itself); sparse gradients are exchanged
    dense (as with ``sparse_as_dense=True``). bfloat16 is exchanged as float32: Horovod's
    collectives carry no bfloat16 or bool.

    Under Elastic Horovod (``HOROVOD_ELASTIC=1``, set by ``horovodrun --min-np/--max-np``):
    SLAMB and TopK work with ``hvd.elastic.TorchState`` (docs/algorithm.md section 10, Elastic
    Horovod); 1-bit LAMB and ``process_set=`` raise at construction.

    ``abort_on_exception`` (slamb_comm's): an exception nobody catches on one rank ends that
    process at once (after printing it), without Horovod's shutdown, so that the launcher
    (horovodrun, mpirun) ends the whole job within seconds, as the core's MPI transport does with
    ``MPI_Abort``. Why: with Horovod 0.28.1, a rank that exits normally while another is still
    launching allreduces can deadlock that rank (its background thread, shutting down, holds the
    process-set mutex and waits for the GIL; the main thread holds the GIL and waits for that
    mutex), and the job hangs until an outer timeout; seen here in 1 of 12 to 2 of 12 runs of a
    2-rank job whose rank 1 raises, and in none of 30 with this hook. ``False`` leaves
    ``sys.excepthook`` alone.

    ``grad_scaler`` (slamb_comm's): with a :class:`TopK` compression and an
    AMP ``GradScaler`` under Horovod's AMP idiom (``synchronize()`` before ``scaler.unscale_``),
    pass the scaler so that the error buffers stay in unscaled units across changes of the scale
    (see :func:`slamb_comm.adapters.torch.DistributedOptimizer`).

    Like Horovod, the result is an instance of a class built with
    ``type(optimizer.__class__.__name__, (optimizer.__class__,), ...)`` sharing the
    optimizer's ``param_groups``; use the returned object from then on.
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups != 0 and groups is None:
        groups = num_groups
    onebit = isinstance(optimizer, OneBitLAMB)
    slamb = (isinstance(optimizer, SLAMB) and not isinstance(optimizer, LAMB)) or onebit  # LAMB: dense, below
    topk = isinstance(compression, TopK)
    if not slamb and not topk:
        if grad_scaler is not None:
            raise ValueError("grad_scaler= is for slamb_comm's top-k exchange; hvd.DistributedOptimizer takes none")
        if any(p.dtype == torch.bfloat16 for g in optimizer.param_groups for p in g["params"]):
            compression = _Bf16Safe(compression)
        return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters, compression=compression,
                                        backward_passes_per_step=backward_passes_per_step, op=op,
                                        gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                                        sparse_as_dense=sparse_as_dense, process_set=process_set)
    elastic = os.environ.get("HOROVOD_ELASTIC") == "1"  # set by horovodrun --min-np/--max-np/--host-discovery-script
    if elastic and onebit:
        raise RuntimeError(
            "OneBitLAMB does not support Elastic Horovod: its server errors are cut into one chunk per rank, and a "
            "worker that leaves takes its chunk with it. Use SLAMB or a TopK compression under Elastic Horovod, or "
            "torchrun --max-restarts with slamb_comm.checkpoint, whose load re-chunks them (docs/algorithm.md "
            "section 10)")
    if elastic and process_set is not hvd.global_process_set:
        raise ValueError("under Elastic Horovod slamb_comm's distributed optimizers run on all ranks: pass no "
                         "process_set (Horovod's process sets do not survive a reset either)")
    if onebit and compression is not hvd.Compression.none:
        raise ValueError("OneBitLAMB compresses momenta to 1 bit itself: pass no compression")
    if slamb and topk:
        raise ValueError("SLAMB exchanges masked momentum; a TopK compression cannot be combined with it "
                         "(use SLAMB(mask='topk') for a top-k mask)")
    if slamb and op != hvd.Average:
        raise ValueError(f"{type(optimizer).__name__} averages momenta: op must be hvd.Average")
    if topk and op not in (hvd.Average, hvd.Sum):
        raise ValueError("TopK exchange supports op=hvd.Average or hvd.Sum")
    names = check_named_parameters(named_parameters, optimizer.param_groups)
    if slamb and compression is hvd.Compression.fp16:
        for g in optimizer.param_groups:
            g["value_dtype"] = "float16"
    # Under Elastic Horovod the optimizer is built for this rank alone: building it for the world is
    # collective, and a worker that joins builds while the others are in the reset's broadcasts.
    # It joins the world at TorchState's sync (or its first step): see _elastic_sync.
    coll = _AloneUntilSynced(process_set) if elastic else _HorovodCollectives(process_set)
    dist = wrap(optimizer, names, compression, backward_passes_per_step, coll, sum_op=op == hvd.Sum,
                gradient_predivide_factor=gradient_predivide_factor, grad_scaler=grad_scaler,
                methods=_ELASTIC_METHODS if elastic else None)
    dist.op, dist.process_set = op, process_set
    if elastic:
        dist._elastic_index, dist._elastic_synced = next(_ELASTIC_COUNT), False
        _Elastic.register(type(dist))
        _install_elastic_handlers()
    if abort_on_exception:
        _end_job_on_uncaught_exception()
    return dist


# ---------------------------------------------------------------------------- the saved model
def averaged_state_dict(model, process_set=hvd.global_process_set):
    """The mean of the ranks' replicas of ``model``: the state dict to save, evaluate or ship.

    Horovod's counterpart of :func:`slamb_comm.adapters.torch.averaged_state_dict` (which says
    what it returns): SLAMB's, SAdamW's, DiLoCo's and DES-LOC's replicas differ between their
    periodic syncs, and ``model.state_dict()`` on rank 0 is one replica. Collective: every rank of
    ``process_set`` calls it (a model that differs between the ranks raises ``ValueError`` on
    every rank)::

        state = slamb_comm.adapters.horovod.averaged_state_dict(model)
        if hvd.rank() == 0:
            torch.save(state, "model.pt")

    Floating-point entries are the float64 mean (Horovod's ``Sum`` over the set, divided by its
    size) cast back to their dtype, in new tensors; the model and optimizer are not touched, so
    every rank's own ``state_dict()``, saved beside it, still resumes the run bitwise. A rank
    outside ``process_set``, or a set of one rank, gets a copy of its own state.
    """
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    if not process_set.included() or process_set.size() == 1:
        return mean_of_replicas(state, None)
    names = itertools.count()

    def reduce(t):
        return hvd.allreduce(t, op=hvd.Sum, name=f"slamb_comm.averaged_state_dict.{next(names)}",
                             process_set=process_set)

    def gather(t):
        return hvd.allgather(t.view(1, -1), name="slamb_comm.averaged_state_dict.layout", process_set=process_set)

    return mean_of_replicas(state, ReplicaGroup(int(process_set.size()), reduce, gather))


_EXIT_HOOK = []


def _end_job_on_uncaught_exception():
    """Once per process: an uncaught exception is printed, then the process ends with
    ``os._exit(1)`` (no atexit handlers, no Horovod shutdown); see ``abort_on_exception``."""
    if _EXIT_HOOK:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
        finally:
            try:
                rank = hvd.rank()
            except Exception:  # noqa: BLE001 -- Horovod not initialised any more: say so, end anyway
                rank = "?"
            sys.stderr.write(f"slamb_comm: uncaught {kind.__name__} on Horovod rank {rank}; ending this process "
                             "now (os._exit(1)) so that the launcher ends the job\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)

    sys.excepthook = hook
    _EXIT_HOOK.append(hook)
