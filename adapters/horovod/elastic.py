"""Elastic Horovod for slamb_comm's distributed optimizers (docs/algorithm.md section 10).

Under ``horovodrun --min-np/--max-np`` workers come and go. An optimizer built under Elastic
Horovod (:func:`make_elastic`) is built for its worker alone, joins the world at ``TorchState``'s
first sync (or at its first hook, ``synchronize()`` or ``step()``: :data:`ELASTIC_METHODS`), and at
every reset :func:`sync` rebuilds its communicators for the new world and gives every worker
section 10's state, merged from the workers that held one. ``TorchState`` reaches :func:`sync`
through Horovod's public handler registry.
"""

import abc
import hashlib
import itertools
import logging
import weakref
from dataclasses import dataclass

import torch

import horovod.torch as hvd

from .collectives import HorovodCollectives

__all__ = ["Elastic", "ELASTIC_METHODS", "make_elastic", "merge", "sync"]

_log = logging.getLogger("slamb_comm")


class Elastic(abc.ABC):
    """What Horovod's elastic ``TorchState`` recognises as slamb_comm's distributed optimizers
    (their classes are registered as they are built)."""


@dataclass
class _Membership:
    """An elastic optimizer's place: its number (the same on every worker, by construction order),
    whether it has joined a world, and that world's size and this worker's rank in it."""

    index: int
    synced: bool = False
    size: int = 1
    rank: int = 0


_COUNT = itertools.count()
_MEMBERSHIP = weakref.WeakKeyDictionary()  # elastic optimizer -> _Membership
_HELD = weakref.WeakSet()  # those that a TorchState holds: their model's parameters sync with them


def make_elastic(opt):
    """Make ``opt`` (built by :func:`slamb_comm.adapters.horovod.DistributedOptimizer` with
    :data:`ELASTIC_METHODS`) an elastic optimizer: numbered, recognised by ``TorchState``."""
    _MEMBERSHIP[opt] = _Membership(next(_COUNT))
    Elastic.register(type(opt))
    _install_handlers()


def _check(opt):
    """Before a hook, ``synchronize()`` or ``step()``: join the world if this optimizer has not
    yet, or again if it changed (a reset that removed workers skips TorchState's sync)."""
    m = _MEMBERSHIP[opt]
    if not m.synced or hvd.size() != m.size or hvd.rank() != m.rank:
        sync(opt, params=False)  # no parameter is written here: a backward pass may be running


def _checked(method):
    def checked(self, *args, **kwargs):
        _check(self)
        return method(self, *args, **kwargs)
    checked.__name__, checked.__doc__ = method.__name__, method.__doc__
    return checked


#: the methods the elastic class wraps with the check: every gradient hook's body, synchronize, step
ELASTIC_METHODS = {"_ready": _checked, "synchronize": _checked, "step": _checked}


def sync(opt, params=True):
    """Collective over the workers of the reset world: rebuild ``opt``'s communicators for it
    (the layout and option agreement run again) and give every worker docs/algorithm.md section
    10's state, made from the workers that held one ("holders": those that trained before the
    reset) -- floating-point state that differs between them averaged in float64 (m, v, TopK's
    error buffers; with ``params``, the parameters), everything else from the first holder.
    At the first sync, nobody holds state yet: everyone takes the first worker's."""
    m = _MEMBERSHIP[opt]
    holder, before = m.synced, m.size
    coll = HorovodCollectives(opt.process_set)
    tag = f"slamb_comm.elastic{m.index}"
    opt.rebind(coll, tag, coll.transport(prefix=f"{tag}.t"))  # collective; the same names on every worker
    plist = [p for g in opt.param_groups for p in g["params"]]
    state = {"opt": opt.state_dict(), "params": [p.detach() for p in plist] if params else []}
    merged, holders, taken = merge(state, holder, tag)
    for p, v in zip(plist, merged["params"]):
        p.data.copy_(v)
    opt.load_state_dict(merged["opt"])
    m.synced, m.size, m.rank = True, coll.size, coll.rank
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


def merge(state, holder, tag):
    """The merged state (see :func:`sync`), the holders (None at the first sync) and the
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


def _install_handlers():
    """Once per process: Horovod's ``TorchState`` syncs slamb_comm's distributed optimizers (and
    the parameters they train) with :func:`sync`, through its public handler registry.
    (Imported here: horovod.torch.elastic is only needed under Elastic Horovod.)"""
    from horovod.torch.elastic.state import (ModelStateHandler, OptimizerStateHandler, get_handler_registry,
                                             set_handler_registry)

    if any(getattr(h, "slamb_comm_handler", False) for _, h in get_handler_registry()):
        return

    class _ModelHandler(ModelStateHandler):
        """A model in a ``TorchState``: the parameters that a slamb_comm optimizer of a TorchState
        trains are synced with that optimizer's state (averaged over the holders, section 10);
        the rest (buffers, other parameters) is broadcast from rank 0, as Horovod's own handler does."""

        slamb_comm_handler = True  # marks the handlers installed here

        def sync(self):
            ours = {id(p) for opt in list(_HELD) for g in opt.param_groups for p in g["params"]}
            if not {id(p) for p in self.value.parameters()} & ours:
                return super().sync()
            rest = {k: v for k, v in self.value.state_dict(keep_vars=True).items() if id(v) not in ours}
            hvd.broadcast_parameters(rest, root_rank=0)

    class _OptimizerHandler(OptimizerStateHandler):
        """A slamb_comm distributed optimizer in a ``TorchState``: its sync is :func:`sync`."""

        slamb_comm_handler = True  # marks the handlers installed here

        def __init__(self, optimizer):
            super().__init__(optimizer)
            _HELD.add(optimizer)

        def sync(self):
            sync(self.value, params=True)

    set_handler_registry([(Elastic, _OptimizerHandler), (torch.nn.Module, _ModelHandler)]
                         + list(get_handler_registry()))
