"""Distributed optimizers on any framework's collectives, and torch.distributed's collectives.

=====================  =========================================================================
module                 what it holds
=====================  =========================================================================
``optimizer``          :func:`DistributedOptimizer` (torchrun without DDP) and ``wrap``, which builds
                       the distributed optimizer's class on any framework's collectives
``contract``           Horovod's optimizer contract, one object per distributed optimizer
``slamb``              the distributed SLAMB (its hooks, agreement and step)
``hook_exchange``      its exchange tensor by tensor, from the gradient hooks
``flat_exchange``      its exchange of flat buckets on a device, from DDP's bucket hooks
``onebit``             the distributed 1-bit LAMB
``topk``               top-k gradient exchange with error feedback under any optimizer
``slamb_exchange``     the distributed SLAMB's exchange of a step, in hooks, deferred and flat modes
``collectives``        :class:`TorchCollectives` (the distributed optimizers' collectives)
``ddp_misuse``         the silent misuses under DDP, refused at the first step
=====================  =========================================================================
"""
