"""The distributed optimizers' collectives on torch.distributed: :class:`TorchCollectives`.

The few named, asynchronous collectives on tensors that the distributed optimizers of this package
are written against (Horovod's API shape); Horovod's counterpart is
:class:`slamb_comm.adapters.horovod.collectives.HorovodCollectives`. The core's byte-level
transport is :mod:`..transport`.
"""

import contextlib

import torch
import torch.distributed as dist

from ..transport import TorchTransport, group_size_rank, tear_down_gloo_at_exit

__all__ = ["TorchCollectives"]


class TorchCollectives:
    """The few collectives the distributed optimizers use, on a torch.distributed process group.
    Horovod's counterpart is ``slamb_comm.adapters.horovod.collectives.HorovodCollectives``; both offer:
    ``member``, ``size``, ``rank``, ``device`` (where flag tensors live), ``allreduce_async`` /
    ``wait`` (in place; Sum, or Average with pre- and post-scaling), ``allreduce`` (Sum, in
    place), ``allgather`` (concatenated along dim 0), ``transport()`` (for the core; None outside
    the group) and ``recognise(opt)``.

    Horovod matches collectives by name; torch.distributed by the order in which each rank
    issues them. Gradient hooks fire in an order that can differ between ranks (a parameter
    without a gradient on one rank is launched later, from ``synchronize()``), so outside DDP the
    asynchronous allreduces are queued and issued at the first ``wait`` (or blocking call), sorted
    by name: the same order everywhere. Under DDP (``immediate``) they start at once, from DDP's
    bucket hooks, which run in the same order on every rank; a hook that launches several
    (``with batch():``) issues them together when it ends.

    Issued together, allreduces of one dtype, device and pre-scale travel as **one** collective
    (as Horovod's tensor fusion does): concatenated in name order, reduced once, copied back at
    the first ``wait`` of any of them. SLAMB's per-tensor payloads of a step are one gloo or NCCL
    call, not one per tensor."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group() before building a DistributedOptimizer")
        self.group = group
        self.member, self.size, self.rank = group_size_rank(group)
        nccl = self.member and dist.get_backend(group) == "nccl"
        if self.member:
            tear_down_gloo_at_exit(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.immediate = False
        self._queued = []

    def _start(self, h):
        if h["pre"] != 1.0:
            h["t"].mul_(h["pre"])
        h["work"] = dist.all_reduce(h["t"], group=self.group, async_op=True)

    def _issue(self):
        queued, self._queued = self._queued, []
        groups = {}
        for h in sorted(queued, key=lambda h: h["name"]):
            groups.setdefault((h["t"].dtype, h["t"].device, h["pre"]), []).append(h)
        for hs in groups.values():
            if len(hs) == 1:
                self._start(hs[0])
                continue
            flat = torch.cat([h["t"].reshape(-1) for h in hs])
            fused = {"t": flat, "pre": hs[0]["pre"], "members": hs, "copied": False}
            self._start(fused)
            for h in hs:
                h["work"], h["fused"] = fused["work"], fused

    @contextlib.contextmanager
    def batch(self):
        """Queue the allreduces launched inside, then issue them together (fused) at the end."""
        immediate, self.immediate = self.immediate, False
        try:
            yield
        finally:
            self.immediate = immediate
            if immediate:
                self._issue()

    def allreduce_async(self, t, name, average=False, prescale=1.0, postscale=1.0):
        h = {"t": t, "name": name, "average": average, "pre": prescale, "post": postscale, "work": None}
        if self.immediate:
            self._start(h)
        else:
            self._queued.append(h)
        return h

    def wait(self, handle):
        if handle["work"] is None:
            self._issue()
        handle["work"].wait()
        fused = handle.get("fused")
        if fused is not None and not fused["copied"]:  # one fused collective: every member's slice back
            fused["copied"] = True
            o = 0
            for h in fused["members"]:
                n = h["t"].numel()
                h["t"].view(-1).copy_(fused["t"][o : o + n])
                o += n
        t = handle["t"]
        if handle["average"]:
            t.div_(self.size)
        if handle["post"] != 1.0:
            t.mul_(handle["post"])
        return t

    def allreduce(self, t, name):
        self._issue()
        dist.all_reduce(t, group=self.group)

    def allgather(self, t, name):
        self._issue()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return torch.cat(out)

    def transport(self):
        return TorchTransport(self.group) if self.member else None

    def recognise(self, opt):
        pass
