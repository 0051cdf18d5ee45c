"""A strict stand-in for CuPy, so that every CuPy branch of slamb_comm runs on the CPU.

``install()`` puts this module in ``sys.modules`` as ``cupy`` (with ``cupy.cuda``,
``cupy.cuda.nccl`` and ``cupy.lib.stride_tricks``); slamb_comm then treats its arrays as
device arrays and takes its GPU code paths. Its arrays hold host memory (a NumPy array
inside) but behave like CuPy's where a mistake would hide on the CPU:

* **No implicit conversion to NumPy**: ``np.asarray(a)`` / ``a.__array__()`` raise
  ``TypeError`` (as CuPy does); a NumPy array where a device array is expected (an operand,
  an ``out=``, an index, a value assigned into a device array, a kernel argument) raises
  ``TypeError``; NumPy ufuncs and functions refuse them (``__array_ufunc__ = None``); a list
  assigned to a slice (``a[:3] = [1, 2, 3]``) raises ``ValueError`` (CuPy takes it for
  ``fill``).
* **Alignment**: ``a.view(dtype)`` raises :class:`MisalignedAddressError` unless the
  address is a multiple of the new item size (a GPU faults with
  ``cudaErrorMisalignedAddress`` on such a read and loses its context).
* **Devices**: two fake devices; arrays remember where they were made, and an operation on an
  array of another device than the current one raises (CuPy allocates on, and launches on,
  the *current* device).
* **Raw CUDA kernels run** (:class:`RawModule`, :func:`RawKernel`; the machinery is
  ``tests/support/host_kernels.py``): the source must be written in the dialect of
  ``slamb_comm.device.kernels.PRELUDE``, which the host's C++ compiler also takes; the double
  compiles it with ``g++`` (cached on disk) and runs the real grid, block after block, a
  block's threads one after another in each ``SLAMB_FOR_THREADS`` phase. So CI executes the
  kernels' arithmetic. Every argument must be what CuPy would pass for the C parameter (an
  array of the pointee's dtype on the current device, a NumPy scalar of exactly the scalar's
  type), else ``TypeError`` naming the kernel, the parameter and both types (a GPU would read
  garbage); an array behind a ``const`` pointer that changes raises ``RuntimeError``; a module
  built without ``--fmad=false`` is refused (the host does not contract ``a * b + c``, the
  device would). A launch counts one ``kernel(<name>)``; ``launch_declared(grid, block, args,
  reads, writes)`` also charges the bytes the library declares it moves (``[(label, nbytes)]``).

**What is counted.** Four counters, by name: host synchronisations (:data:`syncs`), device
operations (:data:`launches`), host-to-device copies (:data:`h2d`), and device-memory bytes
read and written (:data:`bytes_read`, :data:`bytes_written`); plus the live device memory.
:func:`reset_counts` resets the counters, :func:`counts` gives their totals, and
:class:`counting` measures a block: ``with counting() as c: ...``, then ``c.launches``,
``c.h2d``, ``c.syncs``, ``c.read``, ``c.written``, ``c.bytes`` (totals), ``c.by_op``,
``c.by_h2d``, ``c.by_sync``, ``c.by_op_bytes`` (Counters by name: read + written), ``c.peak``
(the most device memory live during the block beyond what was live at its start) and
``c.kept`` (live at its end minus live at its start).

* **Host synchronisations** (:data:`syncs`, :func:`reset_syncs`, :func:`total_syncs`):
  ``.get()``, ``asnumpy``, ``bool()``, ``float()``, ``int()``, ``.item()``, ``.tolist()``,
  stream, event and device ``synchronize()``, and the operations whose result size depends on
  the data (``flatnonzero``, ``nonzero``, ``unique``, ``where`` with one argument,
  boolean-mask indexing, and ``bincount``'s two). A read's bytes are charged as device bytes
  read, under ``d2h(<kind>)``.
* **Host-to-device copies** (:data:`h2d`, :func:`reset_h2d`, :func:`total_h2d`): one per
  creation of a device array of one or more dimensions from host data, whatever its size:
  ``asarray``/``array`` of a NumPy array, list or tuple (``asarray``, ``array``),
  ``ndarray.set`` (``set``), a list or tuple scattered into a device array (``setitem``) or
  used as an index (``index``; CuPy copies it first). Their bytes are charged as device bytes
  written, under ``h2d(<kind>)``. A 0-d array made from a host scalar (``asarray(3.0)``) is no
  copy: CuPy allocates it and *fills* it (a launch, ``asarray(scalar)``); nor are scalars given
  as operands (kernel arguments). ``asarray`` of a device array is no copy (and, with another
  dtype, an ``astype``). A NumPy array anywhere else raises, so there is no other way in.
* **Device operations** (:data:`launches`, :func:`reset_launches`, :func:`total_launches`):
  the kernel launches (and device memsets/memcpys) that CuPy 14.2 makes for each call, read
  from its source, whatever the sizes, 0-d and empty arrays included (an empty one launches
  nothing in CuPy: the count is per call), all under the operation's name. Most calls are one:
  every operator (``a + b``, ``a += 1``, ``-a``, ``a < b``: ``add``/``radd``/``iadd``, ...),
  ufunc (``sqrt``, ``multiply(..., out=)``, ``clip``, ``isfinite``), reduction (``sum``,
  ``max``, ``dot``, ``all``, ``count_nonzero``), ``take``/``put``/``repeat`` (a scalar count),
  ``copy``, ``fill``, ``astype`` (unless it returns the array itself), ``zeros``/``ones``/
  ``full``/``arange``/``*_like`` (they write memory), ``ascontiguousarray``/``reshape``/
  ``ravel`` when they copy, ``a[idx]`` (``getitem(gather)``), ``a[2:5] = b``
  (``setitem(copy)``), ``a[2:5] = 0`` (``setitem(fill)``), a ``cupy.fuse``d function
  (``fuse(<name>)``: :func:`fuse` runs it eagerly and charges one kernel; a host read or
  copy inside it raises, as CuPy's fusion cannot do either), a raw kernel, each collective of
  the fake NCCL. Several: see the table below. Not counted (no launch on a GPU):
  ``empty``/``empty_like``, views (basic indexing: ``a[2:5]``, ``a[3]`` (a 0-d view, as in
  CuPy), ``.view(dtype)``, ``.T``, a contiguous ``reshape``/``ravel``, ``broadcast_to``,
  ``as_strided``, ``from_dlpack``), attribute reads, stream and event calls, host-to-device
  copies. CuPy's reductions through CUB run a second, tiny pass above a few thousand elements:
  counted as one.
* **Device bytes** (:data:`bytes_read`, :data:`bytes_written`, :func:`total_bytes`,
  :func:`reset_bytes`), charged per operation at what its kernels move in device memory on a
  GPU: an operand is read in full (its distinct elements: a broadcast operand once), a result
  written in full; scalars are kernel arguments (no bytes). Reductions read their input and
  write the tiny result; ``zeros``/``fill``/``arange``/... only write; ``take``/``getitem
  (gather)`` read the indices and the gathered elements and write the result; a scatter reads
  the indices and values and writes the elements it sets; a fused function reads its array
  arguments and writes what it returns and what it assigns in place; a collective reads its
  send buffer and writes its receive buffer. The calls of several kernels (CuPy 14.2's code):

  ====================  ================================================================
  operation             kernels (all under the operation's name)
  ====================  ================================================================
  concatenate, stack    one copy per non-empty array (CuPy's ``_concatenate``), or one
                        kernel for more than 8 arrays of the result's dtype averaging
                        under 2 MiB
  where(c, x, y)        a cast of ``c`` to bool first unless it is bool; then one kernel
  searchsorted          ``zeros`` for the result, then the search: the queries read, and
                        floor(log2 n) + 1 elements of the sorted array per query
  cumsum (axis=None)    a cast/copy into the result, then CUB's scan: 2 kernels (init and
                        the decoupled look-back scan), reading and writing the result once
  sort, argsort         a copy of the input (``argsort``: and an index sequence), then
                        CUB's Onesweep radix sort (through Thrust): a histogram pass over
                        the keys, a scan of the bins, and one pass per key byte (8-bit
                        digits: 4 for float32/int32, 8 for float64/int64), each reading and
                        writing keys (and int64 values); its double buffer is a transient
  partition             a copy, then CuPy's rule: a full sort (``length < 32``, a
                        ``kth`` from 512 on, or few subarrays) or its selection kernels
  getitem(mask),        ``a[mask]``, ``a[mask] = v``: CuPy's blocked scan of the mask into
  setitem(mask)         int32 ranks (1 kernel up to 512 elements, else block sums, their
                        scan, and the scan), the read of the count (a sync), then the
                        gather/scatter over the array (the scatter's value as for a scatter)
  nonzero, flatnonzero  ``not_equal(a, 0)`` unless ``a`` is bool, the blocked scan
  where(c)              (incomplete above 512 elements), the count read, the index kernel
  unique                a flattening copy, the radix sort, the first mask element, a
                        ``!=`` of neighbours and its copy into the mask, the NaN mask
                        (fused), then the boolean-mask gather
  array_equal/allclose  an elementwise comparison into booleans, then ``all``
  bincount              ``(x < 0).any()`` (2 kernels and a sync), ``max`` (a kernel and a
                        sync), ``zeros`` for the bins, the histogram
  setitem(scatter)      with a scalar value: its 0-d device array (a fill) first; with an
                        array of another dtype: its cast first
  add.reduceat          CuPy's ``_add_reduceat`` (``axis=0``): ``append`` of the end to
                        the indices (a 0-d fill and two copies), the cumulative sum along
                        the axis (a cast to ``dtype`` and the blocked scan: a scan kernel,
                        and above 512 elements the scan of the block sums and an add
                        kernel), ``append`` of a zero in front (a memset and two full-length
                        copies), the ``>=`` of neighbouring indices, three gathers, a
                        subtraction and a ``where``: 14 kernels up to 512 elements. Its two
                        buffers of the input's length in ``dtype`` (the scan's and the
                        appended one) are charged as a transient
  ====================  ================================================================

  ``maximum.reduceat`` raises ``NotImplementedError``, as CuPy 14's does (only ``add`` has
  ``reduceat``); ``bincount`` raises ``ValueError`` on an empty input (CuPy before 14 took
  the maximum of an empty array; 14 returns zeros: code that runs on both avoids it);
  ``unique`` supports no ``return_*`` (their extra kernels are not charged).
* **Device memory** (:func:`memory`, :func:`peak`, :func:`reset_peak`): every array that owns
  its memory (made by ``zeros``, ``empty``, ``asarray`` of host data, any operation's result)
  adds its ``nbytes`` to the live total until its NumPy buffer dies (a ``weakref.finalize``:
  CPython frees an array at its last reference, cycles wait for the garbage collector). Views
  and ``from_dlpack`` imports of foreign memory (torch tensors) are not the double's memory.
  The buffers CuPy allocates inside a call and frees before it returns (a sort's double
  buffer, a scan's, ``add.reduceat``'s) count as a momentary peak. Bytes as requested: CuPy's
  pool rounds each block up to 512 bytes and keeps freed blocks cached.
* Reductions return 0-d arrays (as CuPy's do), so ``float(a.sum())`` is a counted read.
* ``cupy.cuda.nccl`` is a fake NCCL whose collectives run over ``MPI.COMM_WORLD`` on the
  arrays' host memory, so :class:`slamb_comm.NCCLTransport` runs at 1, 2 and 4 ranks; every
  stream, event and raw-kernel operation is logged in :data:`cuda_log` (a launch as
  ``("kernel", name, stream ptr)``; stream orderings can be asserted, not observed).

What it cannot catch: real concurrency and stream races (everything here runs in order on the
host, a raw kernel's blocks and threads too: a race between blocks or a missing ``SLAMB_SYNC``
does not show, nor a block larger than the kernel's launch bounds); device numerics (CUDA's own
sqrt and division are IEEE like the host's, but reduction orders in CUB and cuBLAS differ);
whether CuPy can fuse a function at all (only elementwise ufuncs, ``where`` and scalars); peer
access and real transfers between devices; CUDA-aware MPI on real device pointers;
out-of-memory on a 141 GB device; performance (bytes and launches are counted, not timed; the
radix sort is a model: CUB sorts an input of one tile, a few thousand keys, in a single kernel,
charged here as the full passes). Those need the real GPU run (``tests/test_gpu.py``; set
``SLAMB_COMM_REAL_CUPY=1`` to run the strict-double tests against real CuPy there); NVRTC's
compilation of the kernels is checked without a device by ``tests/test_kernels_nvrtc.py``.
"""

