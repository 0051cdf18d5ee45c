"""A strict stand-in for CuPy, so that every CuPy branch of slamb_comm runs on the CPU.

``install()`` puts this module in ``sys.modules`` as ``cupy`` (with ``cupy.cuda``,
``cupy.cuda.nccl`` and ``cupy.lib.stride_tricks``); slamb_comm then treats its arrays as
device arrays and takes its GPU code paths. Its arrays hold host memory (a NumPy array
inside) but behave like CuPy's where a mistake would hide on the CPU:

* **No implicit conversion to NumPy**: ``np.asarray(a)`` / ``a.__array__()`` raise
  ``TypeError`` (as CuPy does); a NumPy array where a device array is expected (an operand,
  an ``out=``, an index, a value assigned into a device array) raises ``TypeError``;
  NumPy ufuncs and functions refuse them (``__array_ufunc__ = None``).
* **Alignment**: ``a.view(dtype)`` raises :class:`MisalignedAddressError` unless the
  address is a multiple of the new item size (a GPU faults with
  ``cudaErrorMisalignedAddress`` on such a read and loses its context).
* **Host synchronisations are counted** (:data:`syncs`, :func:`reset_syncs`): ``.get()``,
  ``asnumpy``, ``bool()``, ``float()``, ``int()``, ``.item()``, ``.tolist()``, stream and
  event ``synchronize()``, and the operations whose result size depends on the data
  (``flatnonzero``, ``nonzero``, ``unique``, ``where`` with one argument, boolean-mask indexing).
* **Device operations are counted** (:data:`launches`, by operation name;
  :func:`reset_launches`, :func:`total_launches`): one per call of anything that on a GPU
  is a kernel launch (or a device memset/memcpy), whatever the sizes, 0-d arrays included
  (and empty ones, for which CuPy launches nothing: the count is per call). Counted: every operator (``a + b``, ``2 * a``, ``a += 1``, ``-a``, ``a < b``:
  named after the operator, ``add``/``radd``/``iadd``, ...); every module function that
  computes (ufuncs such as ``sqrt``/``multiply(..., out=)``, ``where``, ``clip``,
  reductions ``sum``/``max``/``dot``/``all``/``any``/``count_nonzero``, scans ``cumsum``,
  ``sort``/``argsort``/``partition``, ``searchsorted``, ``bincount``, ``concatenate``/``stack``,
  ``take``/``put``/``repeat``, ``flatnonzero``/``nonzero``/``unique`` (also a sync),
  ``zeros_like``/``ones_like``/``full_like``); the methods ``copy``, ``fill``, ``take``, the
  reductions, ``astype`` unless it returns the array itself (``copy=False``, same dtype);
  ``zeros``, ``ones``, ``full`` and ``arange`` (they write memory); ``ascontiguousarray``,
  ``reshape`` and ``ravel`` when they copy (a non-contiguous input); indexing with an array
  or a list (``a[idx]``: ``getitem(gather)``; a boolean mask is also a sync); every
  assignment into a device array (``a[idx] = v``: ``setitem(scatter)``; ``a[2:5] = b``:
  ``setitem(copy)``; ``a[2:5] = 0``: ``setitem(fill)``); each collective of the fake NCCL.
  Not counted (no launch on a GPU): ``empty``/``empty_like``, views (basic indexing with
  ints, slices, ``...``, ``None``: ``a[2:5]``, ``a[3]`` (a 0-d view, as in CuPy),
  ``.view(dtype)``, ``.T``, a contiguous ``reshape``/``ravel``, ``broadcast_to``,
  ``as_strided``, ``from_dlpack``), attribute reads, stream and event calls, and the
  host-to-device copies below. A ``cupy.fuse``d function (:func:`fuse` here runs it eagerly)
  counts one launch per call, ``fuse(name)``, as CuPy compiles it into one kernel; a host read
  or a host-to-device copy inside it raises (CuPy's fusion cannot do either). What the double
  does not check is whether CuPy can fuse the function at all (only elementwise ufuncs,
  ``where`` and scalars): that needs the real GPU run. An ``ElementwiseKernel``/``RawKernel``
  (which the double does not provide) is one launch on a GPU. It also does not see the several kernels that one CuPy
  call may launch (CUB's multi-pass sort, scan and reductions, ``unique``'s sort + scan +
  scatter, a ``where`` on arrays of different dtypes casting first): each call is one. The
  double has no ``packbits``/``unpackbits``, so code that uses CuPy's where it exists takes
  its fallback here and counts that fallback's operations.
* **Host-to-device copies are counted** (:data:`h2d`, by kind; :func:`reset_h2d`,
  :func:`total_h2d`): one per creation of a device array from host data, whatever its size
  (a scalar included): ``asarray``/``array`` of a NumPy array, a list or tuple, or a Python
  or NumPy scalar (``asarray``, ``array``); ``ndarray.set`` (``set``); a list or tuple
  assigned into a device array (``setitem``; this also counts a launch) or used as an index
  (``index``; CuPy copies it to the device first). ``asarray`` of a device array is no copy
  (and, with another dtype, an ``astype`` launch). Python and NumPy scalars given as operands
  or assigned (``a * 0.5``, ``a[:3] = np.float32(1)``) are kernel arguments, not copies. A
  NumPy array anywhere else raises (see above), so the double has no other way in from the
  host. Device-to-host copies are the ``get``/``asnumpy`` syncs.
  :func:`reset_counts` resets all three counters; :func:`counts` returns their totals, and
  :class:`counting` (a context manager) measures a block: ``with counting() as c: ...``,
  then ``c.launches``, ``c.h2d``, ``c.syncs`` (totals) and ``c.by_op``, ``c.by_h2d``,
  ``c.by_sync`` (Counters by name).
* Reductions return 0-d arrays (as CuPy's do), so ``float(a.sum())`` is a counted read.
* ``bincount`` raises ``ValueError`` on an empty input (CuPy takes a maximum).
* ``cupy.cuda.nccl`` is a fake NCCL whose collectives run over ``MPI.COMM_WORLD`` on the
  arrays' host memory, so :class:`slamb_comm.NCCLTransport` runs at 1, 2 and 4 ranks; every
  stream and event operation is logged in :data:`cuda_log` (stream orderings can be
  asserted, not observed).

* **Devices**: two fake devices; arrays remember where they were made, and an operation on an
  array of another device than the current one raises (CuPy allocates on, and launches on,
  the *current* device).

What it cannot catch: real concurrency and stream races (everything here runs in order on
the host); device numerics (CUDA's own rounding of sqrt and division, fused multiply-add,
reduction order in CUB); peer access and real transfers between devices;
CUDA-aware MPI on real device pointers; out-of-memory on a 141 GB device; performance.
Those need the real GPU run (``tests/test_gpu.py``; set ``SLAMB_COMM_REAL_CUPY=1`` to run
the strict-double tests against real CuPy there).
"""

