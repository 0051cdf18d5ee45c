"""The core's transport on torch.distributed: :class:`TorchTransport`, and :func:`init_process_group`.

The bottom layer between the core and torch.distributed, under every optimizer of the package that
exchanges over a process group (DeMo, DiLoCo and its relatives, the DDP hooks, the FSDP2 optimizers,
the distributed optimizers). :class:`TorchTransport` is slamb_comm's transport protocol (allreduce, allgather, alltoall,
broadcast, barrier on buffers) on ``torch.distributed``: gloo on the CPU, NCCL on GPUs, on the
default process group or a given one, so the core runs inside any ``torchrun`` job. The
distributed optimizers' own interface, named asynchronous collectives on tensors, is
:mod:`.distributed.collectives`.
"""

import atexit
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from slamb_comm.exchange.transports import check_alltoall, check_buffer

from .tensors import torch_view

__all__ = ["TorchTransport", "init_process_group", "group_size_rank", "tear_down_gloo_at_exit", "multi_rank_job"]


_TEARDOWN = []  # one atexit handler per process, registered by the first gloo transport or collectives


def _gloo_worker_threads():
    """States ('R', 'S', ...) of this process's gloo worker threads, from /proc (Linux); None
    where /proc cannot tell."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("pt_gloo"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
    return states


def tear_down_gloo_at_exit(group):
    """When slamb_comm first runs collectives on a gloo group: have the process groups torn down
    at interpreter exit, if the script has not done so itself.

    Why: gloo's worker threads release the tensors of a collective a moment after it returned.
    Tensors made in Python (slamb_comm's every step; a user's ``all_gather`` of temporaries)
    need the GIL for that release; a worker that gets the CPU again only once the interpreter
    is finalising cannot take it and aborts the process ("terminate called without an active
    exception", seen here in 2 of 10 to 7 of 15 runs of a script whose last act is a
    collective, on a loaded machine; pytorch/pytorch#190489). ``destroy_process_group()`` at
    exit joins those threads while the interpreter is still whole -- but only for groups
    nothing else holds: a live ``DistributedDataParallel`` model or a subgroup kept in a
    Python variable keeps its gloo threads running until finalisation. For those, the handler
    then releases the GIL until the remaining workers are idle (at most half a second), so
    their pending releases happen now. For gloo all of this is local: no collective, no wait
    on other ranks. NCCL groups are left alone (their teardown can block on peers)."""
    if _TEARDOWN or dist.get_backend(group) != "gloo":
        return

    def teardown():
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
        if not _gloo_worker_threads():  # none left (or no /proc to tell): nothing to wait for
            return
        deadline = time.monotonic() + 0.5
        time.sleep(0.02)  # first let a worker that sleeps waiting for the GIL take it
        while time.monotonic() < deadline:
            states = _gloo_worker_threads()
            if states is not None and "R" not in states:
                return
            time.sleep(0.02)

    atexit.register(teardown)
    _TEARDOWN.append(teardown)


def multi_rank_job():
    """Whether this process is one of several ranks of a job: torch.distributed initialised with more than one
    rank, or Horovod (if it was imported) initialised with more than one. An optimizer built here may be wrapped
    in a distributed one later, so its constructor keeps an invalid option for that one's agreement."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True
    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd is not None and bool(hvd.is_initialized()) and hvd.size() > 1
    except (AttributeError, ValueError, RuntimeError):  # Horovod not initialised, or of another version
        return False


def group_size_rank(group):
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return False, 1, 0
    return True, dist.get_world_size(group), dist.get_rank(group)


class TorchTransport:
    """slamb_comm's transport protocol on ``torch.distributed`` (call ``init_process_group`` first).

    Buffers are NumPy arrays (viewed as CPU tensors, no copy) or CuPy arrays (CUDA tensors
    through DLPack). A backend that cannot take a buffer's device gets a staged copy: NCCL
    takes CUDA tensors only, so the core's small host buffers (agreement at construction,
    status words on the failure path) travel through the current CUDA device; gloo gets a
    CUDA buffer through host memory.

    Args:
        group: a process group (default: the default group). A rank outside ``group`` cannot
            build one (ValueError).
    """

    name = "torch"

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchTransport needs torch.distributed.init_process_group() to have been called")
        member, self.size, self.rank = group_size_rank(group)
        if not member:
            raise ValueError("this rank is not in the given process group")
        self.group = group
        self._nccl = dist.get_backend(group) == "nccl"
        tear_down_gloo_at_exit(group)

    def _staged(self, t):
        if self._nccl and t.device.type != "cuda":
            return t.to(torch.device("cuda", torch.cuda.current_device()))
        if not self._nccl and t.device.type == "cuda":
            return t.cpu()
        return t

    def allreduce(self, buf):
        """In place: the element-wise sum over ranks."""
        check_buffer(buf)
        t = torch_view(buf)
        w = self._staged(t)
        dist.all_reduce(w, group=self.group)
        if w is not t:
            t.copy_(w)

    def allgather(self, sendbuf, recvbuf):
        """``recvbuf[r * n:(r + 1) * n]`` = rank r's ``sendbuf`` (n = ``sendbuf.size``)."""
        check_buffer(sendbuf)
        check_buffer(recvbuf)
        if recvbuf.size != sendbuf.size * self.size or recvbuf.dtype != sendbuf.dtype:
            raise ValueError("allgather needs recvbuf of size * sendbuf.size elements of the same dtype")
        r = torch_view(recvbuf)
        w = self._staged(r)
        dist.all_gather(list(w.reshape(self.size, -1).unbind(0)), self._staged(torch_view(sendbuf)),
                        group=self.group)
        if w is not r:
            r.copy_(w)

    def alltoall(self, sendbuf, recvbuf):
        """Rank r's ``sendbuf[j * n:(j + 1) * n]`` goes to rank j's ``recvbuf[r * n:(r + 1) * n]``
        (n = ``sendbuf.size // size``): ``all_to_all_single`` with equal splits."""
        check_alltoall(sendbuf, recvbuf, self.size)
        r = torch_view(recvbuf)
        w = self._staged(r)
        dist.all_to_all_single(w, self._staged(torch_view(sendbuf)), group=self.group)
        if w is not r:
            r.copy_(w)

    def broadcast(self, buf, root=0):
        """In place: every rank gets ``root``'s buffer (``root``: a rank of the group)."""
        check_buffer(buf)
        if not 0 <= int(root) < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        t = torch_view(buf)
        w = self._staged(t)
        src = int(root) if self.group is None else dist.get_global_rank(self.group, int(root))
        dist.broadcast(w, src=src, group=self.group)
        if w is not t:
            t.copy_(w)

    def barrier(self):
        """Wait until every rank of the group has arrived."""
        dist.barrier(group=self.group)


def init_process_group(backend=None, timeout=None, **kwargs):
    """``torch.distributed.init_process_group`` for torchrun jobs that may restart.

    Under ``torchrun --max-restarts=N`` the restarted workers rendezvous again in the agent's
    store, where the previous attempt's gloo addresses are still written under the same keys:
    with torch 2.13 they connect to the dead workers and fail (``Connection refused``) or hang
    (tested in ``tests/test_torchrun.py``; NCCL reports the same, pytorch/pytorch#167288). This
    puts the group's keys under a prefix of the restart count (``TORCHELASTIC_RESTART_COUNT``),
    so every attempt meets only its own workers. Outside torchrun, or with ``init_method=`` or
    ``store=`` given, it is ``torch.distributed.init_process_group`` itself. ``timeout`` also
    bounds the wait for the agent's store (default 10 minutes, torch's)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    timeout = timeout or datetime.timedelta(minutes=10)
    if attempt is None or "MASTER_ADDR" not in os.environ or "init_method" in kwargs or "store" in kwargs:
        return dist.init_process_group(backend, timeout=timeout, **kwargs)
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.init_process_group(backend, store=dist.PrefixStore(f"slamb_comm.attempt{attempt}", base),
                                   rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                   timeout=timeout, **kwargs)