import builtins
import ctypes
import sys
import types
import weakref
from collections import Counter

import numpy as np

from . import host_kernels

__all__ = ["install", "ndarray", "syncs", "reset_syncs", "total_syncs", "launches", "reset_launches",
           "total_launches", "h2d", "reset_h2d", "total_h2d", "bytes_read", "bytes_written", "total_bytes",
           "reset_bytes", "reset_counts", "counts", "counting", "memory", "peak", "reset_peak", "RawModule",
           "RawKernel", "MisalignedAddressError", "torch_bridge", "aten_counter"]

syncs = Counter()  # kind -> count of host synchronisations
launches = Counter()  # operation name -> count of device operations (kernel launches, memsets, memcpys)
h2d = Counter()  # kind -> count of host-to-device copies
bytes_read = Counter()  # operation name -> device-memory bytes read
bytes_written = Counter()  # operation name -> device-memory bytes written
cuda_log = []  # (operation, stream ptr / event id, ...) in program order
_mem = {"live": 0, "peak": 0}  # device bytes live now, and the most since the last reset_peak


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


def reset_bytes():
    bytes_read.clear()
    bytes_written.clear()


def total_bytes():
    """Device-memory bytes read and written, all operations."""
    return builtins.sum(bytes_read.values()) + builtins.sum(bytes_written.values())


def reset_counts():
    """Reset the counters: host synchronisations, device operations, host-to-device copies, bytes."""
    reset_syncs()
    reset_launches()
    reset_h2d()
    reset_bytes()


def counts():
    """The totals now: ``{"launches", "h2d", "syncs", "read", "written"}`` (bytes for the last two)."""
    return {"launches": total_launches(), "h2d": total_h2d(), "syncs": total_syncs(),
            "read": builtins.sum(bytes_read.values()), "written": builtins.sum(bytes_written.values())}


def memory():
    """Device bytes live now (arrays of the double that own their memory)."""
    return _mem["live"]


def peak():
    """The most device bytes live since the last :func:`reset_peak` (transients of calls included)."""
    return _mem["peak"]


def reset_peak():
    _mem["peak"] = _mem["live"]