import builtins
import ctypes
import sys
import types
from collections import Counter

import numpy as np

__all__ = ["install", "ndarray", "syncs", "reset_syncs", "total_syncs", "launches", "reset_launches",
           "total_launches", "h2d", "reset_h2d", "total_h2d", "reset_counts", "counts", "counting",
           "MisalignedAddressError", "torch_bridge", "aten_counter"]

syncs = Counter()  # kind -> count of host synchronisations
launches = Counter()  # operation name -> count of device operations (would-be kernel launches)
h2d = Counter()  # kind -> count of host-to-device copies
cuda_log = []  # (operation, stream ptr / event id, ...) in program order


def reset_syncs():
    syncs.clear()


def total_syncs():
    return builtins.sum(syncs.values())


def reset_launches():
    launches.clear()


def total_launches():
    return builtins.sum(launches.values())


def reset_h2d():
    h2d.clear()


def total_h2d():
    return builtins.sum(h2d.values())


def reset_counts():
    """Reset the three counters: host synchronisations, device operations, host-to-device copies."""
    reset_syncs()
    reset_launches()
    reset_h2d()


def counts():
    """The three totals now: ``{"launches": ..., "h2d": ..., "syncs": ...}``."""
    return {"launches": total_launches(), "h2d": total_h2d(), "syncs": total_syncs()}


class counting:
    """``with counting() as c:`` resets the counters, and on leaving keeps what the block did:
    ``c.launches``, ``c.h2d``, ``c.syncs`` (totals) and ``c.by_op``, ``c.by_h2d``,
    ``c.by_sync`` (Counters by name). The module's counters keep counting afterwards."""

    def __enter__(self):
        reset_counts()
        return self

    def __exit__(self, *exc):
        self.by_op, self.by_h2d, self.by_sync = Counter(launches), Counter(h2d), Counter(syncs)
        self.launches = builtins.sum(self.by_op.values())
        self.h2d = builtins.sum(self.by_h2d.values())
        self.syncs = builtins.sum(self.by_sync.values())

    def __repr__(self):
        return f"counting(launches={self.launches}, h2d={self.h2d}, syncs={self.syncs})"


