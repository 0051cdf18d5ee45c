"""Transports: the few collectives slamb_comm needs, behind one small protocol.

A transport moves contiguous NumPy or CuPy buffers between ranks:

* ``rank``, ``size``
* ``allreduce(buf)``: in place, the element-wise **sum** over ranks;
* ``allgather(sendbuf, recvbuf)``: ``recvbuf`` (``size * sendbuf.size`` elements) gets
  rank r's ``sendbuf`` at ``[r * n:(r + 1) * n]``;
* ``alltoall(sendbuf, recvbuf)``: equal blocks of ``n = sendbuf.size // size`` elements
  (``sendbuf.size`` a multiple of ``size``; ``recvbuf`` as large, same dtype): rank r's
  ``sendbuf[j * n:(j + 1) * n]`` arrives in rank j's ``recvbuf[r * n:(r + 1) * n]``;
* ``broadcast(buf, root=0)``: in place;
* ``barrier()``.

Buffers are 1-D and C-contiguous, with dtype float16, float32, float64, int32, int64 or
uint8. Every rank must call every collective in the same order with the same sizes: the
communicator guarantees that (it agrees on the layout once and carries a status word in
every payload).

Three transports live here: :class:`MPITransport` (mpi4py), :class:`NCCLTransport`
(CuPy's NCCL bindings) and :class:`LocalTransport` (one process, no communication).
Horovod's transport comes with the Horovod adapter.
"""

import sys
from typing import Protocol, runtime_checkable

import numpy as np

from ..arrays import is_cupy, synchronize
from ..errors import DTypeError

__all__ = ["Transport", "MPITransport", "NCCLTransport", "LocalTransport", "mpi_cuda_support"]

_SUPPORTED = ("float16", "float32", "float64", "int32", "int64", "uint8")


def check_buffer(buf):
    """Raise unless ``buf`` is a 1-D C-contiguous array of a dtype transports move."""
    if buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError("transport buffers must be 1-D and C-contiguous")
    if buf.dtype.name not in _SUPPORTED:
        raise DTypeError(f"transport cannot move dtype {buf.dtype.name}; supported: {', '.join(_SUPPORTED)}")


@runtime_checkable
class Transport(Protocol):
    """The protocol every transport implements (see the module docstring)."""

    rank: int
    size: int
    name: str

    def allreduce(self, buf) -> None: ...

    def allgather(self, sendbuf, recvbuf) -> None: ...

    def alltoall(self, sendbuf, recvbuf) -> None: ...

    def broadcast(self, buf, root: int = 0) -> None: ...

    def barrier(self) -> None: ...


def check_alltoall(sendbuf, recvbuf, size):
    """Raise unless ``sendbuf``/``recvbuf`` suit an all-to-all among ``size`` ranks: 1-D,
    C-contiguous, of one supported dtype and one size, a multiple of ``size``."""
    check_buffer(sendbuf)
    check_buffer(recvbuf)
    if recvbuf.size != sendbuf.size or recvbuf.dtype != sendbuf.dtype or sendbuf.size % size:
        raise ValueError(f"alltoall needs sendbuf and recvbuf of one dtype and one size, a multiple of {size} "
                         f"(got {sendbuf.size} {sendbuf.dtype.name} and {recvbuf.size} {recvbuf.dtype.name})")


class LocalTransport:
    """A single rank: every collective is the identity (allgather and alltoall copy)."""

    rank = 0
    size = 1
    name = "local"

    def allreduce(self, buf):
        check_buffer(buf)

    def allgather(self, sendbuf, recvbuf):
        check_buffer(sendbuf)
        recvbuf[: sendbuf.size] = sendbuf

    def alltoall(self, sendbuf, recvbuf):
        check_alltoall(sendbuf, recvbuf, 1)
        recvbuf[...] = sendbuf

    def broadcast(self, buf, root=0):
        if root != 0:
            raise ValueError(f"root {root} out of range for 1 rank")

    def barrier(self):
        pass


