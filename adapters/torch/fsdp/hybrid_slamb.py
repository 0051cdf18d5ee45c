"""SLAMB across the replicas of a model sharded by FSDP2: dense inside a shard group, sparse between
replicas (HSDP's layout, with SLAMB's exchange where HSDP's gradient allreduce was).

HSDP runs on a 2-D mesh ``(replicate, shard)``: FSDP2 reduce-scatters each gradient inside a shard
group (fast links) and all-reduces every gradient piece across the replicas (the slow links between
nodes). :class:`HybridSLAMB` keeps the first and replaces the second: shard the model over the
mesh's ``"shard"`` dimension only, so FSDP2 does no replica allreduce, and the optimizer exchanges
the momentum of each rank's pieces with their replicas, sparsely::

    mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh["shard"])      # HSDP would pass mesh=mesh
    fully_shard(model, mesh=mesh["shard"])
    opt = HybridSLAMB(model, mesh, lr=..., ratio=0.1)

What it computes is SLAMB at R ranks on the whole tensors (docs/algorithm.md section 15): each
rank's mask is the unsharded mask restricted to its pieces, the trust ratios are the whole tensors'
(four squared norms per tensor summed over the shard group), ``P`` is R, the periodic sync
averages each piece over its replicas. At construction every piece is broadcast from replica 0
(DDP's rule: replicas start equal).

Supported: a 2-D mesh (replicas, pieces) and parameters that ``fully_shard`` cut on dimension 0
over its second dimension. Pure FSDP (a 1-D mesh: no replicas, nothing to exchange), parameters
sharded over the whole 2-D mesh (FSDP2's own dense replica allreduce), other placements
(``shard_placement_fn``, tensor parallel) and other mesh shapes raise a ConfigError naming this.
CUDA pieces step by the core's device kernels, read where FSDP2 keeps them; CPU pieces tensor by
tensor, where ``overlap=True`` starts each FSDP module's exchange during the backward pass
(:mod:`.overlap`; off by default: on the 2-core emulation it shortened the step only on a slow
link, 100 Mbit/s; benchmarks/RESULTS.md). Checkpoints: :meth:`HybridSLAMB.state_dict` for
``torch.distributed.checkpoint``, and :meth:`HybridSLAMB.prepare_load` to resume at another replica
count (:mod:`.state`).
"""

import torch
import torch.distributed as dist

from slamb_comm.errors import ConfigError
from slamb_comm.wire.stats import Traffic, allreduce_wire

from ..distributed.contract import nonfinite_error
from ..optim.slamb import SLAMB
from ..params import run_closure
from .mesh import BackwardWatch, MeshSharding
from .overlap import FsdpOverlap, OptimizerSide
from .state import read_plan, state_dict_to_load, state_dict_to_save, warn_between_syncs

__all__ = ["HybridSLAMB", "HybridSAdamW"]