class counting:
    """``with counting() as c:`` resets the counters, and on leaving keeps what the block did:
    ``c.launches``, ``c.h2d``, ``c.syncs``, ``c.read``, ``c.written``, ``c.bytes`` (totals),
    ``c.by_op``, ``c.by_h2d``, ``c.by_sync``, ``c.by_op_bytes`` (Counters by name), ``c.peak``
    and ``c.kept`` (device memory: the most live during the block, and live at its end, each
    beyond what was live at its start). The module's counters keep counting afterwards."""

    def __enter__(self):
        reset_counts()
        self._start, self._outer_peak = _mem["live"], _mem["peak"]
        _mem["peak"] = _mem["live"]
        return self

    def __exit__(self, *exc):
        self.by_op, self.by_h2d, self.by_sync = Counter(launches), Counter(h2d), Counter(syncs)
        self.by_op_bytes = bytes_read + bytes_written
        self.launches = builtins.sum(self.by_op.values())
        self.h2d = builtins.sum(self.by_h2d.values())
        self.syncs = builtins.sum(self.by_sync.values())
        self.read, self.written = builtins.sum(bytes_read.values()), builtins.sum(bytes_written.values())
        self.bytes = self.read + self.written
        self.peak, self.kept = _mem["peak"] - self._start, _mem["live"] - self._start
        _mem["peak"] = max(_mem["peak"], self._outer_peak)

    def __repr__(self):
        return (f"counting(launches={self.launches}, h2d={self.h2d}, syncs={self.syncs}, read={self.read}, "
                f"written={self.written}, peak={self.peak}, kept={self.kept})")


class MisalignedAddressError(RuntimeError):
    """What a GPU's typed read at a misaligned address would raise (cudaErrorMisalignedAddress)."""


# ---------------------------------------------------------------------------- charging
_fusing = [0]  # depth of fused calls under way: their operations are one kernel, charged at the end
_fused_writes = []  # per fused call under way: the bytes its operations wrote in place


def _sync(kind, nbytes=0):
    if _fusing[0]:
        raise RuntimeError(f"host read ({kind}) inside a cupy.fuse'd function: CuPy cannot fuse it")
    syncs[kind] += 1
    if nbytes:
        bytes_read[f"d2h({kind})"] += nbytes


def _launch(name, read=0, written=0, n=1, inplace=False):
    """Charge ``n`` launches of operation ``name`` moving ``read``/``written`` device bytes. Inside
    a fused function nothing is charged (the fused kernel is), save an in-place write's bytes."""
    if _fusing[0]:
        if inplace:
            _fused_writes[-1] += written
        return
    launches[name] += n
    if read:
        bytes_read[name] += read
    if written:
        bytes_written[name] += written


def _copy_in(kind, nbytes):
    if _fusing[0]:
        raise RuntimeError(f"host-to-device copy ({kind}) inside a cupy.fuse'd function: CuPy cannot fuse it")
    h2d[kind] += 1
    if nbytes:
        bytes_written[f"h2d({kind})"] += nbytes


def _transient(nbytes):
    """A buffer of ``nbytes`` that a call allocates and frees before returning: a momentary peak."""
    _mem["peak"] = max(_mem["peak"], _mem["live"] + nbytes)


_OWNED = set()  # ids of the NumPy buffers counted as live device memory


