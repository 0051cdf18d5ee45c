"""The core's transport on Horovod's collectives: :class:`HorovodTransport`.

The distributed optimizers' own interface, named asynchronous collectives on tensors, is
:mod:`.collectives`."""

import itertools

import torch

import horovod.torch as hvd

from slamb_comm.exchange.transports import check_alltoall, check_buffer

from ..torch.tensors import torch_view

__all__ = ["HorovodTransport"]


class HorovodTransport:
    """slamb_comm's transport protocol over Horovod's collectives (call ``hvd.init()`` first).

    Buffers are NumPy arrays (viewed as CPU tensors with ``torch.from_numpy``, no copy) or
    CuPy arrays (viewed as CUDA tensors through DLPack; needs Horovod built with CUDA, and
    is not exercised by this package's tests). Every collective gets a unique,
    deterministic name ``<prefix>.<op>.<counter>``: Horovod matches tensors across ranks by
    name, and the ranks call the collectives of one transport in the same order, so the
    counters agree.

    Horovod has no uint8 allreduce: a uint8 buffer is summed as int32 and wraps modulo 256,
    as an MPI sum of bytes would.

    Args:
        process_set: a Horovod process set (default: all ranks).
    """

    name = "horovod"
    _created = itertools.count()

    @classmethod
    def next_prefix(cls):
        """The prefix of the next transport this process makes (a rank that makes none where the
        others do calls it too, so that every rank numbers its later transports alike)."""
        return f"slamb_comm.t{next(cls._created)}"

    def __init__(self, process_set=None, prefix=None):
        if not hvd.is_initialized():
            raise RuntimeError("HorovodTransport needs hvd.init() to have been called")
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        if not self.process_set.included():
            raise ValueError("this rank is not in the given Horovod process set")
        self.rank = int(self.process_set.rank())
        self.size = int(self.process_set.size())
        # names shared by every rank that creates its transports in the same order (or, from Elastic
        # Horovod's reset, names given by the caller, the same on every worker)
        self.prefix = HorovodTransport.next_prefix() if prefix is None else prefix
        self._calls = itertools.count()

    def _name(self, op):
        return f"{self.prefix}.{op}.{next(self._calls)}"

    def allreduce(self, buf):
        """In place: the element-wise sum over ranks."""
        check_buffer(buf)
        t = torch_view(buf)
        if t.dtype == torch.uint8:
            wide = t.to(torch.int32)
            hvd.allreduce_(wide, op=hvd.Sum, name=self._name("allreduce"), process_set=self.process_set)
            t.copy_(wide.remainder_(256).to(torch.uint8))
            return
        hvd.allreduce_(t, op=hvd.Sum, name=self._name("allreduce"), process_set=self.process_set)

    def allgather(self, sendbuf, recvbuf):
        """``recvbuf[r * n:(r + 1) * n]`` = rank r's ``sendbuf`` (n = ``sendbuf.size``).

        While some rank is in ``hvd.join()``, Horovod refuses allgathers (and keeps running);
        then the ranks still working gather through an allreduce of a zero-padded buffer
        instead (twice the bytes, on those steps only), in which the joined ranks' slots are
        zeros, as Horovod's joined ranks contribute zeros to every allreduce."""
        check_buffer(sendbuf)
        check_buffer(recvbuf)
        if recvbuf.size != sendbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError("allgather needs recvbuf of size * sendbuf.size elements of the same dtype")
        name = self._name("allgather")
        try:
            out = hvd.allgather(torch_view(sendbuf), name=name, process_set=self.process_set)
        except hvd.HorovodInternalError as err:
            if "not supported with Join" not in str(err):
                raise
            # Every rank that is not joined got this error for this allgather: gather by summing.
            mine = torch_view(sendbuf).reshape(-1).view(torch.uint8)
            words = mine.numel() % 4 == 0  # summed as int32 words (x + 0 is exact), else byte by byte
            slots = torch.zeros(self.size, mine.numel() // 4 if words else mine.numel(), dtype=torch.int32,
                                device=mine.device)
            slots[self.rank].copy_(mine.view(torch.int32) if words else mine)
            hvd.allreduce_(slots, op=hvd.Sum, name=name + ".joined", process_set=self.process_set)
            out = (slots if words else slots.to(torch.uint8)).reshape(-1).view(torch.uint8)
            out = out.view(torch_view(sendbuf).dtype)
        torch_view(recvbuf).copy_(out.reshape(-1))

    def alltoall(self, sendbuf, recvbuf):
        """Rank r's ``sendbuf[j * n:(j + 1) * n]`` arrives in rank j's ``recvbuf[r * n:(r + 1) * n]``
        (n = ``sendbuf.size // size``), through ``hvd.alltoall`` with equal splits.

        While some rank is in ``hvd.join()``, Horovod refuses all-to-alls as it refuses
        allgathers; the ranks still working then exchange through an allreduce of a
        zero-padded ``size x sendbuf`` buffer instead (``size`` times the bytes, on those steps
        only), in which the joined ranks' blocks are zeros, as Horovod's joined ranks
        contribute zeros to every allreduce."""
        check_alltoall(sendbuf, recvbuf, self.size)
        name = self._name("alltoall")
        src = torch_view(sendbuf)
        try:
            out = hvd.alltoall(src, name=name, process_set=self.process_set)
        except hvd.HorovodInternalError as err:
            if "not supported with Join" not in str(err):
                raise
            # Every rank that is not joined got this error: each puts its whole sendbuf in its own
            # row of a zero buffer, one sum gives every row to everyone, and each keeps column block r.
            mine = src.reshape(-1).view(torch.uint8)
            words = mine.numel() % (4 * self.size) == 0  # summed as int32 words (x + 0 is exact)
            slots = torch.zeros(self.size, mine.numel() // 4 if words else mine.numel(), dtype=torch.int32,
                                device=mine.device)
            slots[self.rank].copy_(mine.view(torch.int32) if words else mine)
            hvd.allreduce_(slots, op=hvd.Sum, name=name + ".joined", process_set=self.process_set)
            block = slots.shape[1] // self.size
            rows = slots[:, self.rank * block:(self.rank + 1) * block].contiguous()
            out = (rows if words else rows.to(torch.uint8)).reshape(-1).view(torch.uint8).view(src.dtype)
        torch_view(recvbuf).copy_(out.reshape(-1))

    def broadcast(self, buf, root=0):
        """In place: every rank gets ``root``'s buffer."""
        check_buffer(buf)
        if not 0 <= int(root) < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        hvd.broadcast_(torch_view(buf), int(root), name=self._name("broadcast"), process_set=self.process_set)

    def barrier(self):
        """Wait until every rank of the process set has arrived."""
        hvd.barrier(process_set=self.process_set)