class MisalignedAddressError(RuntimeError):
    """What a GPU's typed read at a misaligned address would raise (cudaErrorMisalignedAddress)."""


_fusing = [0]  # depth of fused calls under way: their operations are one launch, counted at the end


def _sync(kind):
    if _fusing[0]:
        raise RuntimeError(f"host read ({kind}) inside a cupy.fuse'd function: CuPy cannot fuse it")
    syncs[kind] += 1


def _launch(name):
    if not _fusing[0]:
        launches[name] += 1


def _copy_in(kind):
    if _fusing[0]:
        raise RuntimeError(f"host-to-device copy ({kind}) inside a cupy.fuse'd function: CuPy cannot fuse it")
    h2d[kind] += 1


def _is_view(r, a):
    """Whether ``r`` (a result computed from ``a``) is a view of ``a``'s memory (no copy made)."""
    return isinstance(r, np.ndarray) and (r.size == 0 or np.may_share_memory(r, a))


def _unwrap(x, where="argument"):
    if isinstance(x, ndarray):
        x._on_current_device()
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)} as {where}: pass a device array (cupy.asarray) instead")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, where) for v in x)
    return x


def _wrap(r):
    if isinstance(r, np.ndarray):
        return ndarray(r)
    if isinstance(r, np.generic):
        return ndarray(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    return r


def _call(fn, *args, **kw):
    args = _unwrap(args)
    if "out" in kw and kw["out"] is not None:
        out = kw["out"]
        if not isinstance(out, ndarray):
            raise TypeError(f"out= must be a device array, got {type(out)}")
        kw["out"] = out._a
        fn(*args, **kw)
        return out
    kw = {k: _unwrap(v) for k, v in kw.items()}
    return _wrap(fn(*args, **kw))


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class _Flags:
    def __init__(self, a):
        self.c_contiguous = a.flags.c_contiguous
        self.f_contiguous = a.flags.f_contiguous


class ndarray:
    """A device array of the double: NumPy memory, CuPy's manners."""

    __array_ufunc__ = None  # NumPy's ufuncs and binary operators defer to (and refuse) us
    __array_priority__ = 100

    def __init__(self, a, device=None):
        if not isinstance(a, np.ndarray):
            raise TypeError("strict_cupy.ndarray wraps a numpy array")
        self._a = a
        self._dev = Device.current if device is None else device

    def _on_current_device(self):
        """CuPy runs a kernel on the current device and refuses arrays that live elsewhere."""
        if self._dev != Device.current:
            raise ValueError(f"The device where the array resides ({self._dev}) is different from the current "
                             f"device ({Device.current}). Peer access has been activated.")

    def _same(self, a):
        return ndarray(a, self._dev)

    # ---------------------------------------------------------------- attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _Pointer(self._a.ctypes.data))
    T = property(lambda self: self._same(self._a.T))

    @property
    def device(self):
        return Device(self._dev)

    @property
    def __cuda_array_interface__(self):
        a = self._a
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False), "version": 3,
                "strides": None if a.flags.c_contiguous else a.strides}

    def __repr__(self):
        return f"strict_cupy.ndarray({self._a!r})"

    # ---------------------------------------------------------------- no implicit host conversion
    def __array__(self, *args, **kw):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly.")

    def __bool__(self):
        _sync("bool")
        return bool(self._a)

    def __float__(self):
        _sync("float")
        return float(self._a)

    def __int__(self):
        _sync("int")
        return int(self._a)

    def __index__(self):
        _sync("index")
        return int(self._a)

    def item(self):
        _sync("item")
        return self._a.item()

    def tolist(self):
        _sync("tolist")
        return self._a.tolist()

    def get(self, stream=None, order="C", out=None):
        _sync("get")  # (CuPy copies from the array's own device, whatever is current)
        return self._a.copy()

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("set() takes a numpy array")
        self._a[...] = arr.reshape(self._a.shape)
        _copy_in("set")

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (_wrap(v) for v in self._a)

    # ---------------------------------------------------------------- views and copies
    def view(self, dtype):
        dt = np.dtype(dtype)
        if dt.itemsize > self._a.itemsize and self._a.ctypes.data % dt.itemsize:
            raise MisalignedAddressError(
                f"view as {dt.name} at address {self._a.ctypes.data:#x}, not a multiple of {dt.itemsize}")
        return self._same(self._a.view(dt))

    def reshape(self, *shape, **kw):
        r = self._a.reshape(*shape, **kw)
        if not _is_view(r, self._a):  # a non-contiguous input: CuPy copies
            self._on_current_device()
            _launch("reshape(copy)")
        return self._same(r)

    def ravel(self):
        self._on_current_device()
        r = self._a.ravel()
        if not _is_view(r, self._a):
            _launch("ravel(copy)")
        return self._same(r)

    def copy(self, order="C"):
        self._on_current_device()
        _launch("copy")
        return self._same(self._a.copy(order))

    def astype(self, dtype, copy=True, **kw):
        if not copy and np.dtype(dtype) == self._a.dtype:
            return self
        self._on_current_device()
        _launch("astype")
        return self._same(self._a.astype(dtype))

    def fill(self, v):
        self._on_current_device()
        _launch("fill")
        self._a.fill(v)

    def take(self, indices, axis=None, out=None):
        _launch("take")
        return _call(np.take, self, indices, axis=axis, out=out)

    def __getitem__(self, key):
        key, advanced = _key(key)
        if not advanced:  # ints, slices, ..., None: a view, no kernel
            r = self._a[key]
            if not isinstance(r, np.ndarray):  # one element: CuPy gives a 0-d view
                r = self._a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
            return self._same(r)
        self._on_current_device()
        _launch("getitem(gather)")
        return _wrap(self._a[key])

    def __setitem__(self, key, value):
        key, advanced = _key(key)
        self._on_current_device()
        host_seq = _host_sequence(value)
        if host_seq:
            _copy_in("setitem")  # CuPy copies the list to the device, then assigns it
        kind = "scatter" if advanced else "copy" if host_seq or isinstance(value, ndarray) else "fill"
        _launch(f"setitem({kind})")
        self._a[key] = _unwrap(value, "value")

    # ---------------------------------------------------------------- reductions (0-d results)
    def sum(self, axis=None, dtype=None, out=None):
        _launch("sum")
        return _call(np.sum, self, axis=axis, dtype=dtype, out=out)

    def max(self, axis=None, out=None):
        _launch("max")
        return _call(np.max, self, axis=axis, out=out)

    def min(self, axis=None, out=None):
        _launch("min")
        return _call(np.min, self, axis=axis, out=out)

    def all(self, axis=None):
        _launch("all")
        return _call(np.all, self, axis=axis)

    def any(self, axis=None):
        _launch("any")
        return _call(np.any, self, axis=axis)

    # ---------------------------------------------------------------- operators (one launch each)
    def _bin(op, name):
        def f(self, other):
            if isinstance(other, np.ndarray):
                raise TypeError(f"Unsupported type {type(other)}: mixing device and host arrays")
            _launch(name)
            return _wrap(op(_unwrap(self), _unwrap(other)))
        return f

    def _rbin(op, name):
        def f(self, other):
            if isinstance(other, np.ndarray):
                raise TypeError(f"Unsupported type {type(other)}: mixing device and host arrays")
            _launch(name)
            return _wrap(op(_unwrap(other), _unwrap(self)))
        return f

    def _ibin(op, name):
        def f(self, other):
            if isinstance(other, np.ndarray):
                raise TypeError(f"Unsupported type {type(other)}: mixing device and host arrays")
            _launch(name)
            op(_unwrap(self), _unwrap(other), out=self._a, casting="same_kind")
            return self
        return f

    import operator as _op

    __add__, __radd__, __iadd__ = _bin(_op.add, "add"), _rbin(_op.add, "radd"), _ibin(np.add, "iadd")
    __sub__, __rsub__, __isub__ = _bin(_op.sub, "sub"), _rbin(_op.sub, "rsub"), _ibin(np.subtract, "isub")
    __mul__, __rmul__, __imul__ = _bin(_op.mul, "mul"), _rbin(_op.mul, "rmul"), _ibin(np.multiply, "imul")
    __truediv__, __rtruediv__, __itruediv__ = (_bin(_op.truediv, "truediv"), _rbin(_op.truediv, "rtruediv"),
                                               _ibin(np.true_divide, "itruediv"))
    __floordiv__, __rfloordiv__, __ifloordiv__ = (_bin(_op.floordiv, "floordiv"), _rbin(_op.floordiv, "rfloordiv"),
                                                  _ibin(np.floor_divide, "ifloordiv"))
    __mod__, __rmod__, __imod__ = _bin(_op.mod, "mod"), _rbin(_op.mod, "rmod"), _ibin(np.remainder, "imod")
    __pow__, __rpow__ = _bin(_op.pow, "pow"), _rbin(_op.pow, "rpow")
    __and__, __rand__, __iand__ = _bin(_op.and_, "and"), _rbin(_op.and_, "rand"), _ibin(np.bitwise_and, "iand")
    __or__, __ror__, __ior__ = _bin(_op.or_, "or"), _rbin(_op.or_, "ror"), _ibin(np.bitwise_or, "ior")
    __xor__, __rxor__, __ixor__ = _bin(_op.xor, "xor"), _rbin(_op.xor, "rxor"), _ibin(np.bitwise_xor, "ixor")
    __rshift__, __irshift__ = _bin(_op.rshift, "rshift"), _ibin(np.right_shift, "irshift")
    __lshift__, __ilshift__ = _bin(_op.lshift, "lshift"), _ibin(np.left_shift, "ilshift")
    __lt__, __le__, __gt__, __ge__ = _bin(_op.lt, "lt"), _bin(_op.le, "le"), _bin(_op.gt, "gt"), _bin(_op.ge, "ge")
    __eq__, __ne__ = _bin(_op.eq, "eq"), _bin(_op.ne, "ne")
    __hash__ = None
    del _op, _bin, _rbin, _ibin

    def __neg__(self):
        _launch("neg")
        return _wrap(-_unwrap(self))

    def __abs__(self):
        _launch("abs")
        return _wrap(np.abs(_unwrap(self)))

    def __invert__(self):
        _launch("invert")
        return _wrap(~_unwrap(self))

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


