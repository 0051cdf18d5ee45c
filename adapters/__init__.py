"""Thin adapters that plug slamb_comm into training frameworks (installed as ``slamb_comm.adapters``).

Each adapter imports its framework only when imported itself, so ``import slamb_comm``
stays free of torch and horovod.

* :mod:`slamb_comm.adapters.horovod` -- Horovod + PyTorch: ``SLAMB``, ``TopK``, ``DistributedOptimizer``
  (a drop-in for ``hvd.DistributedOptimizer``) and ``HorovodTransport``.
"""