_F16_SUM = None
_HOOKED = False
_ON_ABORT = []  # callables run before MPI_Abort (e.g. an NCCL communicator's abort)


def _install_abort_hook(MPI, on_abort=None):
    """Make an uncaught exception on one rank abort the whole MPI job (once per process); the
    ``on_abort`` callables run first."""
    global _HOOKED
    if on_abort is not None:
        _ON_ABORT.append(on_abort)
    if _HOOKED:
        return
    _HOOKED = True
    previous = sys.excepthook

    def _abort(kind, value, tb):
        rank = MPI.COMM_WORLD.Get_rank()
        try:
            previous(kind, value, tb)
        finally:
            sys.stderr.write(
                f"slamb_comm: uncaught {kind.__name__} on rank {rank}; aborting all ranks (MPI_Abort)\n"
            )
            sys.stderr.flush()
            for fn in _ON_ABORT:
                try:
                    fn()
                except Exception:  # noqa: BLE001 -- aborting anyway
                    pass
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = _abort


def mpi_cuda_support():
    """Whether the loaded MPI library accepts CUDA device memory, as the library itself says:
    Open MPI's ``MPIX_Query_cuda_support()`` or MPICH's ``MPIX_GPU_query_support(CUDA)``,
    called through ctypes on the libmpi this process has loaded (mpi4py has no query for it).
    False when no library answers, or off Linux."""
    import ctypes

    try:
        maps = open("/proc/self/maps").read().splitlines()
    except OSError:
        return False
    libs = sorted({ln.split()[-1] for ln in maps if "libmpi" in ln and ln.split()[-1].startswith("/")})
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, []
            return bool(fn())
        fn = getattr(lib, "MPIX_GPU_query_support", None)
        if fn is not None:
            out = ctypes.c_int(0)
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            return fn(0, ctypes.byref(out)) == 0 and bool(out.value)  # 0: MPIX_GPU_SUPPORT_CUDA
    return False


def _f16_sum_op(MPI):
    """An MPI op that sums IEEE half floats (MPI has no predefined float16 type)."""
    global _F16_SUM
    if _F16_SUM is None:

        def _sum(inmem, outmem, datatype):
            out = np.frombuffer(outmem, dtype=np.float16)
            out += np.frombuffer(inmem, dtype=np.float16)

        _F16_SUM = MPI.Op.Create(_sum, commute=True)
    return _F16_SUM


