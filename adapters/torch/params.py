"""Parameter bookkeeping shared by the torch optimizers and the distributed optimizers.

Horovod's naming checks on ``named_parameters`` (:func:`check_named_parameters`), the tests
for a parameter (or the set of parameters) that changed after an optimizer was built
(:func:`param_changed`, :func:`params_changed`), torch's mapping of a saved state dict onto
the current parameters (:func:`saved_state_by_param`), and :func:`run_closure`, torch.optim's
closure contract that every optimizer of the package keeps. A bucket of parameters is
:class:`slamb_comm.adapters.torch.optim.bucket.Bucket`.
"""

import torch

from slamb_comm.errors import LayoutError

from .tensors import local_of, state_dtype

__all__ = ["check_named_parameters", "param_changed", "params_changed", "saved_state_by_param", "run_closure"]

def run_closure(closure):
    """``step(closure)`` as ``torch.optim`` does it: the closure first, under ``torch.enable_grad()``
    (steps run under ``no_grad``); its loss, or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def check_named_parameters(named_parameters, param_groups):
    """Horovod's checks: (name, tensor) tuples, unique names, every parameter named."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [
            (f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(param_groups) for j, v in enumerate(g["params"])
        ]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), "
            "usually produced by model.named_parameters()."
        )
    seen, dups = set(), set()
    for k, _ in named_parameters:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         "Found duplicates: %s" % ", ".join(sorted(dups)))
    all_ids = {id(v) for g in param_groups for v in g["params"]}
    named_ids = {id(v) for _, v in named_parameters}
    unnamed = all_ids - named_ids
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            "Python object ids: %s" % ", ".join(str(i) for i in sorted(unnamed))
        )
    names = {}
    for k, v in named_parameters:
        names.setdefault(id(v), k)
    return names


def param_changed(p, name, shape, dtype):
    """A :class:`LayoutError` if parameter ``p`` (or its gradient) no longer fits the bucket it
    was built into (``shape``, compute ``dtype``), else None."""
    mine, grad = local_of(p), None if p.grad is None else local_of(p.grad)  # a DTensor's piece (FSDP2)
    now = tuple(mine.shape) if tuple(mine.shape) != shape or grad is None else tuple(grad.shape)
    if now != shape:
        return LayoutError(f"parameter {name!r} changed shape after the optimizer was built: "
                           f"was {shape}, is now {now}")
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or state_dtype(p.dtype) != dtype:
        return LayoutError(f"parameter {name!r} changed dtype after the optimizer was built: its bucket is {dtype}, "
                           f"it is now {p.dtype} (shape {shape}); cast the model (model.to(dtype)) before building "
                           "the optimizer, or build a new optimizer after casting it")
    return None


def params_changed(opt, params):
    """A :class:`LayoutError` if ``opt``'s parameter groups no longer hold exactly ``params``."""
    now = [p for g in opt.param_groups for p in g["params"]]
    if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
        return LayoutError(f"the set of parameters changed after the optimizer was built: "
                           f"{len(params)} then, {len(now)} now (build a new optimizer instead)")
    return None


def saved_state_by_param(optimizer, state_dict):
    """The raw per-parameter state of ``state_dict`` keyed by this optimizer's parameters
    (torch's own mapping: saved ids, in order, onto the current groups' parameters)."""
    saved = [i for g in state_dict["param_groups"] for i in g["params"]]
    current = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved) != len(current):
        raise ValueError("loaded state dict has a different number of parameters")
    return {p: state_dict["state"][i] for i, p in zip(saved, current) if i in state_dict["state"]}