class HybridSLAMB(SLAMB):
    """SLAMB for a model sharded by FSDP2 over the ``"shard"`` dimension of a ``(replicate, shard)``
    mesh: the momentum exchange runs over the replicas of each rank's pieces (see the module's
    docstring).

    Args:
        params: the sharded model (its parameters, and its FSDP modules are watched: see
            :class:`BackwardWatch`), or parameters / parameter groups with ``model=`` the model.
        mesh: the 2-D DeviceMesh; ``replicate``/``shard``: its dimensions' names.
        model: the root module ``fully_shard`` sharded, when ``params`` is not that module.
        overlap: True: start each FSDP module's momentum exchange during the backward pass, as soon
            as FSDP2 hands its gradient pieces (:mod:`.overlap`, on the CPU's tensor-by-tensor
            path; it pays on slow links); False (default): the whole exchange in ``step()``.

    Every other argument is :class:`SLAMB`'s (``mask='cyclic'``, ``block=1``). ``fused``: None (the
    default) steps CUDA pieces by the core's device kernels (read where FSDP2 keeps them, through
    tables of addresses; docs/algorithm.md section 15) and CPU pieces tensor by tensor; False
    always tensor by tensor; True the kernels wherever the pieces are device arrays.
    """

    def __init__(self, params, mesh, *args, model=None, replicate="replicate", shard="shard", overlap=False,
                 **kwargs):
        if isinstance(params, torch.nn.Module):
            model, params = params, params.parameters()
        if model is None:
            raise ConfigError("HybridSLAMB needs the sharded model, so that every rank agrees on a non-finite "
                              "gradient before step(): HybridSLAMB(model, mesh, ...), or HybridSLAMB(param_groups, "
                              "mesh, model=model, ...)")
        sharding = MeshSharding(mesh, replicate, shard)
        params = list(params)
        flat = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
        names = {id(p): n for n, p in model.named_parameters()}
        for p in flat:  # every refusal before any collective
            sharding.piece(p, names.get(id(p), f"of shape {list(p.shape)}"))
        sharding.broadcast([p for p in flat if p.requires_grad])
        self._model, self._load_plan, self._warned_between_syncs = model, None, False
        self.overlap = FsdpOverlap(model, sharding, OptimizerSide(lambda: self.ready_buckets, lambda e: e.lr_wd(), self.publish),
                                   enabled=overlap)
        self.watch = BackwardWatch(model, sharding, flat, after=self.overlap.end_of_backward)
        super().__init__(params, *args, transport=sharding.replicas, names=names, sharding=sharding, build=False,
                         **kwargs)
        sharding.agree_problem(self.problem)  # an invalid option on some rank: an error on every rank of the mesh
        self.rebuild_buckets()
        self.overlap.ready(self.ready_buckets)

    @torch.no_grad()
    def step(self, closure=None):
        """One SLAMB step on every rank's pieces. A parameter whose gradient is None on some ranks and
        not others counts as a zero gradient there (Horovod's rule); None everywhere: left as it is.

        One agreement over the whole mesh (its replicas, then its pieces) says which gradients exist
        and, with the overlap, whether every rank can use the exchange it started during the backward
        pass (else every rank drops it and exchanges here, from the gradients as they are:
        :mod:`.overlap`)."""
        loss = run_closure(closure)
        self.watch.agree()  # a reduce-scatter outside a backward pass (rare): its decision now
        nonfinite, self.watch.ranks = self.watch.ranks, []  # the ranks whose gradients were not: every rank alike
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        word = self.overlap.conclude(self.ready_buckets, self.state)  # None: no overlap, no word
        agreed = torch.tensor([float(p.grad is not None) for p in params] + ([] if word is None else [float(word)]),
                              dtype=torch.float64)
        if agreed.numel():  # over the whole mesh: its replicas, then its pieces
            dist.all_reduce(agreed, group=self.sharding.replicas_group)
            dist.all_reduce(agreed, group=self.sharding.pieces_group)
        counts = agreed.tolist()
        have = {p: n > 0 for p, n in zip(params, counts)}
        for p in params:
            if p.grad is None and have[p]:
                p.grad = torch.zeros_like(p)
        self._count_control(agreed.numel() * agreed.element_size())
        if self.overlap.decide(word is not None and counts[-1] > 0) and not nonfinite:
            self.overlap.apply(have)
        else:
            self.overlap.abandon()
            if nonfinite:  # every rank's pieces are NaN now: the step is skipped here, naming the ranks
                self._skip_nonfinite(nonfinite)
            else:
                super().step()
        self.overlap.ready(self.ready_buckets)
        return loss

    def _skip_nonfinite(self, ranks):
        """The step that the agreement at the end of the backward pass found not finite on ``ranks`` (global),
        skipped on every rank alike (logged and counted), or raised with ``on_nonfinite='raise'``."""
        err = nonfinite_error(type(self).__name__, ranks, [], "every rank's gradient pieces were set to NaN and the "
                              "step is skipped on every rank, with no state changed")
        if any(e.rule.on_nonfinite == "raise" for e in self.buckets):
            raise err
        self.ledger.skip(err)

    def _count_control(self, nbytes):
        """The step's small agreements across the replicas (which gradients exist; the end-of-backward
        word) in the first bucket's statistics, kind ``"control"``: so :meth:`step_traffic` counts
        every byte that crosses the replicas."""
        nbytes += self.watch.take_bytes()
        comms = self.communicators
        if nbytes and comms:
            R = self.sharding.R
            comms[0].stats.record("control", Traffic.one_call(
                payload_bytes=nbytes, wire_bytes=allreduce_wire(nbytes, R), dense_bytes=0, size=R,
                elements_sent=nbytes // 8, elements_total=0))

    def state_dict(self):
        """This rank's state; each parameter's ``exp_avg``, ``exp_avg_sq`` and ``freshness`` as a
        DTensor of shape ``(R, *parameter shape)`` whose row r is replica r's (they differ between
        replicas), so that ``torch.distributed.checkpoint`` (``get_optimizer_state_dict``, ``dcp.save``)
        keeps all of them and a resume at the same mesh is bitwise. A ``torch.save`` per rank works too.
        Once after :meth:`prepare_load`: the form DCP loads that checkpoint into."""
        plan, self._load_plan = self._load_plan, None
        sd = state_dict_to_save(self, super().state_dict(), self.sharding, plan)
        if plan is None and not self._warned_between_syncs:
            self._warned_between_syncs = warn_between_syncs(self, self.sharding)
        return sd

    def prepare_load(self, checkpoint_id=None, storage_reader=None):
        """Before resuming from a ``torch.distributed.checkpoint`` of another replica count (call it on
        every rank, before ``get_optimizer_state_dict``): reads the checkpoint's metadata, so that the
        next :meth:`state_dict` is the state dict DCP loads it into, and :meth:`load_state_dict` then
        applies docs/algorithm.md section 10's rule (section 15.3). Harmless at the same mesh. Returns
        the :class:`~.state.LoadPlan`."""
        self._load_plan = read_plan(self._model, self, checkpoint_id, storage_reader)
        return self._load_plan

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output (the per-replica DTensors, or this rank's plain tensors); a
        checkpoint of another replica count by docs/algorithm.md section 10's rule (section 15.3). An
        exchange started by a backward pass since the last step is dropped."""
        self.overlap.abandon()
        super().load_state_dict(state_dict_to_load(self, state_dict, self.sharding, self.names))


class HybridSAdamW(HybridSLAMB):
    """:class:`~slamb_comm.adapters.torch.SAdamW` (SLAMB's exchange under AdamW's update) for a model
    sharded by FSDP2, as :class:`HybridSLAMB` (no norms cross the shard group: its ratios are fixed)."""

    def __init__(self, params, mesh, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, beta3=0.9, **kwargs):
        for k in ("c_min", "c_max"):
            if k in kwargs:
                raise ConfigError(f"SAdamW has no trust ratio: {k} is fixed at 1 (use HybridSLAMB for LAMB's update)")
        super().__init__(params, mesh, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, beta3=beta3,
                         c_min=1.0, c_max=1.0, **kwargs)