class MPITransport:
    """Collectives over an mpi4py communicator.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (default ``MPI.COMM_WORLD``). It is duplicated, so
            slamb_comm's messages never mix with the caller's.
        cuda_aware: whether the MPI library accepts device pointers. ``None`` asks the MPI
            library (:func:`mpi_cuda_support`: Open MPI's ``MPIX_Query_cuda_support``, MPICH's
            ``MPIX_GPU_query_support``). When false, CuPy buffers are staged through host
            memory (correct, slower). float16 CuPy buffers are always summed through host
            memory: MPI has no float16 sum, and the Python sum op can only read host memory.
        abort_on_exception: if true (default), an exception that nobody catches on this
            rank prints its traceback with the rank and calls ``MPI_Abort``, so the other
            ranks end at once instead of waiting forever in their next collective (what
            ``python -m mpi4py`` does). The previous ``sys.excepthook`` still runs first.

    float16 sums use a user-defined MPI op (MPI has no float16 type); everything else
    uses ``MPI.SUM``. CuPy buffers: the current stream is synchronised before MPI reads
    a buffer (one host synchronisation per collective), because MPI does not know CUDA
    streams; staging through host memory synchronises too.
    """

    name = "mpi"

    def __init__(self, comm=None, cuda_aware=None, abort_on_exception=True):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = mpi_cuda_support() if cuda_aware is None else bool(cuda_aware)
        if abort_on_exception:
            _install_abort_hook(MPI)

    def _spec(self, buf):
        if buf.dtype == np.float16:
            return [buf.view(np.uint16), self._MPI.UINT16_T], _f16_sum_op(self._MPI)
        return buf, self._MPI.SUM

    def allreduce(self, buf):
        check_buffer(buf)
        if is_cupy(buf) and (not self.cuda_aware or buf.dtype == np.float16):
            host = buf.get()
            self.allreduce(host)
            buf.set(host)
            return
        synchronize(buf)
        spec, op = self._spec(buf)
        self.comm.Allreduce(self._MPI.IN_PLACE, spec, op=op)

    def allgather(self, sendbuf, recvbuf):
        check_buffer(sendbuf)
        check_buffer(recvbuf)
        if recvbuf.size != sendbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError("allgather needs recvbuf of size * sendbuf.size elements of the same dtype")
        if is_cupy(sendbuf) and not self.cuda_aware:
            host = recvbuf.get()
            self.comm.Allgather(sendbuf.get().view(np.uint8), host.view(np.uint8))
            recvbuf.set(host)
            return
        synchronize(sendbuf)
        # Bytes are bytes: gather as uint8 so float16 needs no MPI type.
        self.comm.Allgather(sendbuf.view(np.uint8), recvbuf.view(np.uint8))

    def alltoall(self, sendbuf, recvbuf):
        check_alltoall(sendbuf, recvbuf, self.size)
        if is_cupy(sendbuf) and not self.cuda_aware:
            host = np.empty(recvbuf.size, recvbuf.dtype)
            self.comm.Alltoall(sendbuf.get().view(np.uint8), host.view(np.uint8))
            recvbuf.set(host)
            return
        synchronize(sendbuf)
        # As bytes (equal blocks of bytes are equal blocks of elements): float16 needs no MPI type.
        self.comm.Alltoall(sendbuf.view(np.uint8), recvbuf.view(np.uint8))

    def broadcast(self, buf, root=0):
        check_buffer(buf)
        if is_cupy(buf) and not self.cuda_aware:
            host = buf.get()
            self.comm.Bcast(host.view(np.uint8), root=root)
            buf.set(host)
            return
        synchronize(buf)
        self.comm.Bcast(buf.view(np.uint8), root=root)

    def barrier(self):
        self.comm.Barrier()


