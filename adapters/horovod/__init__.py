"""Horovod + PyTorch adapter: SLAMB and sparse top-k exchange behind Horovod's optimizer API.

A Horovod PyTorch script changes one line::

    # before
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    # after: SLAMB (momentum exchanged on a shared random mask, ICML 2023)
    opt = slamb_comm.adapters.horovod.DistributedOptimizer(
        slamb_comm.adapters.horovod.SLAMB(model.parameters(), lr=1e-3, ratio=0.1),
        named_parameters=model.named_parameters())
    # or: keep your optimizer, exchange top-k gradients with error feedback
    opt = slamb_comm.adapters.horovod.DistributedOptimizer(
        torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
        compression=slamb_comm.TopK(0.01))

Everything else in the script (``hvd.init()``, ``hvd.broadcast_parameters``,
``hvd.broadcast_optimizer_state``, ``synchronize()`` / ``skip_synchronize()`` for gradient
clipping, ``backward_passes_per_step``, lr schedulers) stays as it was.

What this module holds:

* :class:`HorovodTransport` -- slamb_comm's transport protocol (allreduce, allgather,
  alltoall, broadcast, barrier) on Horovod's public collectives, so a
  :class:`slamb_comm.Communicator` can run inside a Horovod job.
* :class:`SLAMB` -- the torch optimizer of :mod:`slamb_comm.adapters.torch`, re-exported:
  alone it is a correct single-process optimizer (ratio 1: LAMB), wrapped by
  :func:`DistributedOptimizer` it is SLAMB.
* :class:`SAdamW` -- SLAMB's exchange under AdamW's update, likewise re-exported.
* :class:`LAMB` -- dense LAMB, the baseline: ``DistributedOptimizer(LAMB(...))`` is Horovod's own
  dense gradient allreduce under LAMB's step.
* :class:`OneBitLAMB` -- 1-bit LAMB, likewise re-exported from :mod:`slamb_comm.adapters.torch`.
* :class:`TopK` -- a ``compression=`` value selecting the error-feedback top-k gradient
  exchange (docs/algorithm.md section 2) for any optimizer.
* :func:`DistributedOptimizer` -- the drop-in for ``hvd.DistributedOptimizer``: the
  distributed optimizers of :mod:`slamb_comm.adapters.torch` on Horovod's collectives.
* :func:`averaged_state_dict` -- the model to save: the float64 mean of the ranks' replicas
  (SLAMB's differ between its periodic syncs), called on every rank; the live model is not touched.
* Elastic Horovod: under ``horovodrun --min-np/--max-np/--host-discovery-script`` the SLAMB and
  TopK optimizers are built for their worker alone, and Horovod's own
  ``hvd.elastic.TorchState(model=..., optimizer=...)`` syncs them at every reset through its
  public handler registry: communicators rebuilt for the new world, state made by
  docs/algorithm.md section 10's rule from the workers that held one (:func:`_elastic_sync`).

Everything torch-level (the SLAMB optimizer, dtype handling, the distributed optimizers'
hooks and steps) lives in :mod:`slamb_comm.adapters.torch`; this module holds only what is
Horovod's. Only Horovod's public API is used (``allreduce_async_``, ``allgather``,
``alltoall``, ``broadcast_``, ``synchronize``, ``Average``/``Sum``, ``Compression``);
Horovod's optimizer is neither copied nor patched. Like Horovod, the distributed optimizer
is a class built at run time from the user's class: ``type(name, (mixin, optimizer.__class__), ...)``, so
``isinstance(opt, torch.optim.Adam)`` still holds.

Data types: Horovod's collectives carry no bfloat16 and no bool. bfloat16 (and float16)
parameters and gradients are converted to float32 for the exchange and for SLAMB's
optimizer state (moments and freshness are kept in float32); results are cast back to the
parameter's dtype. With Horovod's own compressions, bfloat16 gradients are sent as float32
(or float16 with ``hvd.Compression.fp16``) and cast back.

**The contract** of ``DistributedOptimizer`` (:mod:`.optimizer`) for SLAMB, 1-bit LAMB and TopK:
unnamed, duplicate or non-tuple ``named_parameters`` raise ``ValueError``; every rank submits
every tensor (zeros for a parameter without a gradient); ``synchronize()`` / ``skip_synchronize()``,
``zero_grad()``, ``backward_passes_per_step``, ``hvd.broadcast_parameters`` and
``hvd.broadcast_optimizer_state`` work (Horovod recognises the result as one of its own
distributed optimizers, so a rank without state creates it with the wrapped optimizer's
own local step, never with collectives that only some ranks would start); ``hvd.join()``
and ``process_set=`` work as the README's Horovod table says. ``groups`` / ``num_groups`` are accepted and
ignored there (slamb_comm fuses each bucket itself); sparse gradients are exchanged
dense (as with ``sparse_as_dense=True``). bfloat16 is exchanged as float32: Horovod's
collectives carry no bfloat16 or bool.

Under Elastic Horovod (``HOROVOD_ELASTIC=1``, set by ``horovodrun --min-np/--max-np``):
SLAMB and TopK work with ``hvd.elastic.TorchState`` (docs/algorithm.md section 10, Elastic
Horovod); 1-bit LAMB and ``process_set=`` raise at construction.

``abort_on_exception`` (slamb_comm's): an exception nobody catches on one rank ends that
process at once (after printing it), without Horovod's shutdown, so that the launcher
(horovodrun, mpirun) ends the whole job within seconds, as the core's MPI transport does with
``MPI_Abort``. Why: with Horovod 0.28.1, a rank that exits normally while another is still
launching allreduces can deadlock that rank (its background thread, shutting down, holds the
process-set mutex and waits for the GIL; the main thread holds the GIL and waits for that
mutex), and the job hangs until an outer timeout; seen here in 1 of 12 to 2 of 12 runs of a
2-rank job whose rank 1 raises, and in none of 30 with this hook. ``False`` leaves
``sys.excepthook`` alone.

Modules, as ``horovod/torch`` lays out its own: :mod:`.transport` (the core's transport on Horovod),
:mod:`.collectives` (the distributed optimizers' collectives on Horovod), :mod:`.compression`
(bfloat16 under Horovod's own compressions), :mod:`.optimizer` (``DistributedOptimizer``,
``averaged_state_dict``), :mod:`.elastic` (Elastic Horovod's resets).
"""

from slamb_comm.wire.codecs import TopK

from ..torch import LAMB, SLAMB, OneBitLAMB, SAdamW

from .optimizer import DistributedOptimizer, averaged_state_dict
from .transport import HorovodTransport

__all__ = ["HorovodTransport", "SLAMB", "SAdamW", "LAMB", "OneBitLAMB", "TopK", "DistributedOptimizer",
           "averaged_state_dict"]
