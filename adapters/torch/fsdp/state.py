"""Checkpoints of :class:`~slamb_comm.adapters.torch.HybridSLAMB`: every replica's state for
``torch.distributed.checkpoint`` (DCP), and the resume at another replica count
(docs/algorithm.md sections 10 and 15.3).

The moments m (``exp_avg``), v (``exp_avg_sq``) and the ``freshness`` differ between replicas, so
``state_dict()`` gives each as a DTensor of shape ``(R, *parameter shape)`` over the whole mesh,
placed ``[Shard(0), Shard(1)]``: row r is replica r's, each rank holds its own piece of its own row.
``load_state_dict()`` takes back this rank's row of its piece (bitwise), or, from a checkpoint of
``R_old != R`` replicas, the section-10 rule: m, v (and a freshness that differs) become their mean
over the old replicas, the float64 sum over rows 0..R_old-1 times 1/R_old cast to the saved dtype,
equal on every new replica; what is equal on every old replica (the freshness, the step count, the
mask) is kept bitwise.

DCP loads into the shapes of the state dict it is handed, so a resume at another R first says which
checkpoint it reads, on every rank, before the state dict is built::

    opt.prepare_load(path)                             # reads the checkpoint's metadata
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])

The next ``opt.state_dict()`` after :meth:`HybridSLAMB.prepare_load` (:func:`read_plan`; the one
``get_optimizer_state_dict``, or DCP's own call of a ``Stateful``, makes) gives each per-replica entry the checkpoint's shape
``(R_old, *shape)`` placed ``[Replicate(), Shard(1)]``: every new replica reads all old rows of its
own piece, and DCP reshards the pieces if S changed. At ``R_old == R`` it is the usual form, so the
same lines resume on the same mesh, bitwise.
"""

import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from slamb_comm.errors import ConfigError, PeerError

from ..tensors import is_dtensor, local_of

__all__ = ["PER_REPLICA", "LoadPlan", "read_plan", "per_replica", "state_dict_to_save", "state_dict_to_load", "resize_rows",
           "warn_between_syncs"]

_log = logging.getLogger("slamb_comm")

#: the per-parameter state that differs between replicas
PER_REPLICA = ("exp_avg", "exp_avg_sq", "freshness")

#: name segments that torch.distributed.checkpoint leaves out of a parameter's key (activation
#: checkpointing's and torch.compile's wrappers)
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")

_FIX = ("to resume at another replica count, call opt.prepare_load(checkpoint_id) on every rank before "
        "building the state dict that dcp.load fills (docs/algorithm.md section 15.3)")


class LoadPlan(NamedTuple):
    """What :func:`read_plan` read from a checkpoint: where it is and its replica count."""

    checkpoint: str
    old_replicas: int


class _Row(NamedTuple):
    """One per-replica entry's destination: its parameter, its name and this rank's sharding."""

    param: torch.Tensor
    name: str
    sharding: object


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _dtensor(local, mesh, placements, shape):
    """A DTensor of global ``shape`` (contiguous strides) around ``local``, no collective."""
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=tuple(reversed(stride)))


def per_replica(sharding, t, p):
    """``t``, this rank's state of its piece of ``p`` (shaped like the piece), as a DTensor of shape
    ``(R, *p.shape)`` over the whole mesh whose row r is replica r's: the state of every replica has
    its own place (DCP saves a plain tensor from one rank only)."""
    return _dtensor(t.detach().reshape(1, *t.shape), sharding.mesh, [Shard(0), Shard(1)], (sharding.R, *p.shape))


def _for_load(sharding, t, p, rows):
    """The entry DCP loads ``rows`` old replicas' state of ``p`` into: shape ``(rows, *p.shape)``
    placed ``[Replicate(), Shard(1)]`` (each rank holds every row of its piece), each row this
    rank's ``t`` until DCP overwrites it."""
    local = t.detach().reshape(1, *t.shape).repeat(rows, *([1] * t.dim())).contiguous()
    return _dtensor(local, sharding.mesh, [Replicate(), Shard(1)], (rows, *p.shape))


def warn_between_syncs(opt, sharding):
    """Log, and return True, if ``opt`` (a HybridSLAMB) is saved between periodic syncs, where DCP's one
    replica's model pieces differ from the other replicas' (the caller warns once)."""
    t, H = opt.steps_taken(), min(int(g["sync_interval"]) for g in opt.param_groups)
    if sharding.R > 1 and t and (t - 1) % H:
        _log.warning("slamb_comm: HybridSLAMB state saved at step %d, between periodic syncs (after steps 1, "
                     "H + 1, ...): the replicas' parameters differ now, and torch.distributed.checkpoint keeps "
                     "one replica's model pieces. Resuming from it is a valid SLAMB run, not bitwise this one: "
                     "save right after a sync step, or save every rank's own pieces (torch.save per rank).", t)
        return True
    return False


