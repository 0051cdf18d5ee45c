"""``DistributedOptimizer``: the drop-in for ``hvd.DistributedOptimizer`` (see the package's
docstring for the contract it keeps), and :func:`averaged_state_dict`."""

import itertools
import os
import sys

import torch

import horovod.torch as hvd

from slamb_comm.wire.codecs import TopK

from ..privates import exit_now
from ..torch import LAMB, SLAMB, OneBitLAMB
from ..torch.averaging import ReplicaGroup, mean_of_replicas
from ..torch.distributed.optimizer import wrap
from ..torch.params import check_named_parameters

from .collectives import AloneUntilSynced, HorovodCollectives
from .compression import Bf16Safe
from .elastic import ELASTIC_METHODS, make_elastic

__all__ = ["DistributedOptimizer", "averaged_state_dict"]


def DistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=hvd.global_process_set,
                         grad_scaler=None, abort_on_exception=True):
    """A drop-in for ``hvd.DistributedOptimizer`` (same arguments) with slamb_comm's exchanges.

    * ``optimizer`` is a :class:`SLAMB` (or SAdamW): SLAMB over all ranks, the masked momentum
      launched from each parameter's gradient hook and finished in ``step()``; ``op`` must be
      ``hvd.Average``; ``compression=hvd.Compression.fp16`` means ``value_dtype='float16'``.
    * ``optimizer`` is a :class:`OneBitLAMB`: 1-bit LAMB, exchanged in ``step()``.
    * ``compression`` is a :class:`TopK`: any optimizer; the gradients go through the
      error-feedback top-k exchange of docs/algorithm.md section 2 (``op=hvd.Sum``: the sum).
    * otherwise (``LAMB``, the dense baseline, included): Horovod's own ``hvd.DistributedOptimizer``,
      with bfloat16 gradients sent as float32.

    ``grad_scaler`` (with a TopK compression under Horovod's AMP idiom) keeps the error buffers
    in unscaled units; ``abort_on_exception`` ends a rank's process at an uncaught exception so
    that the launcher ends the job (the package docstring says why). The result is an instance of
    a class built like Horovod's, from the optimizer's class; use it from then on."""
    kind = _kind(optimizer, compression, grad_scaler, op, gradient_predivide_factor, backward_passes_per_step)
    if kind is None:
        return _horovods_own(optimizer, named_parameters, compression, backward_passes_per_step, op,
                             gradient_predivide_factor, groups if groups is not None else num_groups or None,
                             sparse_as_dense, process_set)
    elastic = os.environ.get("HOROVOD_ELASTIC") == "1"  # set by horovodrun --min-np/--max-np/--host-discovery-script
    _check_elastic(kind, elastic, process_set)
    names = check_named_parameters(named_parameters, optimizer.param_groups)
    if kind != "topk" and compression is hvd.Compression.fp16:
        for g in optimizer.param_groups:
            g["value_dtype"] = "float16"
    # Under Elastic Horovod the optimizer is built for this rank alone: building it for the world is
    # collective, and a worker that joins builds while the others are in the reset's broadcasts.
    # It joins the world at TorchState's sync (or its first step): see elastic.sync.
    coll = AloneUntilSynced(process_set) if elastic else HorovodCollectives(process_set)
    dist = wrap(optimizer, names, compression, backward_passes_per_step, coll, sum_op=op == hvd.Sum,
                gradient_predivide_factor=gradient_predivide_factor, grad_scaler=grad_scaler,
                methods=ELASTIC_METHODS if elastic else None)
    dist.op, dist.process_set = op, process_set
    if elastic:
        make_elastic(dist)
    if abort_on_exception:
        _end_job_on_uncaught_exception()
    return dist


def _kind(optimizer, compression, grad_scaler, op, gradient_predivide_factor, backward_passes_per_step):
    """'slamb', 'onebit' or 'topk' (slamb_comm's exchanges), or None (Horovod's own), after the
    checks of the arguments that do not depend on Elastic Horovod."""
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    onebit = isinstance(optimizer, OneBitLAMB)
    slamb = isinstance(optimizer, SLAMB) and not isinstance(optimizer, LAMB)  # LAMB: dense, Horovod's own
    topk = isinstance(compression, TopK)
    if not (slamb or onebit or topk):
        if grad_scaler is not None:
            raise ValueError("grad_scaler= is for slamb_comm's top-k exchange; hvd.DistributedOptimizer takes none")
        return None
    if onebit and compression is not hvd.Compression.none:
        raise ValueError("OneBitLAMB compresses momenta to 1 bit itself: pass no compression")
    if slamb and topk:
        raise ValueError("SLAMB exchanges masked momentum; a TopK compression cannot be combined with it "
                         "(use SLAMB(mask='topk') for a top-k mask)")
    if (slamb or onebit) and op != hvd.Average:
        raise ValueError(f"{type(optimizer).__name__} averages momenta: op must be hvd.Average")
    if topk and op not in (hvd.Average, hvd.Sum):
        raise ValueError("TopK exchange supports op=hvd.Average or hvd.Sum")
    return "onebit" if onebit else "slamb" if slamb else "topk"


