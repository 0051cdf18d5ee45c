"""What a data-parallel run hands its user: the model as the mean of the replicas
(:func:`averaged_state_dict`), and the bytes of its steps as logger metrics (:func:`traffic_metrics`).

Why the mean. SLAMB and SAdamW average the momentum on a mask at every step and the parameters
every ``sync_interval`` steps; DiLoCo and DES-LOC average every ``sync_interval`` steps. In
between, every rank's parameters are its own (docs/algorithm.md section 8): a model file that
one rank writes is one replica, not the model the run trained, which is the mean of the
replicas (what the next sync would make, and what the examples evaluate). So every path that
writes a model for use -- the framework adapters' saves, and this call in a plain torch or
Horovod script -- writes the mean.

Why not make the live model the mean. Each rank's own parameters and optimizer state are what
a bitwise resume needs (the per-rank files of :mod:`.rank_files`); averaging them in place
would be a sync step the run never scheduled. :func:`averaged_state_dict` returns new tensors
and leaves the model alone.

The mean is taken in float64 and cast back to each tensor's dtype, as docs/algorithm.md section
10 averages a resized checkpoint's per-rank state: at 2 ranks it is bitwise
``((a.double() + b.double()) / 2).to(a.dtype)``, and where the ranks agree (biases of a dense
method, buffers, every parameter right after a sync) it is exactly their common value.
Floating-point buffers are averaged too (BatchNorm's running statistics differ per rank);
integer and bool entries are this rank's own (counters such as ``num_batches_tracked``, equal on
every rank of a data-parallel run).
"""

import hashlib
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

__all__ = ["averaged_state_dict", "mean_of_replicas", "ReplicaGroup", "traffic_metrics"]

BUCKET_BYTES = 64 << 20  # float64 bytes averaged in one allreduce: bounds the extra memory


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks whose replicas are averaged, as the two collectives :func:`mean_of_replicas` needs.

    ``sum(t)`` returns the sum over the ranks of a float64 tensor (in place or new);
    ``gather(t)`` returns every rank's 1-D int64 tensor stacked, ``[size, len(t)]``, in rank
    order; ``device`` is where the collectives take their tensors (a CUDA device for NCCL).
    """

    size: int
    sum: Callable[[torch.Tensor], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor]
    device: torch.device = torch.device("cpu")


def _torch_group(group):
    """A :class:`ReplicaGroup` on a torch.distributed group, or None when there is nothing to average
    (no process group initialised, or one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("averaged_state_dict(group=...) needs torch.distributed initialised: call "
                               "torch.distributed.init_process_group first, or pass no group in a single process")
        return None
    size = dist.get_world_size(group)
    if size == 1:
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")

    def reduce(t):
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    def gather(t):
        out = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(out, t, group=group)
        return torch.stack(out)

    return ReplicaGroup(size, reduce, gather, device)


def averaged_state_dict(model, group=None):
    """The mean of the ranks' replicas of ``model``: a new state dict for saving, evaluating or shipping.

    Args:
        model: a ``torch.nn.Module`` (its ``state_dict()``'s keys are the result's: pass the
            unwrapped module for unprefixed keys) or a state dict.
        group: the torch.distributed process group whose ranks are averaged (default: all).

    Collective: every rank of ``group`` calls it, with the same model (the ranks' layouts are
    compared first, and a difference raises ``ValueError`` on every rank). Floating-point
    entries, parameters and buffers, are the float64 mean over the ranks cast back to their dtype,
    in new tensors on their own device (tensors tied in the model stay tied in the result);
    other entries are this rank's. The model and the optimizer are not touched, so each rank's
    own state, saved beside it, still resumes the run bitwise. In a single process (no process
    group, or one rank) it is a copy of ``model.state_dict()``.

    Generic: it reads the model, not the optimizer, so it serves SLAMB, SAdamW, DiLoCo, DES-LOC
    and dense methods alike (whose replicas agree: the mean is then their common value).
    Horovod's counterpart is :func:`slamb_comm.adapters.horovod.averaged_state_dict`.
    """
    return mean_of_replicas(_state_of(model), _torch_group(group))


def _state_of(model):
    if isinstance(model, torch.nn.Module):
        return model.state_dict()
    if isinstance(model, Mapping):
        return model
    raise TypeError(f"averaged_state_dict takes a torch.nn.Module or a state dict, got {type(model).__name__}")


def mean_of_replicas(state, group, bucket_bytes=BUCKET_BYTES):
    """``state`` (a state dict) with every floating-point tensor replaced by its float64 mean over
    ``group`` (a :class:`ReplicaGroup`, or None: one rank, a copy), cast back; see
    :func:`averaged_state_dict`. The torch and Horovod adapters differ only in ``group``."""
    unique, alias = _unique_floats(state)
    means = {}
    if group is None:
        means = {key: t.detach().clone() for key, t in unique.items()}
    else:
        _check_layout(unique, group)
        for chunk in _chunks(list(unique.items()), bucket_bytes // 8):
            means.update(_average(chunk, group))
    out = {}
    for k, v in state.items():
        out[k] = means[alias[k]] if k in alias else v
    return out


def _unique_floats(state):
    """The floating-point tensors of ``state`` once each (tied entries share storage), keyed by
    their first name, and ``alias``: every floating entry's name -> that first name."""
    unique, alias, first = {}, {}, {}
    for k, v in state.items():
        if not (torch.is_tensor(v) and v.is_floating_point()):
            continue
        where = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()),
                 v.dtype) if v.numel() else (k,)
        name = first.setdefault(where, k)
        alias[k] = name
        if name == k:
            unique[k] = v.detach()
    return unique, alias