def state_dict_to_save(opt, sd, sharding, plan=None):
    """``sd`` (SLAMB's ``state_dict()`` of ``opt``, this rank's pieces) with each per-replica entry
    as a DTensor of shape ``(R, *shape)`` whose row r is replica r's (:func:`per_replica`);
    with a :class:`LoadPlan` (:func:`read_plan`) of shape ``(R_old, *shape)`` placed
    ``[Replicate(), Shard(1)]``, the form DCP loads that checkpoint into."""
    rows = sharding.R if plan is None else plan.old_replicas
    params = _params(opt)
    for i, st in sd["state"].items():
        p = params[i]
        sd["state"][i] = {k: (v if k not in PER_REPLICA else per_replica(sharding, v, p) if rows == sharding.R
                              else _for_load(sharding, v, p, rows)) for k, v in st.items()}
    return sd


def resize_rows(rows):
    """Section 10's rule over the old replicas' rows (dimension 0) of one entry: row 0 if every row
    is bitwise equal (kept), else the float64 sum over rows 0, 1, ... in order, times 1/R_old, cast to
    the rows' dtype (the same on every new replica)."""
    if all(torch.equal(rows[0], rows[q]) for q in range(1, rows.shape[0])):
        return rows[0].clone()
    if not rows.is_floating_point():
        raise ConfigError(f"per-replica state of dtype {rows.dtype} differs between the old replicas and has no "
                          "mean; only floating-point state can be resized")
    acc = torch.zeros(rows.shape[1:], dtype=torch.float64, device=rows.device)
    for q in range(rows.shape[0]):
        acc += rows[q].to(torch.float64)
    return (acc * (1.0 / rows.shape[0])).to(rows.dtype)


def _kinds(v):
    return [type(pl).__name__ + str(getattr(pl, "dim", "")) for pl in v.placements]


def _own_state(key, v, row):
    """This rank's piece of per-replica entry ``key`` = ``v`` (see :func:`state_dict_to_load`)."""
    sh, p = row.sharding, row.param
    if not is_dtensor(v):  # a per-rank file: this rank's own piece
        want = tuple(local_of(p).shape)
        if tuple(v.shape) != want:
            raise ConfigError(f"the saved {key} of parameter {row.name!r} has shape {list(v.shape)}, but this rank's "
                              f"piece is {list(want)}: a per-rank file (torch.save of state_dict()) resumes only on "
                              f"the mesh that saved it; save with torch.distributed.checkpoint instead, and {_FIX}")
        return v
    if tuple(v.shape[1:]) != tuple(p.shape):
        raise ConfigError(f"the saved {key} of parameter {row.name!r} has shape {list(v.shape)}, not (R, "
                          f"*{list(p.shape)}): the checkpoint is of another model, or not HybridSLAMB's state")
    old, kinds, local = v.shape[0], _kinds(v), local_of(v)
    if kinds == ["Shard0", "Shard1"] and old == sh.R:
        return local[0]
    if kinds == ["Replicate", "Shard1"] and old == sh.R:  # every row here: take this replica's
        return local[sh.mesh.get_local_rank(0)].clone()
    if kinds == ["Replicate", "Shard1"]:
        return resize_rows(local)
    raise ConfigError(f"the saved {key} of parameter {row.name!r} holds {old} replicas' rows placed {kinds} on "
                      f"this mesh of {sh.R} replicas: {_FIX}")


def _saved_keys(opt, state_dict):
    """``key in state_dict["state"] -> parameter``, read from the saved groups' ``params`` in order as torch's
    ``Optimizer.load_state_dict`` does (indices from ``state_dict()``, names from ``set_optimizer_state_dict``)."""
    saved = state_dict["param_groups"]
    if len(saved) != len(opt.param_groups) or any(len(s["params"]) != len(g["params"])
                                                  for s, g in zip(saved, opt.param_groups)):
        raise ConfigError("the saved optimizer state has other parameter groups than this optimizer "
                          f"({[len(s['params']) for s in saved]} parameters per group, this one "
                          f"{[len(g['params']) for g in opt.param_groups]}): build it with the same groups")
    return {k: p for s, g in zip(saved, opt.param_groups) for k, p in zip(s["params"], g["params"])}


def _agree(problem, sharding):
    """Over the whole mesh: every rank raises if any rank's per-rank file does not fit its pieces (its
    own ConfigError, or PeerError), so that no rank goes on into SLAMB's collective load alone."""
    word = torch.tensor([0.0 if problem is None else 1.0], dtype=torch.float64)
    dist.all_reduce(word, group=sharding.replicas_group)
    dist.all_reduce(word, group=sharding.pieces_group)
    if problem is None and word.item() > 0:
        raise PeerError(f"{int(word.item())} other rank(s) of the mesh could not load their per-rank file (see their "
                        "ConfigError): a per-rank file resumes only on the mesh that saved it; " + _FIX)


