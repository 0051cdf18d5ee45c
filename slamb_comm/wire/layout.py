"""The fused layout of a list of tensors, and what an exchange takes as its tensors.

* :class:`Layout`: many tensors viewed as one contiguous fused buffer, with the always-dense rule
  of docs/algorithm.md section 1 (ndim <= 1 or fewer than ``dense_threshold`` elements). It keeps
  O(number of tensors) numbers, never an array of positions.
* :func:`take`: an exchange's input -- a fused buffer, a list of arrays, or a lazily read sequence --
  checked against a layout and viewed as its tensors (no copy), with the error that names what is
  wrong and the fix.
"""

import hashlib
import math
from typing import NamedTuple

import numpy as np

from .. import arrays as _arr
from ..errors import ConfigError, DTypeError, LayoutError, NonContiguousError

__all__ = ["DATA_DTYPES", "Layout", "Shard", "LazyTensors", "per_tensor", "take", "fused_input"]

#: dtypes of the arrays slamb_comm exchanges (parameters, gradients, momenta).
DATA_DTYPES = ("float16", "float32", "float64")


class Shard(NamedTuple):
    """Where a rank's piece of a sharded tensor lies: elements ``[start, start + size)`` of the
    whole tensor of shape ``shape``, in row-major order (FSDP2's ``Shard(0)`` pieces are such runs)."""

    shape: tuple
    start: int