def _key(key):
    """An index into a device array: ints, slices, Ellipsis, None, device arrays (and lists,
    which CuPy copies to the device: a counted copy). Returns ``(the NumPy key, whether it is
    an advanced index)``: an advanced index gathers or scatters (a kernel), a basic one is a view."""
    if isinstance(key, tuple):
        parts = [_key(k) for k in key]
        return tuple(k for k, _ in parts), builtins.any(adv for _, adv in parts)
    if isinstance(key, np.ndarray):
        raise TypeError("a numpy array cannot index a device array: pass a device array")
    if isinstance(key, ndarray):
        if key.dtype == bool:
            _sync("boolean-index")  # the result's size depends on the data
        key._on_current_device()
        return key._a, True
    if isinstance(key, list):
        if _host_sequence(key):
            _copy_in("index")
        return _unwrap(key, "index"), True
    return key, False


def _host_sequence(v):
    """Whether ``v`` is a list or tuple of host data (no device array at its top level)."""
    return isinstance(v, (list, tuple)) and not builtins.any(isinstance(e, ndarray) for e in v)


# ---------------------------------------------------------------------------- module functions
_VIEWS = ("broadcast_to", "empty_like")  # no kernel: a view, an allocation


def _fn(name):
    npf = getattr(np, name)

    def f(*args, **kw):
        if name not in _VIEWS:
            _launch(name)
        return _call(npf, *args, **kw)

    f.__name__ = name
    return f


