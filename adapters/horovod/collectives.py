"""The distributed optimizers' collectives on Horovod: :class:`HorovodCollectives`.

The interface of :class:`slamb_comm.adapters.torch.distributed.collectives.TorchCollectives` on
Horovod's named asynchronous collectives, and :class:`AloneUntilSynced`, an Elastic Horovod
optimizer's collectives before it joined the world.
"""

import contextlib

import torch

import horovod.torch as hvd

from .transport import HorovodTransport

__all__ = ["HorovodCollectives", "AloneUntilSynced"]


class HorovodCollectives:
    """The collectives the distributed optimizers of :mod:`slamb_comm.adapters.torch` use, on
    Horovod's (see :class:`slamb_comm.adapters.torch.distributed.collectives.TorchCollectives` for the interface)."""

    device = torch.device("cpu")

    def __init__(self, process_set):
        self.process_set = process_set
        self.member = bool(process_set.included())
        self.size = int(process_set.size()) if self.member else 1
        self.rank = int(process_set.rank()) if self.member else 0

    @staticmethod
    def batch():
        """Nothing to do: Horovod's own tensor fusion batches the allreduces in flight."""
        return contextlib.nullcontext()

    def allreduce_async(self, t, name, average=False, prescale=1.0, postscale=1.0):
        return hvd.allreduce_async_(t, name=name, op=hvd.Average if average else hvd.Sum, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=self.process_set)

    def wait(self, handle):
        return hvd.synchronize(handle)

    def allreduce(self, t, name):
        hvd.allreduce_(t, op=hvd.Sum, name=name, process_set=self.process_set)

    def allgather(self, t, name):
        return hvd.allgather(t, name=name, process_set=self.process_set)

    def transport(self, prefix=None):
        """A HorovodTransport for members (its collectives named by ``prefix`` if given); None
        elsewhere (which still takes a transport number, so that every rank numbers its later
        transports alike)."""
        if self.member:
            return HorovodTransport(self.process_set, prefix)
        HorovodTransport.next_prefix()
        return None

    def recognise(self, opt):
        # hvd.broadcast_optimizer_state recognises Horovod's own distributed optimizers by this
        # attribute and then creates missing state with the *wrapped* optimizer's step(), locally,
        # without the collectives a distributed step() would start on only some ranks (which hung).
        opt.__module__ = hvd.DistributedOptimizer.__module__


class AloneUntilSynced(HorovodCollectives):
    """Collectives of an optimizer built under Elastic Horovod before it joined the world: this
    rank alone (no transport, so building it is not collective). Nothing is exchanged through
    them: every hook, ``synchronize()`` and ``step()`` joins the world first."""

    def __init__(self, process_set):  # not super().__init__: it would read the world's size
        self.process_set, self.member, self.size, self.rank = process_set, True, 1, 0

    def transport(self, prefix=None):
        return None