class Layout:
    """A fixed list of tensors fused into one contiguous 1-D buffer.

    Args:
        shapes: the tensors' shapes, in exchange order.
        dtype: the one dtype of the fused buffer (float16, float32 or float64).
        names: optional names (default ``"0"``, ``"1"``, ...), used in error messages.
        dense_threshold: tensors with ndim <= 1 or fewer elements than this are always
            sent whole by masked exchanges (docs/algorithm.md section 1).
        shards: for sharded tensors (docs/algorithm.md section 15), one :class:`Shard` per
            tensor: the tensors are pieces of whole tensors, the always-dense rule reads the
            whole tensors' shapes, and the cyclic mask numbers its units over the whole
            tensors, so a rank's M_t is the unsharded M_t restricted to its pieces.

    Attributes:
        sizes, offsets: element counts and start offsets of each tensor in the buffer.
        total: the buffer's element count.
        dense: per tensor, whether the always-dense rule applies.
        shards: the :class:`Shard` of each tensor, or None (whole tensors).
    """

    def __init__(self, shapes, dtype="float32", names=None, dense_threshold=9000, shards=None):
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        dt = np.dtype(dtype)
        if dt.name not in DATA_DTYPES:
            raise DTypeError(f"unsupported array dtype {dt.name}; slamb_comm exchanges {', '.join(DATA_DTYPES)}")
        self.dtype = dt
        self.names = [str(n) for n in names] if names is not None else [str(i) for i in range(len(self.shapes))]
        if len(self.names) != len(self.shapes):
            raise ConfigError(f"{len(self.names)} names for {len(self.shapes)} tensors")
        if int(dense_threshold) < 0:
            raise ConfigError(f"dense_threshold must be >= 0, got {dense_threshold}")
        self.dense_threshold = int(dense_threshold)
        self.sizes = [int(math.prod(s)) for s in self.shapes]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets.pop()
        self.shards = _check_shards(shards, self.sizes, self.names)
        whole = self.shapes if self.shards is None else [sh.shape for sh in self.shards]
        self.dense = [len(s) <= 1 or math.prod(s) < self.dense_threshold for s in whole]
        self.index_dtype = np.dtype(np.int32 if self.total < 2**31 else np.int64)
        self.compressible = [i for i, d in enumerate(self.dense) if not d and self.sizes[i]]

    @property
    def dense_index(self):
        """Positions of the always-dense elements (built on demand: O(total); for tests and inspection)."""
        parts = [np.arange(o, o + n) for o, n, d in zip(self.offsets, self.sizes, self.dense) if d]
        return np.concatenate(parts).astype(self.index_dtype) if parts else np.zeros(0, self.index_dtype)

    @property
    def compressible_index(self):
        """Positions of the compressible elements (built on demand: O(total); for tests and inspection)."""
        parts = [np.arange(o, o + n) for o, n, d in zip(self.offsets, self.sizes, self.dense) if not d]
        return np.concatenate(parts).astype(self.index_dtype) if parts else np.zeros(0, self.index_dtype)

    @classmethod
    def from_arrays(cls, arrays, names=None, dense_threshold=9000):
        """The layout of ``arrays`` (all of one dtype)."""
        arrays = list(arrays)
        dtypes = [a.dtype.name for a in arrays]
        if len(set(dtypes)) > 1:
            label = [f"array {i}" if names is None else f"array {i} ({names[i]!r})" for i in range(len(dtypes))]
            mixed = ", ".join(f"{label[i]} is {d}" for i, d in enumerate(dtypes) if d != dtypes[0])
            raise DTypeError(f"the arrays of one communicator must share one dtype: you passed {len(dtypes)} arrays, "
                             f"{label[0]} is {dtypes[0]} but {mixed}; build one communicator per dtype, or cast "
                             "the arrays to one dtype first (e.g. [a.astype('float32') for a in arrays])")
        dtype = dtypes.pop() if dtypes else "float32"
        return cls([a.shape for a in arrays], dtype, names=names, dense_threshold=dense_threshold)

    def __len__(self):
        return len(self.shapes)

    def __repr__(self):
        return f"Layout({len(self)} tensors, {self.total} elements, {self.dtype.name}, {sum(self.dense)} always dense)"

    def describe(self, limit=8):
        """A short human description: tensor names, shapes, dtype."""
        items = [f"{n}{list(s)}" for n, s in zip(self.names[:limit], self.shapes[:limit])]
        more = f", ... ({len(self) - limit} more)" if len(self) > limit else ""
        return f"{len(self)} tensors of {self.dtype.name}, {self.total} elements: {', '.join(items)}{more}"

    def digest(self, *extra):
        """A 16-byte fingerprint of the layout plus ``extra`` options, for cross-rank checks."""
        pieces = () if self.shards is None else (self.shards,)  # whole tensors: the digest as before
        h = hashlib.sha256(repr((self.shapes, self.dtype.name, self.dense_threshold, *pieces, extra)).encode())
        return h.digest()[:16]

    def views(self, flat):
        """Per-tensor views (shaped like the tensors) into a fused 1-D buffer."""
        return [flat[o : o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def flat_views(self, flat):
        """Per-tensor 1-D views into a fused 1-D buffer."""
        return [flat[o : o + n] for o, n in zip(self.offsets, self.sizes)]

    def segments(self):
        """``(offset, size)`` of every tensor."""
        return list(zip(self.offsets, self.sizes))


def _check_shards(shards, sizes, names):
    """``shards`` as a list of :class:`Shard` (or None), each piece inside its whole tensor."""
    if shards is None:
        return None
    shards = [Shard(tuple(int(d) for d in sh[0]), int(sh[1])) for sh in shards]
    if len(shards) != len(sizes):
        raise ConfigError(f"{len(shards)} shards for {len(sizes)} tensors")
    for sh, n, name in zip(shards, sizes, names):
        if sh.start < 0 or sh.start + n > math.prod(sh.shape):
            raise ConfigError(f"tensor {name!r}: a piece of {n} elements at {sh.start} does not fit in "
                              f"its whole tensor of shape {list(sh.shape)}")
    return shards


def views(layout, x):
    """Per-tensor 1-D arrays of ``x``, checked against ``layout``: a fused buffer, a list of arrays, a
    lazy sequence, or device addresses (:class:`~slamb_comm.device.tables.Addresses`, read through
    the arrays that own them: its ``owners``)."""
    x = getattr(x, "owners", x)
    if hasattr(x, "shape") or hasattr(x, "__dlpack__"):
        flat = _arr.as_array(x)
        if flat.shape != (layout.total,) or flat.dtype != layout.dtype:
            raise LayoutError(f"expected a fused buffer of {layout.total} {layout.dtype.name}, "
                              f"got {flat.shape} {flat.dtype.name}")
    elif len(x) != len(layout):
        raise LayoutError(f"got {len(x)} arrays, expected {len(layout)}")
    return per_tensor(layout, x)


def per_tensor(layout, x):
    """1-D per-tensor arrays of ``x``: views of a fused buffer, flattened items of a list or
    tuple, or, for any other sequence, its items read lazily one by one (no validation)."""
    if isinstance(x, (list, tuple)):
        return [_arr.as_array(a).reshape(-1) for a in x]
    if hasattr(x, "shape") or hasattr(x, "__dlpack__"):
        return layout.flat_views(_arr.as_array(x))
    return LazyTensors(x)


class LazyTensors:
    """Per-tensor 1-D arrays of a sequence read lazily: item i is fetched when it is indexed
    (the torch adapters convert 16-bit parameters one tensor at a time this way)."""

    def __init__(self, seq):
        self.seq = seq

    def __len__(self):
        return len(self.seq)

    def __getitem__(self, i):
        return _arr.as_array(self.seq[i]).reshape(-1)


def take(layout, x):
    """``(xp, views)``: ``x`` checked against ``layout`` and viewed as its tensors (``views[i]`` is
    tensor i as a 1-D array on the caller's memory, no copy).

    ``x`` is a fused 1-D buffer, a list or tuple of arrays shaped like the layout, or any other
    sequence, which is read lazily, item by item, and trusted to hold arrays of the layout's shapes
    and dtype (the torch adapters pass their 16-bit parameters that way, converted one tensor at a
    time). Raises LayoutError/NonContiguousError/DTypeError/TypeError on bad input; an exchange turns
    that into a collective failure."""
    lay = layout
    if isinstance(x, (list, tuple)):
        arrs = [_arr.as_array(a) for a in x]
        if len(arrs) != len(lay):
            raise LayoutError(f"got {len(arrs)} arrays, the communicator was built for {len(lay)}")
        xp = _arr.namespace(*arrs) if arrs else np
        for a, name, shape in zip(arrs, lay.names, lay.shapes):
            _check(a, f"tensor {name!r}", lay, shape)
        return xp, [a.reshape(-1) for a in arrs]
    if hasattr(x, "shape") or hasattr(x, "__dlpack__"):
        flat = _arr.as_array(x)
        if flat.ndim != 1 or flat.size != lay.total:
            raise LayoutError(f"expected a fused 1-D buffer of {lay.total} elements, got shape {tuple(flat.shape)}")
        _check(flat, "fused buffer", lay, flat.shape)
        return _arr.namespace(flat), lay.flat_views(flat)
    if len(x) != len(lay):
        raise LayoutError(f"got {len(x)} arrays, the communicator was built for {len(lay)}")
    views = LazyTensors(x)
    return (_arr.namespace(views[0]) if len(lay) else np), views


def _check(a, what, lay, shape):
    """LayoutError/DTypeError/NonContiguousError where array ``a`` (``what``) does not fit ``lay``."""
    if tuple(a.shape) != tuple(shape):
        raise LayoutError(f"{what} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if a.dtype.name not in DATA_DTYPES:
        raise DTypeError(f"{what} has unsupported dtype {a.dtype.name}; expected {lay.dtype.name}, the dtype it was "
                         f"built for: cast it (a.astype('{lay.dtype.name}'))")
    if a.dtype != lay.dtype:
        raise LayoutError(f"{what} has dtype {a.dtype.name}, expected {lay.dtype.name}, the dtype it was built for: "
                          f"cast it (a.astype('{lay.dtype.name}')), or build another on {a.dtype.name} arrays")
    if not a.flags.c_contiguous:
        raise NonContiguousError(f"{what} is not C-contiguous")


def fused_input(layout, x, views):
    """``x`` as one fused 1-D array where it is one (already checked: ``views`` are its tensors), else None."""
    if isinstance(x, (list, tuple)) or views is None or isinstance(views, LazyTensors):
        return None
    return _arr.as_array(x)