for _name in ("abs", "negative", "multiply", "add", "subtract", "divide", "true_divide", "sqrt", "square",
              "isfinite", "isnan", "maximum", "minimum", "clip", "not_equal", "equal", "greater",
              "less", "cumsum", "searchsorted", "logical_not", "logical_or", "logical_and", "sum", "concatenate",
              "stack", "sort", "take", "put", "remainder", "bitwise_xor",
              "right_shift", "exp", "log", "power", "dot", "vdot", "einsum", "broadcast_to", "partition",
              "array_equal", "allclose", "full_like", "zeros_like", "ones_like", "empty_like", "any", "all",
              "floor_divide", "repeat"):
    globals()[_name] = _fn(_name)


def _reduceat(ufunc, name):
    def reduceat(a, indices, axis=0, dtype=None, out=None):
        _launch(f"{name}.reduceat")
        return _call(ufunc.reduceat, a, indices, axis=axis, dtype=dtype, out=out)
    return reduceat


add.reduceat = _reduceat(np.add, "add")  # noqa: F821 (made by the loop above)
maximum.reduceat = _reduceat(np.maximum, "maximum")  # noqa: F821


def where(condition, *xy):
    if not xy:
        _sync("where")  # where(c) is nonzero(c): its size depends on the data
    _launch("where")
    return _call(np.where, condition, *xy)