def _own(a):
    """Count ``a``'s memory as live device memory if it is a buffer of its own not yet counted
    (not a view of one, not foreign memory such as a torch tensor's), until the buffer dies."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.base is not None or not root.flags.owndata or root.nbytes == 0 or id(root) in _OWNED:
        return
    _OWNED.add(id(root))
    _mem["live"] += root.nbytes
    _mem["peak"] = max(_mem["peak"], _mem["live"])
    weakref.finalize(root, _forget, id(root), root.nbytes).atexit = False


def _forget(key, nbytes):
    _OWNED.discard(key)
    _mem["live"] -= nbytes


class _Cost:
    """What one CuPy call costs: ``n`` launches, device bytes ``read`` and ``written``, and
    ``temp``: the most bytes it holds at once beyond what was live before it (its result
    included when they coexist)."""

    __slots__ = ("n", "read", "written", "temp")

    def __init__(self, n=1, read=0, written=0, temp=0):
        self.n, self.read, self.written, self.temp = n, read, written, temp

    def __add__(self, o):
        return _Cost(self.n + o.n, self.read + o.read, self.written + o.written, max(self.temp, o.temp))


def _charge(name, cost, inplace=False):
    _transient(cost.temp)
    _launch(name, cost.read, cost.written, cost.n, inplace)


def _fp(x):
    """Device bytes an operand occupies: its distinct elements (a broadcast dimension once);
    0 for scalars and host data; the sum for a list or tuple."""
    if isinstance(x, ndarray):
        a = x._a
        return a.itemsize * int(np.prod([d for d, s in zip(a.shape, a.strides) if s != 0])) if a.size else 0
    if isinstance(x, (list, tuple)):
        return builtins.sum(_fp(v) for v in x)
    if isinstance(x, dict):
        return builtins.sum(_fp(v) for k, v in x.items() if k != "out")
    return 0


def _nb(r):
    """Bytes of a result (a NumPy or device array, or a tuple of them)."""
    if isinstance(r, (np.ndarray, np.generic, ndarray)):
        return r.nbytes
    if isinstance(r, tuple):
        return builtins.sum(_nb(v) for v in r)
    return 0


# ---------------------------------------------------------------------------- CuPy 14.2's multi-kernel calls
_CHUNK = 512  # CuPy's scan chunk and batch-scan block


def _scan_cost(n, src, dst, incomplete=False, in_place=False):
    """CuPy's blocked scan (``_routines_math.scan``) of ``n`` elements of ``src`` bytes into
    ``dst``-byte sums: one kernel up to a chunk, else the chunks' sums, their scan (recursively,
    in place) and, unless ``incomplete`` (``nonzero`` stops at the block sums), the scan itself."""
    b = -(-n // _CHUNK)
    own = b * dst + (0 if incomplete or in_place else n * dst)
    if n <= _CHUNK:
        return _Cost(1, n * src, n * dst, own)
    inner = _scan_cost(b, dst, dst, in_place=True)
    c = _Cost(1, n * src, b * dst) + inner
    if not incomplete:
        c = c + _Cost(1, b * dst + n * src, n * dst)
    c.temp = own + inner.temp
    return c


def _batch_scan_cost(rows, n, isz):
    """CuPy's in-place scan of ``rows`` rows of ``n`` (``_batch_scan_op``): the blocks' scans,
    and above a block the scan of the blocks' last elements and the add of them to the rest."""
    c = _Cost(1, rows * n * isz, rows * n * isz)
    if n > _CHUNK:
        m = n // _CHUNK
        touched = n - _CHUNK - (m - 1)  # past the first block, not the blocks' last elements
        sums = -(-n // _CHUNK) - 1  # the block sums it adds
        c = c + _batch_scan_cost(rows, m, isz) + _Cost(1, rows * (touched + sums) * isz, rows * touched * isz)
    return c


def _radix_cost(n, key, val=0):
    """CUB's Onesweep radix sort of ``n`` keys of ``key`` bytes (with values of ``val``), as Thrust
    runs it for CuPy's sort: a histogram pass over the keys, a scan of the bins, and one pass per
    key byte (8-bit digits) reading and writing keys and values; its double buffer is transient.
    (An even pass count leaves the result in place: no copy back.)"""
    if n <= 1:
        return _Cost(0)
    item = key + val
    return _Cost(2 + key, n * key + key * n * item, key * n * item, n * item)


def _concat_launches(arrays, dtype):
    """CuPy's ``_concatenate``: one kernel for more than 8 arrays of the result's dtype averaging
    under 2 MiB, else one copy per non-empty array."""
    if len(arrays) > 8 and builtins.all(a.dtype == dtype for a in arrays) and \
            builtins.sum(a.nbytes for a in arrays) < 2 * 1024 * 1024 * len(arrays):
        return 1
    return max(1, builtins.sum(1 for a in arrays if a.size))


def _mask_cost(n, isz, m, count, src=None):
    """``a[mask]`` (``src`` None) or ``a[mask] = v`` (``src``: the bytes of ``v``) for ``a`` of
    ``n`` elements of ``isz`` bytes and a mask of ``m``: the mask's scan into int32 ranks, then
    one kernel over the array (reading the mask and its ranks)."""
    scan = _scan_cost(m, 1, 4)
    moved = count * isz
    if src is not None:
        return scan + _Cost(1, src + m * 5, moved)
    return scan + _Cost(1, n * isz + m * 5, moved, scan.temp + moved)


def _nonzero_cost(a, count):
    """``argwhere``: ``a != 0`` unless bool, the scan (incomplete above a chunk), the index kernel."""
    n, out = a.size, count * a.ndim * 8
    cast = _Cost(1, _fp(a), n) if a.dtype != bool else _Cost(0)
    scan = _scan_cost(n, 1, 4, incomplete=n > _CHUNK)
    ranks = -(-n // _CHUNK) * 4 if n > _CHUNK else n * 4
    c = cast + scan + _Cost(1, n + ranks, out)
    c.temp = (n if a.dtype != bool else 0) + scan.temp + out
    return c


def _partition_cost(a, kth):
    """CuPy's ``partition``: a copy, then a full sort or its selection kernels (``_ndarray_partition``)."""
    n, isz = a.size, a.itemsize
    copy = _Cost(1, _fp(a), n * isz)
    length = a.shape[-1] if a.ndim else 1
    ks = [k + length if k < 0 else k for k in np.atleast_1d(kth).tolist()]
    max_k = max(32, 1 << int(max(ks)).bit_length())
    sz = 512
    while sz > 0 and length // sz < max_k + 32 * 4:
        sz //= 2
    sz *= n // max(length, 1)
    if length < 32 or sz <= 32 or max_k >= 1024:
        sort = _radix_cost(n, isz, 8 if a.ndim > 1 else 0)
        c = copy + sort
        c.temp = n * isz + sort.temp
        return c
    c = copy + _Cost(1, n * isz, min(n, sz * max_k) * isz)
    s = 1
    while s < sz // (n // length):
        c = c + _Cost(1, (sz // s) * max_k * isz, (sz // s // 2) * max_k * isz)
        s *= 2
    return c


def _unique_cost(a, count):
    """CuPy's plain ``unique``: a flattening copy, an in-place sort, the mask of first elements
    (its first element, a ``!=`` of neighbours copied in, the fused NaN rule), the mask's gather."""
    n, isz = a.size, a.itemsize
    sort = _radix_cost(n, isz)
    m = max(n - 1, 0)
    gather = _mask_cost(n, isz, n, count)
    c = (_Cost(1, _fp(a), n * isz) + sort + _Cost(1, 0, min(n, 1)) + _Cost(1, 2 * m * isz, m)
         + _Cost(1, m, m) + _Cost(1, m + m * isz, m) + gather)
    c.temp = n * isz + max(sort.temp, n + m, n + gather.temp)
    return c


def _reduceat_cost(a, indices, dtype, rdtype):
    """CuPy's ``_add_reduceat`` over ``a`` (1-D, ``axis=0``) at ``indices``, summing in ``dtype``
    into ``rdtype``: see the module docstring. Transient: the scan's buffer and the appended one,
    both ``a.size`` long in ``dtype``."""
    n, k, isz, osz, rsz = a.size, indices.size, a.itemsize, dtype.itemsize, rdtype.itemsize
    c = _Cost(1, 0, 8) + _Cost(2, _fp(indices) + 8, 8 * (k + 1))  # append(indices, n): a 0-d fill, 2 copies
    c = c + _Cost(1, _fp(a), n * osz) + _batch_scan_cost(1, n, osz)  # cumsum along the axis
    c = c + _Cost(1, 0, osz) + _Cost(2, osz + n * osz, (n + 1) * osz)  # append(zeros(1), acc)
    c = c + _Cost(1, 16 * k, k) + _Cost(1, 8 * k + k * isz, k * isz)  # the mask, a.take(starts)
    c = c + _Cost(2, 2 * (8 * k + k * osz), 2 * k * osz) + _Cost(1, 2 * k * osz, k * osz)  # the sums
    c = c + _Cost(1, k + k * isz + k * osz, k * rsz)  # where(mask, a.take(starts), sums)
    idx, acc = 8 * (k + 1), (n + 1) * osz
    live = idx + acc + k + k * isz  # the appended indices and sums, the mask, a.take(starts)
    c.temp = max(idx + n * osz + acc, live + 3 * k * osz, live + k * osz + k * rsz)
    return c


# ---------------------------------------------------------------------------- arrays
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
    if isinstance(r, ndarray):  # an out= array
        return r
    if isinstance(r, np.ndarray):
        return ndarray(r)
    if isinstance(r, np.generic):
        return ndarray(np.asarray(r))
    if isinstance(r, tuple):
        return tuple(_wrap(v) for v in r)
    return r


def _raw_call(fn, args, kw):
    """NumPy's ``fn`` on the arrays inside device arrays: its result, or the ``out=`` device array."""
    out = kw.get("out")
    if out is not None and not isinstance(out, ndarray):
        raise TypeError(f"out= must be a device array, got {type(out)}")
    r = fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kw.items()})
    return out if out is not None else r


def _elementwise(args, kw, r):
    """One kernel reading its array operands in full and writing its result(s) in full."""
    return _Cost(1, _fp(args) + _fp(kw), _nb(r))


def _run(name, fn, args, kw=None, cost=_elementwise):
    """Run ``fn`` as the device operation ``name``: compute, charge ``cost(args, kw, result)``, wrap."""
    kw = kw or {}
    r = _raw_call(fn, args, kw)
    _charge(name, cost(args, kw, r), inplace=kw.get("out") is not None)
    return _wrap(r)


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
        if not _fusing[0]:  # a fused function's intermediate values live in registers
            _own(a)

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
        _sync("bool", self._a.itemsize)
        return bool(self._a)

    def __float__(self):
        _sync("float", self._a.itemsize)
        return float(self._a)

    def __int__(self):
        _sync("int", self._a.itemsize)
        return int(self._a)

    def __index__(self):
        _sync("index", self._a.itemsize)
        return int(self._a)

    def item(self):
        _sync("item", self._a.itemsize)
        return self._a.item()

    def tolist(self):
        _sync("tolist", self._a.nbytes)
        return self._a.tolist()

    def get(self, stream=None, order="C", out=None, blocking=True):
        if not blocking:  # an asynchronous copy into pinned host memory: a device operation, no wait
            if not isinstance(out, np.ndarray) or not _is_pinned(out) or out.shape != self._a.shape or \
                    out.dtype != self._a.dtype:
                raise ValueError("get(blocking=False) needs out=, a pinned host array of the array's shape and dtype "
                                 "(cupy.cuda.alloc_pinned_memory): from pageable memory CuPy's copy would not be "
                                 "asynchronous")
            out[...] = self._a
            launches["memcpy(d2h)"] += 1
            bytes_read["memcpy(d2h)"] += self._a.nbytes
            cuda_log.append(("memcpy(d2h)", get_current_stream().ptr))
            return out
        _sync("get", self._a.nbytes)  # (CuPy copies from the array's own device, whatever is current)
        if out is not None:
            out[...] = self._a
            return out
        return self._a.copy()

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("set() takes a numpy array")
        self._a[...] = arr.reshape(self._a.shape)
        _copy_in("set", self._a.nbytes)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (self[i] for i in range(len(self)))  # 0-d views, as in CuPy

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
            _launch("reshape(copy)", _fp(self), r.nbytes)
        return self._same(r)

    def ravel(self):
        self._on_current_device()
        r = self._a.ravel()
        if not _is_view(r, self._a):
            _launch("ravel(copy)", _fp(self), r.nbytes)
        return self._same(r)

    def copy(self, order="C"):
        self._on_current_device()
        _launch("copy", _fp(self), self._a.nbytes)
        return self._same(self._a.copy(order))

    def astype(self, dtype, copy=True, **kw):
        if not copy and np.dtype(dtype) == self._a.dtype:
            return self
        self._on_current_device()
        r = self._a.astype(dtype)
        _launch("astype", _fp(self), r.nbytes)
        return self._same(r)

    def fill(self, v):
        self._on_current_device()
        _launch("fill", 0, self._a.nbytes, inplace=True)
        self._a.fill(v)

    def take(self, indices, axis=None, out=None):
        return _run("take", np.take, (self, indices), {"axis": axis, "out": out}, _take_cost)

    def __getitem__(self, key):
        key, advanced = _key(key)
        if not advanced:  # ints, slices, ..., None: a view, no kernel
            r = self._a[key]
            if not isinstance(r, np.ndarray):  # one element: CuPy gives a 0-d view
                r = self._a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
            return self._same(r)
        self._on_current_device()
        r = self._a[key]
        mask = _single_mask(key)
        if mask is not None:
            _charge("getitem(mask)", _mask_cost(self.size, self.itemsize, mask.size, r.size))
        else:
            _charge("getitem(gather)", _gather_cost(key, r))
        return _wrap(r)

    def __setitem__(self, key, value):
        key, advanced = _key(key)
        self._on_current_device()
        host_seq = _host_sequence(value)
        if host_seq and not advanced:
            raise ValueError("non-scalar value assigned to a slice: CuPy takes it for fill() and refuses it; "
                             "copy it to the device first (cupy.asarray)")
        v = _unwrap(value, "value")
        if advanced:
            self._scatter(key, value, host_seq)
        else:
            kind = "copy" if isinstance(value, ndarray) else "fill"
            _launch(f"setitem({kind})", _fp(value), self._a[key].nbytes, inplace=True)
        self._a[key] = v

    def _scatter(self, key, value, host_seq):
        """``a[idx] = v`` or ``a[mask] = v``: CuPy makes ``v`` a device array of ``a``'s dtype
        first (a host list: a copy; a scalar: a 0-d fill; another dtype: a cast), then one kernel."""
        isz, count = self.itemsize, self._a[key].size
        if isinstance(value, ndarray):
            cast = value.dtype != self.dtype
            pre = _Cost(1, _fp(value), value.size * isz) if cast else _Cost(0)
            src = value.size * isz if cast else _fp(value)
        elif host_seq:
            src = np.asarray(value, self.dtype).nbytes
            _copy_in("setitem", src)
            pre = _Cost(0)
        else:
            pre, src = _Cost(1, 0, isz), isz
        mask = _single_mask(key)
        if mask is not None:
            _charge("setitem(mask)", pre + _mask_cost(self.size, isz, mask.size, count, src), inplace=True)
        else:
            _charge("setitem(scatter)", pre + _Cost(1, _index_bytes(key) + src, count * isz), inplace=True)

    # ---------------------------------------------------------------- reductions (0-d results)
    def sum(self, axis=None, dtype=None, out=None):
        return _run("sum", np.sum, (self,), {"axis": axis, "dtype": dtype, "out": out})

    def max(self, axis=None, out=None, keepdims=False):
        return _run("max", np.max, (self,), {"axis": axis, "out": out, "keepdims": keepdims})

    def min(self, axis=None, out=None, keepdims=False):
        return _run("min", np.min, (self,), {"axis": axis, "out": out, "keepdims": keepdims})

    def all(self, axis=None):
        return _run("all", np.all, (self,), {"axis": axis})

    def any(self, axis=None):
        return _run("any", np.any, (self,), {"axis": axis})

    # ---------------------------------------------------------------- operators (one launch each)
    def _bin(op, name):
        def f(self, other):
            if isinstance(other, np.ndarray):
                raise TypeError(f"Unsupported type {type(other)}: mixing device and host arrays")
            r = op(_unwrap(self), _unwrap(other))
            _launch(name, _fp(self) + _fp(other), _nb(r))
            return _wrap(r)
        return f

    def _rbin(op, name):
        def f(self, other):
            if isinstance(other, np.ndarray):
                raise TypeError(f"Unsupported type {type(other)}: mixing device and host arrays")
            r = op(_unwrap(other), _unwrap(self))
            _launch(name, _fp(self) + _fp(other), _nb(r))
            return _wrap(r)
        return f

    def _ibin(op, name):
        def f(self, other):
            if isinstance(other, np.ndarray):
                raise TypeError(f"Unsupported type {type(other)}: mixing device and host arrays")
            op(_unwrap(self), _unwrap(other), out=self._a, casting="same_kind")
            _launch(name, _fp(self) + _fp(other), self._a.nbytes, inplace=True)
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

    def _unary(self, op, name):
        r = op(_unwrap(self))
        _launch(name, _fp(self), r.nbytes)
        return _wrap(r)

    def __neg__(self):
        return self._unary(np.negative, "neg")

    def __abs__(self):
        return self._unary(np.abs, "abs")

    def __invert__(self):
        return self._unary(np.invert, "invert")

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
            _sync("boolean-index", 4)  # the result's size depends on the data: CuPy reads the count
        key._on_current_device()
        return key._a, True
    if isinstance(key, list):
        k = _unwrap(key, "index")
        if _host_sequence(key):
            _copy_in("index", np.asarray(k, np.int64).nbytes)
        return k, True
    return key, False


def _index_arrays(key):
    return [k for k in (key if isinstance(key, tuple) else (key,)) if isinstance(k, (np.ndarray, list))]


def _index_bytes(key):
    return builtins.sum(np.asarray(k).nbytes for k in _index_arrays(key))


def _single_mask(key):
    """The boolean mask if ``key`` is one (CuPy's mask path), else None."""
    parts = key if isinstance(key, tuple) else (key,)
    if len(parts) == 1 and isinstance(parts[0], np.ndarray) and parts[0].dtype == bool:
        return parts[0]
    return None


def _gather_cost(key, r):
    """``a[idx]``: the indices and the gathered elements read, the result written; with several
    index arrays CuPy first folds them into one flat index (a kernel)."""
    arrays = _index_arrays(key)
    fold = _Cost(1, _index_bytes(key), 8 * r.size, 8 * r.size) if len(arrays) > 1 else _Cost(0)
    read = 8 * r.size if len(arrays) > 1 else _index_bytes(key)
    return fold + _Cost(1, read + r.nbytes, r.nbytes)


def _take_cost(args, kw, r):
    return _Cost(1, _fp(args[1]) + _nb(r), _nb(r))


def _host_sequence(v):
    """Whether ``v`` is a list or tuple of host data (no device array at its top level)."""
    return isinstance(v, (list, tuple)) and not builtins.any(isinstance(e, ndarray) for e in v)


# ---------------------------------------------------------------------------- module functions
_VIEWS = ("broadcast_to", "empty_like")  # no kernel: a view, an allocation


def _fn(name, cost=_elementwise):
    npf = getattr(np, name)

    def f(*args, **kw):
        if name in _VIEWS:
            return _wrap(_raw_call(npf, args, kw))
        return _run(name, npf, args, kw, cost)

    f.__name__ = name
    return f


def _writes_only(args, kw, r):
    return _Cost(1, 0, _nb(r))


def _join_cost(args, kw, r):
    arrays = list(args[0])
    return _Cost(_concat_launches([a._a for a in arrays], r.dtype), _fp(arrays), _nb(r))


def _compare_all_cost(args, kw, r):
    """``array_equal``/``allclose``: an elementwise comparison into booleans, then ``all``."""
    n = max(a.size for a in args[:2] if isinstance(a, ndarray))
    return _Cost(2, _fp(args[:2]) + n, n + 1, n)


def _put_cost(args, kw, r):
    """``put(a, ind, v)``: one scatter kernel (indices and values read, the elements set written)."""
    return _Cost(1, _fp(args[1:3]), np.size(_unwrap(args[1])) * args[0].itemsize)


def _search_cost(args, kw, r):
    """``searchsorted``: ``zeros`` for the result, then one kernel: each query reads about log2(n)
    elements of the sorted array. A scalar query is made a 0-d device array first (a fill); a
    ``sorter`` gathers the sorted array first."""
    a, v = args[0], args[1]
    n, m = a.size, r.size
    if n == 0:
        return _Cost(1, 0, 8 * m)
    c = _Cost(2, _fp(v) + m * n.bit_length() * a.itemsize, 16 * m)
    if not isinstance(v, ndarray):
        c = _Cost(1, 0, 8) + c
    if kw.get("sorter") is not None:
        c = _Cost(1, _fp(kw["sorter"]) + n * a.itemsize, n * a.itemsize, n * a.itemsize + 8 * m) + c
    return c


def _cumsum_cost(args, kw, r):
    """``cumsum``: a cast/copy into the result, then CUB's scan of it (init + scan kernels) when
    flattened; along an axis, CuPy's blocked batch scan."""
    a, axis = args[0], kw.get("axis", args[1] if len(args) > 1 else None)
    n, osz = a.size, r.itemsize
    if axis is None:
        return _Cost(3, _fp(a) + n * osz, 2 * n * osz)
    length = a.shape[axis]
    return _Cost(1, _fp(a), n * osz) + _batch_scan_cost(n // max(length, 1), length, osz)


def _sort_cost(args, kw, r):
    """``sort``: a copy, then the radix sort in place (nothing to sort along an axis of 0 or 1)."""
    a, axis = args[0], kw.get("axis", -1)
    length = a.size if axis is None else (a.shape[axis] if a.ndim else 1)
    sort = _radix_cost(a.size, a.itemsize, 8 if a.ndim > 1 and axis is not None else 0) if length > 1 else _Cost(0)
    c = _Cost(1, _fp(a), a.nbytes) + sort
    c.temp = a.nbytes + sort.temp  # the result and the double buffer
    return c


for _name in ("abs", "negative", "multiply", "add", "subtract", "divide", "true_divide", "sqrt", "square",
              "isfinite", "isnan", "maximum", "minimum", "clip", "not_equal", "equal", "greater",
              "less", "logical_not", "logical_or", "logical_and", "sum", "remainder", "bitwise_xor",
              "right_shift", "exp", "log", "power", "dot", "vdot", "einsum", "broadcast_to", "any", "all",
              "empty_like", "floor_divide", "rint", "packbits", "unpackbits"):
    globals()[_name] = _fn(_name)
for _name, _cost in (("concatenate", _join_cost), ("stack", _join_cost), ("take", _take_cost), ("put", _put_cost),
                     ("take_along_axis", _take_cost),
                     ("searchsorted", _search_cost), ("cumsum", _cumsum_cost), ("sort", _sort_cost),
                     ("array_equal", _compare_all_cost), ("allclose", _compare_all_cost),
                     ("full_like", _writes_only), ("zeros_like", _writes_only), ("ones_like", _writes_only)):
    globals()[_name] = _fn(_name, _cost)


def _add_reduceat(a, indices, axis=0, dtype=None, out=None):
    """CuPy's ``add.reduceat`` (``_add_reduceat``): many kernels, charged as such; see the docstring."""
    r = _raw_call(np.add.reduceat, (a, indices), {"axis": axis, "dtype": dtype, "out": out})
    if not isinstance(indices, ndarray) or a.ndim != 1:
        raise NotImplementedError("the double's add.reduceat takes a 1-D array and device indices")
    acc = np.dtype(dtype) if dtype is not None else np.cumsum(np.zeros(0, a.dtype)).dtype
    _charge("add.reduceat", _reduceat_cost(a, indices, acc, r.dtype), inplace=out is not None)
    return _wrap(r)


def _maximum_reduceat(*args, **kw):
    raise NotImplementedError("`cupy_maximum.reduceat` is not supported yet (CuPy 14: only add has reduceat)")


add.reduceat = _add_reduceat  # noqa: F821 (made by the loop above)
maximum.reduceat = _maximum_reduceat  # noqa: F821


def where(condition, *xy):
    """``where(c, x, y)``: one kernel (after a cast of ``c`` to bool unless it is one);
    ``where(c)``: ``nonzero(c)``."""
    if not xy:
        return _nonzero("where", condition)
    if not isinstance(condition, ndarray):
        raise TypeError(f"cupy.where's condition must be a device array, got {type(condition)} (CuPy casts it "
                        "with .astype)")
    c = condition
    cast = _Cost(1, _fp(c), c.size, c.size) if c.dtype != bool else _Cost(0)

    def cost(args, kw, r):
        return cast + _Cost(1, (c.size if cast.n else _fp(c)) + _fp(xy), _nb(r))
    return _run("where", np.where, (condition, *xy), {}, cost)


def _nonzero(name, a, flat=False):
    """``nonzero``/``flatnonzero``/``where(c)``: their size depends on the data, so CuPy reads the
    count on the host (a sync); see :func:`_nonzero_cost` for the kernels."""
    r = np.flatnonzero(_unwrap(a)) if flat else np.nonzero(_unwrap(a))
    _sync(name, 4)
    _charge(name, _nonzero_cost(a, r.size if flat else (r[0].size if r else 0)))
    return _wrap(r)


def nonzero(a):
    return _nonzero("nonzero", a)


def flatnonzero(a):
    return _nonzero("flatnonzero", a, flat=True)


def ascontiguousarray(a, dtype=None):
    r = _raw_call(np.ascontiguousarray, (a,), {"dtype": dtype})
    if not _is_view(r, a._a):
        _launch("ascontiguousarray", _fp(a), r.nbytes)
    return _wrap(r)


def argsort(a, axis=-1, kind=None):
    """A copy of the keys, an index sequence, the radix sort of keys with int64 values."""
    if kind not in (None, "stable"):
        raise ValueError("CuPy's argsort is stable only")

    def cost(args, kw, r):
        n, isz = a.size, a.itemsize
        sort = _radix_cost(n, isz, 8)
        c = _Cost(1, _fp(a), n * isz) + _Cost(1, 0, 8 * n) + sort
        c.temp = n * isz + 8 * n + sort.temp
        return c
    return _run("argsort", np.argsort, (a,), {"axis": axis, "kind": "stable"}, cost)


def argpartition(a, kth, axis=-1):
    """CuPy's ``argpartition`` sorts the whole array, as ``argsort`` does (its documented note):
    the indices of a full stable sort, which partition at any ``kth``; charged as ``argsort``."""
    return argsort(a, axis=axis)


def partition(a, kth, axis=-1):
    return _run("partition", np.partition, (a, kth), {"axis": axis}, lambda args, kw, r: _partition_cost(a, kth))


def count_nonzero(a, axis=None):
    return _run("count_nonzero", np.count_nonzero, (a,), {"axis": axis})  # a 0-d array, no host read (as CuPy)


def repeat(a, repeats, axis=None):
    """With a scalar count: one broadcasting copy (CuPy's per-element counts, a scan, a host read,
    a search and a gather, are not in the double)."""
    if not isinstance(repeats, (int, np.integer)):
        raise NotImplementedError("the double repeats by a scalar count only")
    return _run("repeat", np.repeat, (a, repeats), {"axis": axis})


def unique(a, **kw):
    if builtins.any(kw.get(k) for k in ("return_index", "return_inverse", "return_counts")):
        raise NotImplementedError("the double's unique charges the plain call only (no return_*)")
    r = np.unique(_unwrap(a), **kw)
    _sync("unique", 4)
    _charge("unique", _unique_cost(a, r.size))
    return _wrap(r)


def bincount(x, weights=None, minlength=0):
    """CuPy 14's: ``(x < 0).any()`` and ``max(x)``, each read on the host, ``zeros``, the histogram."""
    if isinstance(x, ndarray) and x.size == 0:
        raise ValueError("cannot compute bincount of an empty array (CuPy before 14 took its maximum)")
    r = _raw_call(np.bincount, (x,), {"weights": weights, "minlength": minlength})
    _sync("bincount", 1)
    _sync("bincount", x.itemsize)
    n = x.size
    _charge("bincount", _Cost(5, 3 * _fp(x) + n + _fp(weights), n + 1 + x.itemsize + 2 * r.nbytes, n + 1))
    return _wrap(r)


def _from_host(a, dtype=None, kind="asarray"):
    """A device array from host data: a copy, save for a 0-d one, which CuPy allocates and fills."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    r = ndarray(np.array(a, dtype=dtype, copy=True))
    if r.ndim == 0:
        _launch("asarray(scalar)", 0, r.nbytes)
    else:
        _copy_in(kind, r.nbytes)
    return r


def asarray(a, dtype=None, order=None):
    return _from_host(a, dtype)


def array(a, dtype=None, copy=True, order=None):
    return _from_host(a, dtype, "array") if not isinstance(a, ndarray) else (a.copy() if copy else a)


def fuse(*args, **kwargs):
    """``cupy.fuse``, run eagerly: ``@fuse``, ``@fuse()`` and ``fuse(kernel_name=...)(f)`` give a
    function that runs ``f`` and charges one kernel, ``fuse(name)`` (CuPy compiles one): its
    array arguments read, what it returns and what it assigns in place written."""
    def wrap(f):
        name = kwargs.get("kernel_name") or getattr(f, "__name__", "fused")

        def fused(*a, **kw):
            if not name.isidentifier():  # CuPy names the kernel after it: "<lambda>" fails to compile
                raise ValueError(f'Invalid kernel name: "{name}" (cupy.fuse compiles a kernel of that name at '
                                 'the first call: pass kernel_name=)')
            _fusing[0] += 1
            _fused_writes.append(0)
            try:
                r = f(*a, **kw)
            finally:
                _fusing[0] -= 1
                inplace = _fused_writes.pop()
            for x in (r if isinstance(r, tuple) else (r,)):
                if isinstance(x, ndarray) and not _fusing[0]:
                    _own(x._a)  # the fused kernel's outputs are memory; its intermediate values were not
            _launch(f"fuse({name})", _fp(a) + _fp(kw), _nb(r) + inplace, inplace=True)
            return r
        return fused
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return wrap(args[0])
    return wrap


def asnumpy(a, stream=None):
    if isinstance(a, ndarray):
        _sync("asnumpy", a.nbytes)
        return a._a.copy()
    return np.asarray(a)


def empty(shape, dtype=float, order="C"):
    return ndarray(np.empty(shape, dtype))


def _made(name, a):
    r = ndarray(a)
    _launch(name, 0, r.nbytes)  # a memset or a fill kernel
    return r


def zeros(shape, dtype=float, order="C"):
    return _made("zeros", np.zeros(shape, dtype))


def ones(shape, dtype=float, order="C"):
    return _made("ones", np.ones(shape, dtype))


def full(shape, value, dtype=None):
    return _made("full", np.full(shape, value, dtype))


def arange(*args, dtype=None):
    return _made("arange", np.arange(*args, dtype=dtype))


def from_dlpack(x):
    dt = str(getattr(x, "dtype", ""))
    if "bfloat16" in dt:
        raise BufferError("unsupported DLPack dtype (bfloat16)")  # not a TypeError: as CuPy's import
    return ndarray(np.from_dlpack(x))  # foreign memory: not the double's


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




# ---------------------------------------------------------------------------- raw CUDA kernels
class RawModule:
    """``cupy.RawModule(code=..., options=...)`` on the host: ``code`` in the dialect of
    ``slamb_comm.device.kernels.PRELUDE``, compiled by ``g++`` (``tests/support/host_kernels.py``); its
    ``get_function(name)`` takes CuPy's launches, ``f(grid, block, args)``, and
    ``f.launch_declared(grid, block, args, reads, writes)``, which also charges the declared bytes."""

    def __init__(self, code=None, options=(), name_expressions=None, **kw):
        if code is None:
            raise NotImplementedError("the double builds RawModule(code=...) only (no path=, no cubin)")
        if "--fmad=false" not in options:
            raise ValueError("the host computes a * b + c in two roundings and a GPU would contract it into one "
                             "unless the module is built with '--fmad=false': pass it in options")
        self.code, self.options = code, tuple(options)
        self._lib = host_kernels.build(code)

    def get_function(self, name):
        return _RawFunction(self._lib.kernel(name))


def RawKernel(code, name, options=(), **kw):
    """``cupy.RawKernel``: the kernel ``name`` of a :class:`RawModule` of ``code``."""
    return RawModule(code=code, options=options).get_function(name)


def _kernel_array(x):
    """The memory a raw kernel gets for argument ``x``: a device array's, on the current device."""
    if isinstance(x, ndarray):
        if x._dev != Device.current:
            raise TypeError(f"the array is on device {x._dev}, the kernel runs on the current device {Device.current}")
        return x._a
    return None


def _declared(kernel, entries):
    """Total bytes of a ``[(label, nbytes), ...]`` declaration."""
    total = 0
    for e in entries:
        if not (isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], (int, np.integer))
                and e[1] >= 0):
            raise TypeError(f"kernel {kernel}: declared bytes must be (label, nbytes >= 0) pairs, got {e!r}")
        total += int(e[1])
    return total


class _RawFunction:
    """A kernel of a :class:`RawModule`: one ``kernel(<name>)`` launch per call, whatever the grid."""

    def __init__(self, host):
        self._host, self.name = host, host.name

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self._launch(grid, block, args, shared_mem, stream, 0, 0)

    def launch_declared(self, grid, block, args, reads, writes):
        self._launch(grid, block, args, 0, None, _declared(self.name, reads), _declared(self.name, writes))

    def _launch(self, grid, block, args, shared_mem, stream, read, written):
        if _fusing[0]:
            raise RuntimeError(f"raw kernel {self.name} inside a cupy.fuse'd function: CuPy cannot fuse it")
        if shared_mem:
            raise NotImplementedError(f"kernel {self.name}: dynamic shared memory (the dialect uses SLAMB_SHARED)")
        self._host.run(grid, block, args, _kernel_array)
        _launch(f"kernel({self.name})", read, written)
        cuda_log.append(("kernel", self.name, (stream or get_current_stream()).ptr))


def get_array_module(*args):
    return sys.modules[__name__] if builtins.any(isinstance(a, ndarray) for a in args) else np


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
        self._recorded = False

    def record(self, stream=None):
        s = stream if stream is not None else get_current_stream()
        cuda_log.append(("record", self.id, s.ptr))
        self._recorded = True

    @property
    def done(self):
        """Whether the work before the event's record has finished: here always (everything ran eagerly),
        as on a GPU that has caught up; no wait, not counted."""
        cuda_log.append(("query", self.id))
        return True

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


_PINNED = weakref.WeakValueDictionary()  # address -> the pinned block that owns it


class PinnedMemoryPointer(bytearray):
    """Pinned host memory as CuPy's ``alloc_pinned_memory`` gives it: a buffer NumPy can view
    (``numpy.frombuffer``), which :meth:`ndarray.get` may copy into without a wait."""

    def __init__(self, nbytes):
        super().__init__(max(1, int(nbytes)))
        self.ptr = ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))
        self.size = int(nbytes)
        _PINNED[self.ptr] = self