def state_dict_to_load(opt, state_dict, sharding, names=None):
    """``state_dict`` (``state_dict()`` output after DCP filled it, or this rank's plain tensors from a
    per-rank file) with each per-replica entry made this rank's piece for SLAMB's ``load_state_dict``:
    its own row of a ``(R, *shape)`` entry, bitwise; of an ``(R_old, *shape)`` entry placed
    ``[Replicate(), Shard(1)]`` (:func:`read_plan`), :func:`resize_rows` of the rows. ``names``:
    ``id(parameter) -> name`` for the errors. Logs what a resize did.

    Raises:
        ConfigError: an entry of another model's shape, a per-rank file of another mesh, another
            replica count without ``opt.prepare_load``; each message names the fix.
        PeerError: another rank's per-rank file did not fit (plain tensors are checked on every rank
            of the mesh together: one allreduce of one float over each dimension).
    """
    params, names = _saved_keys(opt, state_dict), names or {}
    entries = [(k, v) for st in state_dict["state"].values() for k, v in st.items() if k in PER_REPLICA]
    resized = {int(v.shape[0]) for _, v in entries if is_dtensor(v)} - {sharding.R}
    state, problem = {}, None
    try:
        for i, st in state_dict["state"].items():
            p = params[i]
            row = _Row(p, names.get(id(p), f"{i} of shape {list(p.shape)}"), sharding)
            state[i] = {k: _own_state(k, v, row) if k in PER_REPLICA else v for k, v in st.items()}
    except ConfigError as e:
        problem = e
    if any(not is_dtensor(v) for _, v in entries):  # per-rank files: whether they fit differs between ranks
        _agree(problem, sharding)
    if problem is not None:
        raise problem
    if resized:
        _log.info("slamb_comm: HybridSLAMB state of %s replicas loaded on %d (docs/algorithm.md section 10): m and v "
                  "are their float64 mean over the old replicas, equal on every replica; the freshness and the step "
                  "count are kept", sorted(resized), sharding.R)
    return {**state_dict, "state": state}


def _key_names(model):
    """``name in the checkpoint -> parameter`` for ``model``'s parameters (the wrappers' name segments
    left out, as DCP does)."""
    out = {}
    for n, p in model.named_parameters():
        out[".".join(s for s in n.split(".") if s not in _WRAPPERS)] = p
    return out


def _matches(key, fqns):
    """``(fqn, state name)`` of a checkpoint key ``...state.<fqn>.<name>`` of a per-replica entry of one
    of ``fqns`` (nested or flattened optimizer state, under any prefix); None otherwise."""
    key = ".".join(s for s in key.split(".") if s not in _WRAPPERS)
    for k in PER_REPLICA:
        if not key.endswith("." + k):
            continue
        head, at = key[: -len(k) - 1], 0
        while True:
            at = head.find("state.", at)
            if at < 0:
                break
            if (at == 0 or head[at - 1] == ".") and head[at + 6:] in fqns:
                return head[at + 6:], k
            at += 1
    return None


def read_plan(model, opt, checkpoint_id=None, storage_reader=None):
    """The :class:`LoadPlan` of a DCP checkpoint for ``opt`` (a HybridSLAMB of ``model``): the replica
    count its per-replica state was saved at (:meth:`HybridSLAMB.prepare_load` keeps it for the next
    ``state_dict()``, the state dict DCP loads into). Reads only the checkpoint's metadata
    (``checkpoint_id``: a path for ``FileSystemReader``; or any ``storage_reader``); no collective.

    Raises:
        ConfigError: the checkpoint holds no per-replica HybridSLAMB state of ``model``'s
            parameters, or entries of other shapes, or of different replica counts.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if storage_reader is None:
        if checkpoint_id is None:
            raise ConfigError("prepare_load needs a checkpoint_id (the checkpoint's path) or storage_reader=")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    where = str(checkpoint_id if checkpoint_id is not None else storage_reader)
    params = _params(opt)
    ours = {id(p) for p in params}
    # keys by name (get_optimizer_state_dict), else by index (dcp.save of opt.state_dict() itself)
    fqns = {str(i): p for i, p in enumerate(params)}
    fqns.update({n: p for n, p in _key_names(model).items() if id(p) in ours})
    counts = {}
    for key, md in storage_reader.read_metadata().state_dict_metadata.items():
        hit = _matches(key, fqns) if isinstance(md, TensorStorageMetadata) else None
        if hit is None:
            continue
        p = fqns[hit[0]]
        if len(md.size) != p.dim() + 1 or tuple(md.size[1:]) != tuple(p.shape):
            raise ConfigError(f"checkpoint {where}: {key} has shape {list(md.size)}, not (R, *{list(p.shape)}) as "
                              f"HybridSLAMB saves parameter {hit[0]!r}: a checkpoint of another model or optimizer")
        counts.setdefault(int(md.size[0]), []).append(key)
    if not counts:
        raise ConfigError(f"checkpoint {where} holds no HybridSLAMB state of this model's parameters (keys "
                          "'...state.<parameter>.exp_avg' of shape (R, *shape)): it was saved by another optimizer, "
                          "or of another model; resume the model alone (get/set_model_state_dict) and start the "
                          "optimizer anew")
    if len(counts) > 1:
        raise ConfigError(f"checkpoint {where} holds HybridSLAMB state of several replica counts "
                          f"{ {r: keys[:2] for r, keys in counts.items()} }: it mixes checkpoints")
    return LoadPlan(where, next(iter(counts)))