def _check_elastic(kind, elastic, process_set):
    if elastic and kind == "onebit":
        raise RuntimeError(
            "OneBitLAMB does not support Elastic Horovod: its server errors are cut into one chunk per rank, and a "
            "worker that leaves takes its chunk with it. Use SLAMB or a TopK compression under Elastic Horovod, or "
            "torchrun --max-restarts with slamb_comm.methods.checkpoint, whose load re-chunks them (docs/algorithm.md "
            "section 10)")
    if elastic and process_set is not hvd.global_process_set:
        raise ValueError("under Elastic Horovod slamb_comm's distributed optimizers run on all ranks: pass no "
                         "process_set (Horovod's process sets do not survive a reset either)")


def _horovods_own(optimizer, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                  groups, sparse_as_dense, process_set):
    """``hvd.DistributedOptimizer`` itself, bfloat16 gradients sent as float32 (Horovod has no bf16)."""
    if any(p.dtype == torch.bfloat16 for g in optimizer.param_groups for p in g["params"]):
        compression = Bf16Safe(compression)
    return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters, compression=compression,
                                    backward_passes_per_step=backward_passes_per_step, op=op,
                                    gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                                    sparse_as_dense=sparse_as_dense, process_set=process_set)


# ---------------------------------------------------------------------------- the saved model
def averaged_state_dict(model, process_set=hvd.global_process_set):
    """The mean of the ranks' replicas of ``model``: the state dict to save, evaluate or ship.

    Horovod's counterpart of :func:`slamb_comm.adapters.torch.averaged_state_dict` (which says
    what it returns): SLAMB's, SAdamW's, DiLoCo's and DES-LOC's replicas differ between their
    periodic syncs, and ``model.state_dict()`` on rank 0 is one replica. Collective: every rank of
    ``process_set`` calls it (a model that differs between the ranks raises ``ValueError`` on
    every rank)::

        state = slamb_comm.adapters.horovod.averaged_state_dict(model)
        if hvd.rank() == 0:
            torch.save(state, "model.pt")

    Floating-point entries are the float64 mean (Horovod's ``Sum`` over the set, divided by its
    size) cast back to their dtype, in new tensors; the model and optimizer are not touched, so
    every rank's own ``state_dict()``, saved beside it, still resumes the run bitwise. A rank
    outside ``process_set``, or a set of one rank, gets a copy of its own state.
    """
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    if not process_set.included() or process_set.size() == 1:
        return mean_of_replicas(state, None)
    names = itertools.count()

    def reduce(t):
        return hvd.allreduce(t, op=hvd.Sum, name=f"slamb_comm.averaged_state_dict.{next(names)}",
                             process_set=process_set)

    def gather(t):
        return hvd.allgather(t.view(1, -1), name="slamb_comm.averaged_state_dict.layout", process_set=process_set)

    return mean_of_replicas(state, ReplicaGroup(int(process_set.size()), reduce, gather))


_EXIT_HOOK = []


def _end_job_on_uncaught_exception():
    """Once per process: an uncaught exception is printed, then the process ends with
    ``os._exit(1)`` (no atexit handlers, no Horovod shutdown); see ``abort_on_exception``."""
    if _EXIT_HOOK:
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
        finally:
            try:
                rank = hvd.rank()
            except Exception:  # noqa: BLE001 -- Horovod not initialised any more: say so, end anyway
                rank = "?"
            sys.stderr.write(f"slamb_comm: uncaught {kind.__name__} on Horovod rank {rank}; ending this process "
                             "now (os._exit(1)) so that the launcher ends the job\n")
            sys.stderr.flush()
            sys.stdout.flush()
            exit_now(1)

    sys.excepthook = hook
    _EXIT_HOOK.append(hook)
