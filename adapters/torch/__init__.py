"""PyTorch adapter: SLAMB, 1-bit LAMB and sparse top-k exchange for torch, on torch.distributed (torchrun, DDP).

Everything torch-level lives in this package, once, whatever launches the job. This file only
re-exports; each concern has its own folder or module:

=========================  ===================================================================
folder or module           what it holds
=========================  ===================================================================
``optim/``                 the torch optimizers: :class:`SLAMB`, :class:`SAdamW`, :class:`LAMB`,
                           :class:`OneBitLAMB` on their buckets of parameters, and :class:`DeMo`
``distributed/``           :func:`DistributedOptimizer` (torchrun without DDP) and the distributed
                           optimizers on any framework's collectives (Horovod's contract, the
                           distributed SLAMB, 1-bit LAMB and top-k, the misuses under DDP)
``ddp/``                   the DDP communication hooks with their states: :func:`slamb_hook` /
                           :class:`SlambHookState`, :func:`topk_hook` / :class:`TopKHookState`
``fsdp/``                  models sharded by FSDP2 (HSDP's ``(replicate, shard)`` mesh):
                           :class:`HybridSLAMB`, :class:`HybridSAdamW`, :class:`HybridTopK`
``periodic/``              wrappers that own any torch optimizer and average periodically:
                           :class:`DiLoCo`, :class:`DesLoc`, the SparseLoCo family (``mesh=`` too)
``transport``              :class:`TorchTransport` (the core's transport on torch.distributed) and
                           :func:`init_process_group`
``tensors``                torch tensors as the core's arrays: dtypes, views, CUDA streams
``params``                 parameter naming, change checks, saved-state mapping, the closure
``averaging``              :func:`averaged_state_dict` (the mean of the replicas, for saving)
                           and :func:`traffic_metrics` (a step's bytes as logger metrics)
``rank_files``             per-rank state files beside a framework's checkpoint, resized
                           for another number of ranks (Lightning, the Trainer, Accelerate)
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
from .ddp.slamb_hook import SlambHookState, slamb_hook
from .ddp.topk_hook import TopKHookState, topk_hook
from .distributed.optimizer import DistributedOptimizer
from .fsdp.hybrid_slamb import HybridSAdamW, HybridSLAMB
from .fsdp.hybrid_topk import HybridTopK
from .optim.demo import DeMo
from .optim.onebit_lamb import OneBitLAMB
from .optim.slamb import LAMB, SLAMB, SAdamW
from .periodic.diloco import DesLoc, DiLoCo
from .periodic.sparseloco import SharedMaskSparseLoCo, SharedTopKSparseLoCo, SparseLoCo
from .transport import TorchTransport, init_process_group

__all__ = ["SLAMB", "SAdamW", "LAMB", "OneBitLAMB", "TopK", "TorchTransport", "DistributedOptimizer", "SlambHookState",
           "slamb_hook", "TopKHookState", "topk_hook", "init_process_group", "DeMo", "DiLoCo", "DesLoc",
           "averaged_state_dict", "traffic_metrics", "SparseLoCo", "SharedMaskSparseLoCo", "SharedTopKSparseLoCo",
           "HybridSLAMB", "HybridSAdamW", "HybridTopK"]
