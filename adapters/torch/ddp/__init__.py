"""DDP communication hooks, each beside its state, as ``torch.distributed.algorithms.ddp_comm_hooks``.

=====================  =========================================================================
module                 what it holds
=====================  =========================================================================
``slamb_hook``         :func:`slamb_hook` and :class:`SlambHookState` (SLAMB's exchange from DDP's buckets)
``topk_hook``          :func:`topk_hook` and :class:`TopKHookState` (top-k for any optimizer)
=====================  =========================================================================
"""