def ascontiguousarray(a, dtype=None):
    r = _call(np.ascontiguousarray, a, dtype=dtype)
    if isinstance(a, ndarray) and not _is_view(r._a, a._a):
        _launch("ascontiguousarray")
    return r


def argsort(a, axis=-1, kind=None):
    if kind not in (None, "stable"):
        raise ValueError("CuPy's argsort is stable only")
    _launch("argsort")
    return _call(np.argsort, a, axis=axis, kind="stable")


def count_nonzero(a, axis=None):
    _launch("count_nonzero")
    return _call(np.count_nonzero, a, axis=axis)  # a 0-d array, no host read (as in CuPy)


def flatnonzero(a):
    _sync("flatnonzero")
    _launch("flatnonzero")
    return _call(np.flatnonzero, a)


def nonzero(a):
    _sync("nonzero")
    _launch("nonzero")
    return _call(np.nonzero, a)


def unique(a, **kw):
    _sync("unique")
    _launch("unique")
    return _call(np.unique, a, **kw)


def bincount(x, weights=None, minlength=0):
    if isinstance(x, ndarray) and x.size == 0:
        raise ValueError("cannot compute bincount of an empty array (CuPy takes its maximum)")
    _launch("bincount")
    return _call(np.bincount, x, weights=weights, minlength=minlength)


def _from_host(a, dtype=None, kind="asarray"):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    r = ndarray(np.array(a, dtype=dtype, copy=True))
    _copy_in(kind)
    return r


def asarray(a, dtype=None, order=None):
    return _from_host(a, dtype)


def array(a, dtype=None, copy=True, order=None):
    return _from_host(a, dtype, "array") if not isinstance(a, ndarray) else (a.copy() if copy else a)


def fuse(*args, **kwargs):
    """``cupy.fuse``, run eagerly: ``@fuse``, ``@fuse()`` and ``fuse(kernel_name=...)(f)`` give a
    function that runs ``f`` and counts one launch, ``fuse(name)`` (CuPy compiles one kernel)."""
    def wrap(f):
        name = kwargs.get("kernel_name") or getattr(f, "__name__", "fused")

        def fused(*a, **kw):
            if not name.isidentifier():  # CuPy names the kernel after it: "<lambda>" fails to compile
                raise ValueError(f'Invalid kernel name: "{name}" (cupy.fuse compiles a kernel of that name at '
                                 'the first call: pass kernel_name=)')
            _fusing[0] += 1
            try:
                r = f(*a, **kw)
            finally:
                _fusing[0] -= 1
            _launch(f"fuse({name})")
            return r
        return fused
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return wrap(args[0])
    return wrap


def asnumpy(a, stream=None):
    if isinstance(a, ndarray):
        _sync("asnumpy")
        return a._a.copy()
    return np.asarray(a)


def empty(shape, dtype=float, order="C"):
    return ndarray(np.empty(shape, dtype))


def zeros(shape, dtype=float, order="C"):
    _launch("zeros")  # a memset on the device
    return ndarray(np.zeros(shape, dtype))


def ones(shape, dtype=float, order="C"):
    _launch("ones")
    return ndarray(np.ones(shape, dtype))


def full(shape, value, dtype=None):
    _launch("full")
    return ndarray(np.full(shape, value, dtype))


def arange(*args, dtype=None):
    _launch("arange")
    return ndarray(np.arange(*args, dtype=dtype))


def from_dlpack(x):
    dt = str(getattr(x, "dtype", ""))
    if "bfloat16" in dt:
        raise BufferError("unsupported DLPack dtype (bfloat16)")  # not a TypeError: as CuPy's import
    return ndarray(np.from_dlpack(x))


class Bfloat16CudaTensor:
    """Stands for a bfloat16 torch tensor on a GPU: DLPack says CUDA, and importing it fails as
    CuPy's import does (a BufferError, not a TypeError)."""

    dtype = "torch.bfloat16"

    def __init__(self, shape):
        self.shape = tuple(shape)

    def __dlpack__(self, stream=None):
        raise BufferError("unsupported DLPack dtype (bfloat16)")

    def __dlpack_device__(self):
        return (2, 0)


