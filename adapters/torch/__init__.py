"""PyTorch adapter: SLAMB, 1-bit LAMB and sparse top-k exchange for torch, on torch.distributed (torchrun, DDP).

Everything torch-level lives in this package, once, whatever launches the job. This file only
re-exports; each concern has its own module:

=========================  ===================================================================
module                     what it holds
=========================  ===================================================================
``slamb``                  :class:`SLAMB`, the torch optimizer (alone: P = 1; ratio 1: LAMB)
``options``                SLAMB's options: a group's checks, the records its buckets are keyed by
``onebit_lamb``            :class:`OneBitLAMB`, 1-bit LAMB as a torch optimizer
``distributed``            :func:`DistributedOptimizer` (torchrun without DDP) and ``wrap``,
                           which builds a distributed optimizer on any collectives
``distributed_slamb``      the distributed SLAMB's hooks, exchange and step
``distributed_onebit``     the distributed 1-bit LAMB's agreement and step
``distributed_topk``       top-k gradient exchange with error feedback under any optimizer
``hook_exchange``          the distributed SLAMB's exchange tensor by tensor, from the hooks
``flat_exchange``          its exchange of flat buckets on a device, from DDP's bucket hooks
``flat``                   a bucket's parameters as one flat buffer, gradients read in place
``contract``               Horovod's optimizer contract, shared by the three above
``ddp_hooks``              :func:`slamb_hook` / :class:`SlambHookState`, :func:`topk_hook` /
                           :class:`TopKHookState` (DDP communication hooks)
``collectives``            :class:`TorchTransport` (the core's transport on torch.distributed)
                           and the distributed optimizers' collectives
``tensors``                torch tensors as the core's arrays: dtypes, views, CUDA streams
``params``                 parameter naming, change checks, state mapping, buckets
``rank_files``             per-rank state files beside a framework's checkpoint, resized
                           for another number of ranks (Lightning, the Trainer, Accelerate)
``averaging``              :func:`averaged_state_dict` (the mean of the replicas, for saving)
                           and :func:`traffic_metrics` (a step's bytes as logger metrics)
``periodic``               :class:`DiLoCo`, :class:`DesLoc` and their base ``OuterLoop``
                           (periodic averaging around any torch optimizer)
``sparseloco``             :class:`SparseLoCo`, :class:`SharedMaskSparseLoCo`, :class:`SharedTopKSparseLoCo`
``demo``                   :class:`DeMo`, the DCT top-k momentum optimizer
``fsdp``                   :class:`HybridSLAMB`, :class:`HybridSAdamW`: SLAMB and SAdamW across
                           the replicas of an FSDP2-sharded model (HSDP's ``(replicate, shard)`` mesh)
``hybrid_topk``            :class:`HybridTopK`: top-k with error feedback across those replicas,
                           around any torch optimizer (``DiLoCo``/``DesLoc`` take ``mesh=`` too)
=========================  ===================================================================

* :class:`SLAMB` -- a ``torch.optim.Optimizer``. Alone, in one process, it is the SLAMB rule
  with P = 1 (with ``ratio=1`` exactly LAMB); wrapped by a ``DistributedOptimizer`` (this
  package's, or Horovod's in :mod:`slamb_comm.adapters.horovod`) it is SLAMB over all ranks.
* :class:`OneBitLAMB` -- 1-bit LAMB (docs/onebit_lamb.md), likewise.
* :class:`TorchTransport` -- slamb_comm's transport protocol on ``torch.distributed``.
* :func:`DistributedOptimizer` -- for ``torchrun`` without DDP: ``DistributedOptimizer(SLAMB(...))``
  or ``DistributedOptimizer(torch.optim.Adam(...), compression=slamb_comm.TopK(0.01))``.
* DDP communication hooks: :func:`slamb_hook` with :class:`SlambHookState` (a stock DDP
  script changes two lines)::

        opt = slamb_comm.adapters.torch.DistributedOptimizer(
            slamb_comm.adapters.torch.SLAMB(ddp.parameters(), lr=1e-3, ratio=0.1),
            named_parameters=ddp.module.named_parameters())
        ddp.register_comm_hook(slamb_comm.adapters.torch.SlambHookState(opt), slamb_comm.adapters.torch.slamb_hook)

  and :func:`topk_hook` with :class:`TopKHookState`: top-k with error feedback for any optimizer.
  ``SlambHookState()`` can be registered first and ``bind(optimizer)`` later, for frameworks that
  wrap the model in DDP before building the optimizer. A SLAMB or top-k ``DistributedOptimizer``
  whose parameters sit in a DDP module without slamb_comm's hook, or a hook state DDP never
  called, raises at the first ``step()``, naming the fix.

* :func:`averaged_state_dict` -- ``averaged_state_dict(model, group=None)``: the model to save,
  the float64 mean of the ranks' replicas (SLAMB's, SAdamW's, DiLoCo's and DES-LOC's differ
  between syncs), called on every rank; the live model and optimizer are not touched.

Data types: bfloat16 and float16 parameters are updated through float32 state and cast back;
the exchange is float32 or float16 per ``value_dtype``.
"""

from slamb_comm.wire.codecs import TopK

from .averaging import averaged_state_dict, traffic_metrics
from .collectives import TorchTransport, init_process_group
from .demo import DeMo
from .ddp_hooks import SlambHookState, TopKHookState, slamb_hook, topk_hook
from .distributed import DistributedOptimizer
from .fsdp import HybridSAdamW, HybridSLAMB
from .hybrid_topk import HybridTopK
from .onebit_lamb import OneBitLAMB
from .periodic import DesLoc, DiLoCo
from .slamb import LAMB, SLAMB, SAdamW
from .sparseloco import SharedMaskSparseLoCo, SharedTopKSparseLoCo, SparseLoCo

__all__ = ["SLAMB", "SAdamW", "LAMB", "OneBitLAMB", "TopK", "TorchTransport", "DistributedOptimizer", "SlambHookState",
           "slamb_hook", "TopKHookState", "topk_hook", "init_process_group", "DeMo", "DiLoCo", "DesLoc",
           "averaged_state_dict", "traffic_metrics", "SparseLoCo", "SharedMaskSparseLoCo", "SharedTopKSparseLoCo",
           "HybridSLAMB", "HybridSAdamW", "HybridTopK"]