class NCCLTransport:
    """Collectives over NCCL through ``cupy.cuda.nccl``, for CuPy buffers.

    NumPy buffers (such as the communicator's small agreement and status messages) are
    staged through device memory; the call then returns only when the result is on the host.

    Args:
        mpi_comm: an mpi4py communicator used once, to broadcast NCCL's unique id
            (default ``MPI.COMM_WORLD``). Each rank must have selected its device
            (``cupy.cuda.Device(i).use()``) before constructing this.
        stream: a ``cupy.cuda.Stream`` to run NCCL on; default: the current stream at each
            call. With a stream of its own, each collective waits (on the device, through an
            event) for the work already queued on the current stream, and the current stream
            waits for the collective: results are ordered with the caller's work either way.
        abort_on_exception: if true (default), an exception that nobody catches on this rank
            aborts this NCCL communicator and then the MPI job (as :class:`MPITransport`
            does), so that no other rank is left waiting inside an NCCL kernel.

    Calls are asynchronous, like NCCL itself: results are ready for later work on the
    current stream, and the host must synchronise before reading them.
    """

    name = "nccl"

    def __init__(self, mpi_comm=None, stream=None, abort_on_exception=True):
        import cupy
        from cupy.cuda import nccl
        from mpi4py import MPI

        self._cp = cupy
        self._nccl = nccl
        mpi_comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._mpi = mpi_comm
        self.stream = stream
        self._types = {
            "float16": nccl.NCCL_FLOAT16,
            "float32": nccl.NCCL_FLOAT32,
            "float64": nccl.NCCL_FLOAT64,
            "int32": nccl.NCCL_INT32,
            "int64": nccl.NCCL_INT64,
            "uint8": nccl.NCCL_UINT8,
        }
        if abort_on_exception:
            _install_abort_hook(MPI, on_abort=self.comm.abort)

    def _enqueue(self, call):
        """Run ``call(stream_ptr)`` on NCCL's stream, ordered with the current stream."""
        cur = self._cp.cuda.get_current_stream()
        s = self.stream
        if s is None or s.ptr == cur.ptr:
            call(cur.ptr)
            return
        ready = self._cp.cuda.Event()
        ready.record(cur)  # what the caller queued (e.g. filling the buffer) ...
        s.wait_event(ready)  # ... comes before the collective
        call(s.ptr)
        done = self._cp.cuda.Event()
        done.record(s)
        cur.wait_event(done)  # and whatever the caller queues next comes after it

    def _check(self, buf):
        check_buffer(buf)
        if not is_cupy(buf):
            raise TypeError("NCCLTransport moves CuPy arrays only; use MPITransport for NumPy")

    def _upload(self, host):
        check_buffer(host)
        return self._cp.asarray(host)  # queued on the current stream, which the collective waits for

    def _download(self, dev, host):
        host[...] = dev.get()  # on the current stream, which waits for NCCL's

    def allreduce(self, buf):
        if isinstance(buf, np.ndarray):
            dev = self._upload(buf)
            self.allreduce(dev)
            self._download(dev, buf)
            return
        self._check(buf)
        t = self._types[buf.dtype.name]
        self._enqueue(lambda s: self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, t, self._nccl.NCCL_SUM, s))

    def allgather(self, sendbuf, recvbuf):
        if isinstance(sendbuf, np.ndarray) and isinstance(recvbuf, np.ndarray):
            check_buffer(recvbuf)
            dev = self._cp.empty(recvbuf.size, dtype=recvbuf.dtype)
            self.allgather(self._upload(sendbuf), dev)
            self._download(dev, recvbuf)
            return
        self._check(sendbuf)
        self._check(recvbuf)
        if recvbuf.size != sendbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError("allgather needs recvbuf of size * sendbuf.size elements of the same dtype")
        t = self._types[sendbuf.dtype.name]
        self._enqueue(lambda s: self.comm.allGather(sendbuf.data.ptr, recvbuf.data.ptr, sendbuf.size, t, s))

    def alltoall(self, sendbuf, recvbuf):
        """One grouped ``send``/``recv`` per peer (NCCL has no all-to-all of its own; this is how
        its documentation builds one), all inside one ``groupStart``/``groupEnd``."""
        if isinstance(sendbuf, np.ndarray) and isinstance(recvbuf, np.ndarray):
            check_alltoall(sendbuf, recvbuf, self.size)
            dev = self._cp.empty(recvbuf.size, dtype=recvbuf.dtype)
            self.alltoall(self._upload(sendbuf), dev)
            self._download(dev, recvbuf)
            return
        self._check(sendbuf)
        self._check(recvbuf)
        check_alltoall(sendbuf, recvbuf, self.size)
        t = self._types[sendbuf.dtype.name]
        n = sendbuf.size // self.size
        step = n * sendbuf.dtype.itemsize
        nccl = self._nccl

        def call(s):
            nccl.groupStart()
            try:
                for j in range(self.size):
                    self.comm.send(sendbuf.data.ptr + j * step, n, t, j, s)
                    self.comm.recv(recvbuf.data.ptr + j * step, n, t, j, s)
            finally:
                nccl.groupEnd()

        self._enqueue(call)

    def broadcast(self, buf, root=0):
        if isinstance(buf, np.ndarray):
            dev = self._upload(buf)
            self.broadcast(dev, root)
            self._download(dev, buf)
            return
        self._check(buf)
        t = self._types[buf.dtype.name]
        self._enqueue(lambda s: self.comm.bcast(buf.data.ptr, buf.size, t, root, s))

    def barrier(self):
        self._cp.cuda.get_current_stream().synchronize()
        self._mpi.Barrier()