def get_array_module(*args):
    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


for _t in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
           "uint64", "bool_", "nan", "inf", "dtype", "finfo", "iinfo", "promote_types", "result_type"):
    globals()[_t] = getattr(np, _t)

lib = types.ModuleType("cupy.lib")
lib.stride_tricks = types.ModuleType("cupy.lib.stride_tricks")


def _as_strided(x, shape=None, strides=None):
    return x._same(np.lib.stride_tricks.as_strided(x._a, shape=shape, strides=strides))


lib.stride_tricks.as_strided = _as_strided


# ---------------------------------------------------------------------------- cuda: devices, streams, events
class Device:
    """A fake device (there are two, 0 and 1); a context manager like ``cupy.cuda.Device``.
    Arrays remember the device that was current when they were made, and every operation on
    an array of another device than the current one raises, as in CuPy."""

    current = 0

    def __init__(self, device=None):
        self.id = Device.current if device is None else int(device)
        self._prev = []

    def __enter__(self):
        self._prev.append(Device.current)
        Device.current = self.id
        cuda_log.append(("device", self.id))
        return self

    def __exit__(self, *exc):
        Device.current = self._prev.pop()

    def use(self):
        Device.current = self.id

    def synchronize(self):
        _sync("device.synchronize")


class Event:
    _ids = iter(range(1, 1 << 62))

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.id = next(Event._ids)

    def record(self, stream=None):
        s = stream if stream is not None else get_current_stream()
        cuda_log.append(("record", self.id, s.ptr))

    def synchronize(self):
        _sync("event.synchronize")


class Stream:
    """A fake stream: ``ptr``, ``synchronize`` (counted), ``wait_event``, ``record``, and ``with``."""

    _ptrs = iter(range(0x1000, 1 << 62, 0x10))
    _stack = []

    def __init__(self, null=False, non_blocking=False, ptr=None):
        self.ptr = 0 if null else (ptr if ptr is not None else next(Stream._ptrs))

    def synchronize(self):
        cuda_log.append(("synchronize", self.ptr))
        _sync("stream.synchronize")

    def wait_event(self, event):
        cuda_log.append(("wait", self.ptr, event.id))

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def use(self):
        Stream._stack[:] = [self]
        return self

    def __enter__(self):
        Stream._stack.append(self)
        return self

    def __exit__(self, *exc):
        Stream._stack.pop()


class ExternalStream(Stream):
    def __init__(self, ptr, device_id=-1):
        super().__init__(ptr=int(ptr))


_NULL = Stream(null=True)


def get_current_stream():
    return Stream._stack[-1] if Stream._stack else _NULL


cuda = types.ModuleType("cupy.cuda")
cuda.Device, cuda.Event, cuda.Stream, cuda.ExternalStream = Device, Event, Stream, ExternalStream
cuda.get_current_stream = get_current_stream
cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 2, getDevice=lambda: Device.current)


# ---------------------------------------------------------------------------- a fake NCCL over MPI
nccl = types.ModuleType("cupy.cuda.nccl")
_NCCL_TYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 4: np.int64, 6: np.float16, 7: np.float32, 8: np.float64}
(nccl.NCCL_INT8, nccl.NCCL_UINT8, nccl.NCCL_INT32, nccl.NCCL_INT64, nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT32,
 nccl.NCCL_FLOAT64) = 0, 1, 2, 4, 6, 7, 8
nccl.NCCL_SUM = 0


def _host(ptr, count, nccl_type):
    dt = np.dtype(_NCCL_TYPES[nccl_type])
    if count == 0:
        return np.zeros(0, dt)
    if ptr % dt.itemsize:
        raise MisalignedAddressError(f"NCCL buffer at {ptr:#x} is not aligned for {dt.name}")
    raw = (ctypes.c_char * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dt)


