"""A bucket: parameters that share one Communicator and one core rule (:class:`Bucket`, keyed by
:class:`BucketKey`).

Every bucketed optimizer of the package (SLAMB, 1-bit LAMB, DeMo) fuses its trainable parameters
into buckets by device, compute dtype, options and step count; a bucket's core rule steps them
together, on one fused layout. Per step a bucket's checks cost a constant number of Python calls
whatever its number of tensors where nothing changed (:meth:`Bucket.layout_problem`): what the last
full check saw is recorded, and compared with what is there now by C-level passes over the tensors
(``map`` with ``operator.attrgetter``, tuple comparison); only a difference runs the per-parameter
checks.
"""

import itertools
import operator
from dataclasses import dataclass
from typing import Any

from ..params import param_changed
from ..tensors import is_dtensor, np_dtype

__all__ = ["Bucket", "BucketKey", "gradients_of", "present", "any_gradient"]

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


@dataclass(frozen=True)
class BucketKey:
    """What puts parameters in one bucket (:class:`Bucket`): their device and compute dtype, the
    options the core rule is built with (per optimizer: ``SLAMB``'s :class:`~.slamb_options.SlambKnobs`,
    ``OneBitLAMB``'s tuple of options), and their step count."""

    device: str
    dtype: str
    knobs: Any
    age: int


class Bucket:
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
        self.published = None  # what the torch state's views were last pointed at (the optimizer's publish)
        self.flat = None  # the bucket as one flat buffer (flat.FlatBuffer), where the optimizer's ``fused`` asks
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

    def lr_wd(self):
        """The bucket's learning rate and weight decay now: a float each where its groups agree, else
        one per tensor (read per group, spread at C level)."""
        lr = [float(g["lr"]) for g in self.unique_groups]
        wd = [float(g["weight_decay"]) for g in self.unique_groups]
        return tuple(v[0] if len(set(v)) == 1 else list(map(v.__getitem__, self.group_of)) for v in (lr, wd))

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
