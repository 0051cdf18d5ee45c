"""SparseLoCo and its shared-mask variant as torch optimizers: any inner optimizer, over torch.distributed.

One line around the optimizer a script already has, and no DDP (each rank trains alone
between outer steps)::

    opt = slamb_comm.adapters.torch.SparseLoCo(torch.optim.AdamW(model.parameters(), lr=3e-4))
    opt = slamb_comm.adapters.torch.SharedMaskSparseLoCo(torch.optim.AdamW(model.parameters()))
    opt = slamb_comm.adapters.torch.SharedTopKSparseLoCo(torch.optim.AdamW(model.parameters()))

The rules are the core's, :class:`slamb_comm.methods.sparseloco.SparseLoCo` (per-rank chunk-wise top-k,
2-bit values, one all-gather per outer step) and :class:`slamb_comm.methods.sparseloco.SharedMaskSparseLoCo`
(the shared cyclic mask, one allreduce) and :class:`slamb_comm.methods.sparseloco.SharedTopKSparseLoCo`
(one rank's top-k positions, taking turns: a broadcast of offsets and one allreduce),
docs/algorithm.md section 14, run over
:class:`~slamb_comm.adapters.torch.transport.TorchTransport` (or alone when no process group is
initialised). As for DiLoCo (:mod:`.diloco`, whose wrapper this reuses): parameters are bucketed
by device and compute dtype, one core object per bucket; 16-bit parameters go through float32
copies, written back; ``state_dict()`` is the inner optimizer's plus a ``'periodic'`` entry with
each bucket's anchor and this rank's error accumulator; :meth:`step_traffic` gives the bytes.
"""


from slamb_comm.methods import sparseloco as core
from slamb_comm.methods.periodic import DEFAULT_INTERVAL

from .diloco import OuterLoop

__all__ = ["SparseLoCo", "SharedMaskSparseLoCo", "SharedTopKSparseLoCo"]


class SparseLoCo(OuterLoop):
    """SparseLoCo (Sarfi et al. 2025) around any torch optimizer (docs/algorithm.md section 14).

    Every rank steps its own ``optimizer`` (the inner one, e.g. AdamW) with no communication.
    Every ``sync_interval`` steps each rank folds its drift ``anchor - x`` into its error
    accumulator ``e = beta e + (anchor - x)``, sends each 4096-element chunk's ``topk`` largest
    entries of e at ``bits`` bits (12-bit offsets within the chunk, a float32 scale per chunk)
    in one all-gather, keeps the rest in e, and every rank sets its parameters to
    ``anchor - outer_lr * mean of the ranks' sparse updates``. Construction is collective:
    every rank's parameters are set to rank 0's. Do not wrap the model in DDP.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``).
        process_group: the group (default: the default group; alone when none is initialised).
        sync_interval: H (default 50). outer_lr: default 1.0. beta: the accumulator's decay (0.95).
        chunk, topk, bits: 4096, 64 (1.56% of each chunk), 2 (4, 8, or 32 for float32 values).

    Payload per outer step: ``cores[i].codec.nbytes`` per bucket (0.71% of a dense float32 step
    at the defaults); the wire per link grows as ``(P - 1)`` times it.
    """

    method = "SparseLoCo"

    def __init__(self, optimizer, process_group=None, sync_interval=DEFAULT_INTERVAL, outer_lr=1.0, beta=0.95,
                 chunk=4096, topk=64, bits=2):
        super().__init__(optimizer, process_group, lambda t, arrays, names: core.SparseLoCo(
            t, arrays, sync_interval=sync_interval, outer_lr=outer_lr, beta=beta, chunk=chunk, topk=topk, bits=bits,
            names=names))


class SharedMaskSparseLoCo(OuterLoop):
    """SparseLoCo's outer step with the shared cyclic mask instead of per-rank top-k
    (docs/algorithm.md section 14): one allreduce per outer step, whose payload and wire per
    link do not grow with the number of ranks.

    Args:
        optimizer, process_group, sync_interval, outer_lr, beta: as :class:`SparseLoCo`.
        ratio: the mask's density (default 1/64; each compressible element is sent once every
            ``ceil(1/ratio)`` outer steps). value_dtype: 'float16' (default) or 'float32'.
        seed: the mask's seed (default 0). dense_threshold: tensors with ndim <= 1 or fewer
            elements go whole every outer step (default 9000).
    """

    method = "SharedMaskSparseLoCo"

    def __init__(self, optimizer, process_group=None, sync_interval=DEFAULT_INTERVAL, outer_lr=1.0, beta=0.95,
                 ratio=1 / 64, value_dtype="float16", seed=0, dense_threshold=9000):
        super().__init__(optimizer, process_group, lambda t, arrays, names: core.SharedMaskSparseLoCo(
            t, arrays, sync_interval=sync_interval, outer_lr=outer_lr, beta=beta, ratio=ratio,
            value_dtype=value_dtype, seed=seed, dense_threshold=dense_threshold, names=names))


class SharedTopKSparseLoCo(OuterLoop):
    """SparseLoCo on shared top-k positions (docs/algorithm.md section 14.7): at each outer step
    one rank, taking turns, broadcasts the offsets of its chunk-wise top-k, and every rank sends
    its accumulator there in one allreduce. Payload and wire per link do not grow with the
    number of ranks.

    Args:
        optimizer, process_group, sync_interval, outer_lr, beta, chunk, topk: as :class:`SparseLoCo`.
        value_dtype: 'float16' (default) or 'float32': the allreduced values' dtype.
    """

    method = "SharedTopKSparseLoCo"

    def __init__(self, optimizer, process_group=None, sync_interval=DEFAULT_INTERVAL, outer_lr=1.0, beta=0.95,
                 chunk=4096, topk=64, value_dtype="float16"):
        super().__init__(optimizer, process_group, lambda t, arrays, names: core.SharedTopKSparseLoCo(
            t, arrays, sync_interval=sync_interval, outer_lr=outer_lr, beta=beta, chunk=chunk, topk=topk,
            value_dtype=value_dtype, names=names))
