"""Parameter bookkeeping shared by the torch optimizers and the distributed optimizers.

Horovod's naming checks on ``named_parameters`` (:func:`check_named_parameters`), the tests
for a parameter (or the set of parameters) that changed after an optimizer was built
(:func:`param_changed`, :func:`params_changed`), torch's mapping of a saved state dict onto
the current parameters (:func:`saved_state_by_param`), :class:`Engine`, the bucket of
parameters that shares one Communicator and one core rule, and :func:`run_closure`, torch.optim's
closure contract that every optimizer of the package keeps.

Per step a bucket's checks cost a constant number of Python calls whatever its number of tensors
where nothing changed (:meth:`Engine.layout_problem`): what the last full check saw is recorded,
and compared with what is there now by C-level passes over the tensors (``map`` with
``operator.attrgetter``, tuple comparison); only a difference runs the per-parameter checks.
"""

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch

from slamb_comm.errors import LayoutError

from .tensors import is_dtensor, local_of, np_dtype, state_dtype

__all__ = ["check_named_parameters", "param_changed", "params_changed", "saved_state_by_param", "Engine", "EngineKey",
           "run_closure", "gradients_of", "any_gradient", "present"]

_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")


def gradients_of(params):
    """Each parameter's ``.grad`` (None where it has none), as a tuple; read at C level."""
    return tuple(map(_GRAD, params))


def present(grads):
    """Per gradient of ``grads``, whether it is there (not None), as a tuple; at C level (``None in
    grads`` would call each tensor's ``__eq__``)."""
    return tuple(map(operator.is_not, grads, itertools.repeat(None)))


def any_gradient(grads):
    """Whether some gradient of ``grads`` is there (not None); stops at the first."""
    return any(map(operator.is_not, grads, itertools.repeat(None)))


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
        return LayoutError(f"parameter {name!r} changed dtype after the optimizer was built: "
                           f"its bucket is {dtype}, it is now {p.dtype} (shape {shape})")
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


@dataclass(frozen=True)
class EngineKey:
    """What puts parameters in one bucket (:class:`Engine`): their device and compute dtype, the
    options the core rule is built with (per optimizer: ``SLAMB``'s :class:`~.slamb.SlambKnobs`,
    ``OneBitLAMB``'s tuple of options), and their step count."""

    device: str
    dtype: str
    knobs: Any
    age: int


class Engine:
    """The parameters of one (device, dtype, hyper-parameter) bucket: one Communicator and
    one :class:`slamb_comm.methods.slamb.SlambRule` over their fused layout."""

    __slots__ = ("key", "params", "index", "_groups", "unique_groups", "group_of", "names", "dtype", "np_dtype",
                 "comm", "rule", "published", "flat", "_sharded", "_seen")

    def __init__(self, key, params, groups, names, dtype):
        self.key = key
        self.params = params
        self.index = {p: i for i, p in enumerate(params)}
        self.groups = groups
        self.names = names
        self.dtype = dtype
        self.np_dtype = np_dtype(dtype)
        self.comm = self.rule = None
        self.published = None  # what the torch state's views were last pointed at (the optimizer's _publish)
        self.flat = None  # the bucket as two flat buffers (flat.Flat), where the optimizer's ``fused`` asks
        self._sharded = any(map(is_dtensor, params))  # FSDP2's DTensors: checked in full at every step
        self._seen = None  # what the last full check (layout_problem) passed: see _signature

    @property
    def groups(self):
        """Each parameter's group (a list, in the parameters' order); setting it also sets
        ``unique_groups`` (each group once, in first-seen order) and ``group_of`` (each parameter's
        index into ``unique_groups``), so that per-step work is per group, not per parameter."""
        return self._groups

    @groups.setter
    def groups(self, groups):
        first = {}
        for g in groups:
            first.setdefault(id(g), (len(first), g))
        self._groups = groups
        self.unique_groups = [g for _, g in first.values()]
        self.group_of = tuple(first[id(g)][0] for g in groups)

    def layout_problem(self, grads=None):
        """A :class:`LayoutError` naming the first parameter that no longer fits the bucket
        (:func:`param_changed`: its shape, its dtype, its gradient's shape), else None. ``grads``:
        the parameters' ``.grad`` now (:func:`gradients_of`), read here if not given.

        A constant number of Python calls where nothing changed since the last check that passed:
        the parameters' shapes and dtypes, which gradients are there and their shapes are compared
        with what that check saw, at C level; the per-parameter checks run only on a difference.
        This sees every way a parameter's shape or dtype changes (``p.data = ...``, ``p.set_(...)``
        under ``no_grad``; torch refuses to resize in place a parameter that requires grad, and
        ``p.data.resize_`` resizes another tensor) and a gradient of another shape (which torch
        refuses on assignment, but ``p.grad.resize_`` makes). DTensors (FSDP2: their pieces' shapes
        are what the bucket holds) are checked in full at every step."""
        grads = gradients_of(self.params) if grads is None else grads
        seen = None if self._sharded else self._signature(grads)
        if seen is not None and seen == self._seen:
            return None
        for i, p in enumerate(self.params):
            problem = param_changed(p, self.names[i], self.comm.layout.shapes[i], self.dtype)
            if problem is not None:
                return problem
        self._seen = seen
        return None

    def _signature(self, grads):
        """What :meth:`layout_problem` compares: the parameters' (shape, dtype), which gradients
        are there, and their shapes (C-level passes, no Python call per tensor)."""
        have = present(grads)
        return tuple(map(_SHAPE_DTYPE, self.params)), have, tuple(map(_SHAPE, itertools.compress(grads, have)))
