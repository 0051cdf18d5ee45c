"""Thin adapters that plug slamb_comm into training frameworks (installed as ``slamb_comm.adapters``).

Each adapter imports its framework only when imported itself, so ``import slamb_comm``
stays free of torch and horovod. One module per framework:

* :mod:`slamb_comm.adapters.torch` -- PyTorch: the ``SLAMB`` optimizer, ``TorchTransport`` on
  torch.distributed, ``DistributedOptimizer`` for torchrun jobs, and the DDP communication
  hooks ``slamb_hook`` / ``topk_hook`` with their states.
* :mod:`slamb_comm.adapters.horovod` -- Horovod: ``HorovodTransport`` and ``DistributedOptimizer``
  (a drop-in for ``hvd.DistributedOptimizer``), on the torch adapter's optimizers.
* :mod:`slamb_comm.adapters.lightning` -- PyTorch Lightning: ``SlambDDPStrategy`` (the hook on
  every device type, the SLAMB optimizer bound, per-rank checkpoint state).
* :mod:`slamb_comm.adapters.huggingface` -- Hugging Face: ``SlambTrainer`` for ``transformers.Trainer``
  and ``install()`` after ``accelerator.prepare``, with per-rank checkpoint state.

docs/integrations.md shows the change to a stock script for each. :mod:`slamb_comm.adapters.privates`
lists every private attribute of a framework that the adapters touch, each with why (nothing else
in the adapters touches another object's private attribute).
"""
