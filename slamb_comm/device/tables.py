"""Reading a layout's tensors where they are on a device: tiles, tables of addresses, copies.

The device kernels (:mod:`slamb_comm.device.kernels`) work on a layout's tensors wherever they live --
one fused buffer, a list of arrays, a framework's own tensors -- through a table of device
addresses, one per tensor, and a table of tiles (``TILE`` consecutive elements of one tensor), so
that one launch covers every tensor:

* :class:`Tiles`: the tile table of a layout, its tensors in a given grouping;
* :class:`AddressTables`: the device tables of addresses of whatever is handed in, kept by role and
  copied to the device only when the addresses are new (:data:`KEEP` per role);
* :class:`Addresses`: the record an adapter passes instead of arrays, after checking them;
* :func:`copy_range`: one launch copying a range of the layout's elements between the tensors
  and a flat buffer, scaled (:meth:`Communicator.sync` of a list of device arrays).
"""

from typing import NamedTuple

import numpy as np

from .. import arrays as _arr
from . import kernels as _k
from ..errors import LayoutError

__all__ = ["Addresses", "AddressTables", "Lookback", "Tiles", "Tensors", "copy_range", "dummy", "tensors", "table_bytes", "tiled",
           "GRID", "KEEP"]

#: blocks per launch at most: the kernels loop over their tiles
GRID = 8192
#: tables of addresses kept per role: tensors that alternate between a few places (a new tensor
#: made while the old one is alive, then the old place reused) cost no copy
KEEP = 4


class Lookback:
    """A few device words on their way back to the host without a wait: :meth:`send` queues an
    asynchronous copy into pinned host memory on the current stream, with an event behind it;
    :meth:`read` returns them, waiting only if the device has not got there yet (in a training loop the
    next step's forward and backward passes lie between the two, so it does not wait)."""

    def __init__(self, xp, n):
        self._mem = xp.cuda.alloc_pinned_memory(4 * n)
        self.host = np.frombuffer(self._mem, np.uint32, n)
        self._event = None

    def send(self, xp, words):
        """Queue the copy of ``words`` (``n`` uint32 on the current device) behind the current stream's work."""
        words.get(out=self.host, blocking=False)
        self._event = xp.cuda.Event(disable_timing=True)
        self._event.record()

    def read(self, wait=False):
        """The words of the last :meth:`send`. ``wait``: the caller knows the device has not got there
        (the same step): wait for it without asking first."""
        if self._event is not None and (wait or not self._event.done):
            self._event.synchronize()
        return self.host.copy()


class Addresses(NamedTuple):
    """The layout's tensors given by their device addresses, one per tensor, each contiguous, of
    the layout's dtype and size, on the current device: what an adapter that checked them passes
    instead of arrays, so that a step reads them where they are. ``owners`` are the objects that
    own that memory (kept alive for the step, and read on the failure path to name a bad
    tensor)."""

    ptrs: tuple
    owners: tuple


class Tiles:
    """The tile table of a layout on the device of ``xp``: per tile its tensor and its range of the
    fused order, ordered by group (``groups``: lists of tensor indices; default one group in
    layout order), then by tensor in the group's order, so that a group's tiles are one range
    (``group_tiles``) and a tensor's tiles are one range (``tt0``, ``ntt``). Built once."""

    def __init__(self, layout, xp, groups=None):
        T = len(layout)
        self.groups = [list(range(T))] if groups is None else [list(g) for g in groups]
        if sorted(i for g in self.groups for i in g) != list(range(T)):
            raise LayoutError(f"the groups must hold every tensor once, got {self.groups}")
        tensor, lo, hi, tt0, ntt, self.group_tiles = [], [], [], [0] * T, [0] * T, []
        for grp in self.groups:
            first = len(tensor)
            for i in grp:
                o, n = layout.offsets[i], layout.sizes[i]
                tt0[i] = len(tensor)
                for a in range(o, o + n, _k.TILE):
                    tensor.append(i)
                    lo.append(a)
                    hi.append(min(a + _k.TILE, o + n))
                ntt[i] = len(tensor) - tt0[i]
            self.group_tiles.append((first, len(tensor)))
        self.count = len(tensor)
        self.lo_host, self.hi_host = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        self.elems = self.hi_host - self.lo_host
        self.tensor = xp.asarray(np.asarray(tensor or [0], np.int32))
        self.lo, self.hi = xp.asarray(np.asarray(lo or [0], np.int64)), xp.asarray(np.asarray(hi or [0], np.int64))
        self.tt0, self.ntt = xp.asarray(np.asarray(tt0, np.int64)), xp.asarray(np.asarray(ntt, np.int64))
        self.toff = xp.asarray(np.asarray(layout.offsets, np.int64))

    @property
    def table(self):
        """The three device arrays every kernel takes first: tile -> tensor, start, end."""
        return self.tensor, self.lo, self.hi

    def covering(self, lo, hi):
        """The range of tiles holding fused elements ``[lo, hi)`` (tiles in layout order)."""
        return int(np.searchsorted(self.hi_host, lo, side="right")), int(np.searchsorted(self.lo_host, hi))