class NcclCommunicator:
    """Collectives on host pointers over MPI.COMM_WORLD, with NCCL's signatures and its logging
    of which stream each call was enqueued on."""

    def __init__(self, ndev, uid, rank):
        from mpi4py import MPI

        self._comm = MPI.COMM_WORLD.Dup()
        if self._comm.Get_size() != ndev or self._comm.Get_rank() != rank:
            raise RuntimeError("fake NCCL: ranks must match MPI.COMM_WORLD")
        self.aborted = False

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        cuda_log.append(("nccl.allReduce", stream))
        _launch("nccl.allReduce")
        src, dst = _host(sendbuf, count, datatype), _host(recvbuf, count, datatype)
        everyone = self._comm.allgather(src.copy())
        acc = everyone[0].astype(np.float64 if dst.dtype.kind == "f" else dst.dtype)
        for a in everyone[1:]:
            acc = acc + a
        dst[...] = acc.astype(dst.dtype)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        cuda_log.append(("nccl.allGather", stream))
        _launch("nccl.allGather")
        src = _host(sendbuf, count, datatype)
        dst = _host(recvbuf, count * self._comm.Get_size(), datatype)
        dst[...] = np.concatenate(self._comm.allgather(src.copy()))

    def bcast(self, buff, count, datatype, root, stream):
        cuda_log.append(("nccl.bcast", stream))
        _launch("nccl.bcast")
        b = _host(buff, count, datatype)
        b[...] = self._comm.bcast(b.copy(), root=root)

    def abort(self):
        self.aborted = True

    def destroy(self):
        pass


def get_unique_id():
    return tuple(range(128))


nccl.NcclCommunicator, nccl.get_unique_id = NcclCommunicator, get_unique_id
cuda.nccl = nccl


# ---------------------------------------------------------------------------- installing
_NAMES = {"cupy": None, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl, "cupy.lib": lib,
          "cupy.lib.stride_tricks": lib.stride_tricks}


class install:
    """Context manager (or plain call + :meth:`undo`): this module is ``cupy`` until undone."""

    def __init__(self):
        self._saved = {k: sys.modules.get(k) for k in _NAMES}
        me = sys.modules[__name__]
        for k, v in _NAMES.items():
            sys.modules[k] = me if v is None else v

    def undo(self):
        for k, v in self._saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v

    def __enter__(self):
        return sys.modules[__name__]

    def __exit__(self, *exc):
        self.undo()


# ---------------------------------------------------------------------------- torch on the double
class torch_bridge:
    """Context manager: slamb_comm's torch adapters see the double's arrays where they would see
    CuPy's. A CPU torch tensor handed to the core becomes a double array sharing its memory (as
    CuPy's DLPack import of a CUDA tensor does), and a double array handed back to torch (the
    state's views, a collective's buffer) the tensor of that memory. With it, the adapters' GPU
    path runs on the CPU and its device operations are counted: the core's by the double, torch's
    by :func:`aten_counter`. Use inside :class:`install`."""

    def __enter__(self):
        import torch

        import slamb_comm.adapters.torch.collectives as tcoll
        import slamb_comm.adapters.torch.slamb as tslamb
        import slamb_comm.adapters.torch.tensors as ttensors
        import slamb_comm.arrays as arrays

        real = arrays.as_array

        def as_array(x):
            if isinstance(x, torch.Tensor):
                return ndarray(x.detach().numpy())
            return real(x)

        def to_torch(a):
            return torch.from_numpy(a._a if isinstance(a, ndarray) else a)

        self._saved = [(arrays, "as_array", real), (tslamb, "tensor_of", tslamb.tensor_of),
                       (ttensors, "tensor_of", ttensors.tensor_of), (tcoll, "torch_view", tcoll.torch_view)]
        for mod, name, new in ((arrays, "as_array", as_array), (tslamb, "tensor_of", to_torch),
                               (ttensors, "tensor_of", to_torch), (tcoll, "torch_view", to_torch)):
            setattr(mod, name, new)
        return self

    def __exit__(self, *exc):
        for mod, name, old in self._saved:
            setattr(mod, name, old)


def aten_counter():
    """A ``TorchDispatchMode`` (use as a context manager) counting torch's operations: ``.n``
    in all and ``.by_op`` by name. On a GPU each is at most one kernel launch; views and
    ``detach`` (no launch) are not counted, a multi-tensor ``_foreach_*`` call counts one (torch
    launches one kernel per chunk of tensors, like apex's ``multi_tensor_apply``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    free = ("detach", "view", "alias", "_reshape_alias", "slice", "as_strided", "unsqueeze", "squeeze", "t.default")

    class AtenCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0
            self.by_op = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.__name__.startswith(free):
                self.n += 1
                self.by_op[func.__name__] += 1
            return func(*args, **(kwargs or {}))

    return AtenCount()