def _check_layout(unique, group):
    """Raise ``ValueError`` on every rank unless every rank has the same names, shapes and dtypes
    (a mismatch would otherwise average unrelated tensors, or hang in mismatched allreduces)."""
    text = ";".join(f"{k}:{v.dtype}:{tuple(v.shape)}" for k, v in unique.items())
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    mine = torch.tensor([digest, sum(v.numel() for v in unique.values()), len(unique)], dtype=torch.int64)
    every = group.gather(mine.to(group.device)).cpu()
    differ = [r for r in range(group.size) if not torch.equal(every[r], every[0])]
    if differ:
        raise ValueError(f"averaged_state_dict: the ranks' models differ (rank {differ[0]} has "
                         f"{int(every[differ[0], 2])} floating-point tensors of {int(every[differ[0], 1])} elements, "
                         f"rank 0 {int(every[0, 2])} of {int(every[0, 1])}, or other names, shapes or dtypes): "
                         "every rank must call it with the same model")


def _chunks(items, max_elems):
    """``items`` cut into runs of consecutive tensors of at most ``max_elems`` elements (a larger
    tensor alone), so that the float64 copies stay bounded."""
    run, n = [], 0
    for key, t in items:
        if run and n + t.numel() > max_elems:
            yield run
            run, n = [], 0
        run.append((key, t))
        n += t.numel()
    if run:
        yield run


def _average(chunk, group):
    """One allreduce: the chunk's tensors as one float64 buffer, summed over the ranks, divided by
    their number, and cut back into tensors of the original dtypes and devices."""
    buf = torch.cat([t.reshape(-1).to(group.device, torch.float64) for _, t in chunk])
    buf = group.sum(buf)
    buf /= group.size
    out, at = {}, 0
    for key, t in chunk:
        n = t.numel()
        out[key] = buf[at:at + n].view(t.shape).to(device=t.device, dtype=t.dtype, copy=True)
        at += n
    return out


def traffic_metrics(traffic, steps=1, prefix="slamb/"):
    """A :class:`slamb_comm.Traffic` as the metrics the framework adapters log, per optimizer step.

    ``traffic`` is what ``steps`` optimizer steps sent (an optimizer's ``step_traffic()`` sums
    everything since its last call). Returns ``{prefix + "payload_bytes": payload per step,
    "wire_bytes": wire bytes per step, "of_dense": payload / a dense allreduce's payload,
    "wire_of_dense": the same for the wire}`` (docs/algorithm.md section 4), or ``{}`` for no
    step.
    """
    if steps <= 0:
        return {}
    return {f"{prefix}payload_bytes": traffic.payload_bytes / steps, f"{prefix}wire_bytes": traffic.wire_bytes / steps,
            f"{prefix}of_dense": traffic.ratio, f"{prefix}wire_of_dense": traffic.wire_ratio}