class AddressTables:
    """Device tables of addresses, one per tensor of ``layout``, kept per role (see the module
    docstring)."""

    def __init__(self, layout):
        self.layout = layout
        self._tables = {}  # (role, key) -> device table, the most recently used last

    def table(self, xp, role, a):
        """The table of ``a``: a fused buffer, a list of arrays, or :class:`Addresses`."""
        lay = self.layout
        base = None
        if isinstance(a, Addresses):
            if len(a.ptrs) != len(lay):
                raise LayoutError(f"{role}: {len(a.ptrs)} addresses for {len(lay)} tensors")
            key = tuple(a.ptrs)
        elif hasattr(a, "shape") or hasattr(a, "__dlpack__"):
            base = check_fused(lay, _arr.as_array(a), role).data.ptr
            key = ("fused", base)
        else:
            if len(a) != len(lay):
                raise LayoutError(f"{role}: got {len(a)} arrays, expected {len(lay)}")
            key = tuple(address(lay, i, _arr.as_array(v), role, xp) for i, v in enumerate(a))
        table = self._tables.pop((role, key), None)
        if table is None:
            ptrs = key if base is None else [base + o * lay.dtype.itemsize for o in lay.offsets]
            mine = [k for k in self._tables if k[0] == role]
            for k in mine[: max(0, len(mine) - KEEP + 1)]:  # the least recently used of this role
                del self._tables[k]
            table = xp.asarray(np.asarray(ptrs, np.uint64))
        self._tables[(role, key)] = table
        return table


def check_fused(lay, a, role):
    """``a`` if it is a fused buffer of ``lay``, else LayoutError."""
    if a.shape != (lay.total,) or a.dtype != lay.dtype:
        raise LayoutError(f"{role}: expected a fused buffer of {lay.total} {lay.dtype.name}, got {a.shape} {a.dtype.name}")
    return a


def address(lay, i, a, role, xp):
    """The device address of tensor ``i``'s array ``a`` of a list, checked."""
    if _arr.namespace(a) is not xp:
        raise TypeError(f"{role}: tensor {lay.names[i]!r} is a {_arr.namespace(a).__name__} array among {xp.__name__} ones")
    if a.size != lay.sizes[i] or a.dtype != lay.dtype:
        raise LayoutError(f"{role}: tensor {lay.names[i]!r} has {a.size} {a.dtype.name}, expected {lay.sizes[i]} "
                          f"{lay.dtype.name}")
    if not a.flags.c_contiguous:
        raise LayoutError(f"{role}: tensor {lay.names[i]!r} is not contiguous; pass a contiguous copy")
    return int(a.data.ptr)


def copy_range(xp, tiles, table, lo, hi, buf, scale, into_tensors):
    """One launch: fused elements ``[lo, hi)`` of the tensors at ``table`` into ``buf[: hi - lo]``
    (``into_tensors`` False) or back from it (True), each multiplied by ``scale`` in their dtype
    (exactly: 1 leaves them as they are)."""
    t0, t1 = tiles.covering(lo, hi)
    dt = buf.dtype
    nbytes = (hi - lo) * dt.itemsize
    moved = [("tensors" if into_tensors else "buffer", nbytes)]
    _k.launch(xp, _k.kernel_name("copy", dt), min(max(1, t1 - t0), GRID), (
        *tiles.table, np.int64(t0), np.int64(t1), table, tiles.toff, buf, np.int64(lo), np.int64(hi),
        np.float64(scale), np.int32(1 if into_tensors else 0)),
        reads=[("buffer" if into_tensors else "tensors", nbytes), ("tables", (t1 - t0) * 20)], writes=moved)


_DUMMIES = {}  # (library, device, dtype) -> a one-element array for an argument a launch does not read


def dummy(xp, dtype, a=None):
    """``a``, or where it is None a one-element array standing for an argument the launch does not read."""
    if a is not None:
        return a
    key = (id(xp), xp.cuda.Device().id, np.dtype(dtype).name)
    d = _DUMMIES.get(key)
    if d is None:
        d = _DUMMIES[key] = xp.empty(1, dtype)
    return d


class Tensors(NamedTuple):
    """A layout's tensors as the kernels take them: a fused buffer (``flat``, ``fused`` 1) or a table of device
    addresses, one per tensor (``tab``, ``fused`` 0); the other is a dummy."""

    tab: object
    flat: object
    fused: np.int32


def tensors(xp, tables, role, a, dtype):
    """``a``, a fused buffer (no table: a new buffer every step costs no copy) or a list of arrays (their table of
    addresses from ``tables``, a :class:`~slamb_comm.device.tables.AddressTables`: copied when the addresses are new)."""
    if isinstance(a, (list, tuple)):
        return Tensors(tables.table(xp, role, a), dummy(xp, dtype), np.int32(0))
    return Tensors(dummy(xp, np.uint64), a, np.int32(1))


def table_bytes(t, ntensors):
    """The declared bytes of the tables a pass reads: the offsets, and the addresses of a list."""
    return ("tables", 8 * ntensors * (1 if t is None or t.fused else 2))


def tiled(tiles):
    """The four arguments every tiled kernel takes first: tile -> tensor, start, end, and the count."""
    return (*tiles.table, np.int64(tiles.count))