def alloc_pinned_memory(nbytes):
    return PinnedMemoryPointer(nbytes)


def _is_pinned(a):
    """Whether host array ``a`` lies inside a block of :func:`alloc_pinned_memory`."""
    base = a.ctypes.data
    return builtins.any(p.ptr <= base and base + a.nbytes <= p.ptr + p.size for p in list(_PINNED.values()))


cuda = types.ModuleType("cupy.cuda")
cuda.alloc_pinned_memory = alloc_pinned_memory
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
    of which stream each call was enqueued on. Each is one launch reading its send buffer and
    writing its receive buffer (``bcast``: the root reads, the others write)."""

    def __init__(self, ndev, uid, rank):
        from mpi4py import MPI

        self._comm = MPI.COMM_WORLD.Dup()
        if self._comm.Get_size() != ndev or self._comm.Get_rank() != rank:
            raise RuntimeError("fake NCCL: ranks must match MPI.COMM_WORLD")
        self.aborted = False

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        cuda_log.append(("nccl.allReduce", stream))
        src, dst = _host(sendbuf, count, datatype), _host(recvbuf, count, datatype)
        _launch("nccl.allReduce", src.nbytes, dst.nbytes)
        everyone = self._comm.allgather(src.copy())
        acc = everyone[0].astype(np.float64 if dst.dtype.kind == "f" else dst.dtype)
        for a in everyone[1:]:
            acc = acc + a
        dst[...] = acc.astype(dst.dtype)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        cuda_log.append(("nccl.allGather", stream))
        src = _host(sendbuf, count, datatype)
        dst = _host(recvbuf, count * self._comm.Get_size(), datatype)
        _launch("nccl.allGather", src.nbytes, dst.nbytes)
        dst[...] = np.concatenate(self._comm.allgather(src.copy()))

    def bcast(self, buff, count, datatype, root, stream):
        cuda_log.append(("nccl.bcast", stream))
        b = _host(buff, count, datatype)
        root_here = self._comm.Get_rank() == root
        _launch("nccl.bcast", b.nbytes if root_here else 0, 0 if root_here else b.nbytes)
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


def _is_cupy(name):
    return name in ("cupy", "cupyx") or name.startswith(("cupy.", "cupyx."))


class install:
    """Context manager (or plain call + :meth:`undo`): this module is ``cupy`` until undone. A real
    CuPy already imported is hidden meanwhile, ``cupyx`` and every submodule included (its lazily
    loaded ``cupyx`` would otherwise import ``cupy._core`` from the double, and ``import
    cupy._core`` would reach the real one), then restored."""

    def __init__(self):
        self._saved = {k: m for k, m in sys.modules.items() if _is_cupy(k)}
        for k in self._saved:
            del sys.modules[k]
        me = sys.modules[__name__]
        for k, v in _NAMES.items():
            sys.modules[k] = me if v is None else v

    def undo(self):
        for k in [k for k in sys.modules if _is_cupy(k)]:
            del sys.modules[k]
        sys.modules.update(self._saved)

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

        import slamb_comm.adapters.torch.transport as tcoll
        import slamb_comm.adapters.torch.tensors as ttensors
        import slamb_comm.arrays as arrays

        real = arrays.as_array

        def as_array(x):
            if isinstance(x, torch.Tensor):
                return ndarray(x.detach().numpy())
            return real(x)

        def to_torch(a):
            return torch.from_numpy(a._a if isinstance(a, ndarray) else a)

        self._saved = [(arrays, "as_array", real), (ttensors, "tensor_of", ttensors.tensor_of),
                       (tcoll, "torch_view", tcoll.torch_view)]
        for mod, name, new in ((arrays, "as_array", as_array), (ttensors, "tensor_of", to_torch),
                               (tcoll, "torch_view", to_torch)):
            setattr(mod, name, new)
        return self

    def __exit__(self, *exc):
        for mod, name, old in self._saved:
            setattr(mod, name, old)


def _tensor_bytes(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return builtins.sum(_tensor_bytes(v) for v in x)
    return 0


_ATEN_FREE = ("detach", "view", "alias", "_reshape_alias", "slice", "as_strided", "unsqueeze", "squeeze", "t.default")
_ATEN_WRITE_ONLY = ("copy_", "fill_", "zero_")  # they overwrite their tensor without reading it
_ATEN_NO_WRITE = ("empty", "new_empty")  # an allocation


def _aten_bytes(func, args, kwargs, out):
    """(read, written) device bytes of one aten call: tensor arguments read, results written; an
    argument the schema marks as written (in place, ``out=``) is written, and read too unless it
    is an ``out=`` or the op overwrites it whole (``copy_``, ``fill_``, ``zero_``)."""
    name = func.__name__
    params = func._schema.arguments
    values = list(args) + [kwargs.get(p.name) for p in params[len(args):]]
    read = written = 0
    mutated = False
    for p, v in zip(params, values):
        b = _tensor_bytes(v)
        if p.alias_info is not None and p.alias_info.is_write:
            mutated = True
            written += b
            read += 0 if p.kwarg_only or name.startswith(_ATEN_WRITE_ONLY) else b
        else:
            read += b
    if not mutated and not name.startswith(_ATEN_NO_WRITE):
        written += _tensor_bytes(out)
    return read, written


def aten_counter():
    """A ``TorchDispatchMode`` (use as a context manager) counting torch's operations: ``.n``
    in all and ``.by_op`` by name, and the device bytes they move: ``.read``, ``.written``,
    ``.bytes`` and ``.by_op_bytes`` (see :func:`_aten_bytes`). On a GPU each is at most one kernel
    launch; views and ``detach`` (no launch) are not counted, a multi-tensor ``_foreach_*`` call
    counts one (torch launches one kernel per chunk of tensors, like apex's ``multi_tensor_apply``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = self.read = self.written = 0
            self.by_op, self.by_op_bytes = Counter(), Counter()

        @property
        def bytes(self):
            return self.read + self.written

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not func.__name__.startswith(_ATEN_FREE):
                read, written = _aten_bytes(func, args, kwargs, out)
                self.n += 1
                self.by_op[func.__name__] += 1
                self.read += read
                self.written += written
                self.by_op_bytes[func.__name__] += read + written
            return out

    return AtenCount()
