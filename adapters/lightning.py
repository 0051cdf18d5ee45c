"""PyTorch Lightning adapter: :class:`SlambDDPStrategy`, DDP with slamb_comm's hook on every device.

The change to a stock Lightning script is the strategy (and, for SLAMB, the optimizer that
``configure_optimizers`` returns)::

    # SLAMB: configure_optimizers returns slamb_comm.adapters.torch.SLAMB(self.parameters(), lr=..., ratio=0.1)
    trainer = L.Trainer(strategy=slamb_comm.adapters.lightning.SlambDDPStrategy(), ...)
    # top-k with error feedback under your own optimizer (configure_optimizers unchanged):
    trainer = L.Trainer(strategy=SlambDDPStrategy(compression=slamb_comm.TopK(0.01)), ...)

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers comm hooks only when the device is
CUDA, and builds the optimizer after wrapping the model in DDP; this strategy registers
:func:`~slamb_comm.adapters.torch.slamb_hook` (or :func:`~slamb_comm.adapters.torch.topk_hook`)
on every device type, CPU included, and binds the SLAMB optimizer once ``configure_optimizers``
has returned it (wrapping a bare ``SLAMB`` in :func:`slamb_comm.adapters.torch.DistributedOptimizer`).

Checkpoints: Lightning writes rank 0's model and optimizer state. SLAMB's moments (and, between
periodic syncs, its parameters) and top-k's error buffers differ per rank, so every rank also
writes its own ``<checkpoint>.slamb_rank<r>`` file beside the checkpoint, and a resume loads it:
the resumed run is then the interrupted one (docs/integrations.md). Saved at another number of
ranks, every rank reads every old rank's file and resumes from the state docs/algorithm.md
section 10 makes of them (moments, error buffers and parameters averaged). Without those files
(a checkpoint from another strategy) every rank resumes from rank 0's state and a warning says
so: a valid run, not the interrupted one (docs/algorithm.md section 8).

The model in Lightning's checkpoint (its ``state_dict``, what ``load_from_checkpoint`` gives a
user to evaluate or ship) is the mean of the ranks' replicas, computed in float64 when the
checkpoint is saved (:func:`slamb_comm.adapters.torch.averaged_state_dict`): between SLAMB's
periodic syncs the replicas differ, and rank 0's alone is one replica, not the model the run
trained. The live model and the per-rank files keep each rank's own parameters, so a resume is
still the interrupted run.

Bytes: at every optimizer step the strategy reads the step's :class:`slamb_comm.Traffic` into
``strategy.last_traffic`` and logs it through the LightningModule's ``log`` (so to every logger
of the Trainer: TensorBoard, CSV, W&B) as ``slamb/payload_bytes``, ``slamb/wire_bytes``,
``slamb/of_dense`` and ``slamb/wire_of_dense`` (:func:`slamb_comm.adapters.torch.traffic_metrics`).

FSDP2 / HSDP: :class:`SlambModelParallelStrategy` is Lightning's ``ModelParallelStrategy`` on a
``(replicate, shard)`` mesh for :class:`slamb_comm.adapters.torch.HybridSLAMB` (the model sharded
by ``fully_shard`` over ``self.device_mesh["shard"]`` in ``configure_model``; the momentum
exchanged sparsely across the replicas); docs/launchers.md section 6.
"""

import os
from pathlib import Path

import torch
import torch.distributed as torch_dist
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from slamb_comm.wire.codecs import TopK

from .privates import hand_mesh_to_module, mark_lr_scheduler_step, saves_distributed_checkpoint
from .torch import (SLAMB, DistributedOptimizer, HybridSLAMB, OneBitLAMB, SlambHookState, TopKHookState, slamb_hook,
                    topk_hook)
from .torch.averaging import averaged_state_dict, traffic_metrics
from .torch.distributed.contract import DistributedMixin
from .torch.distributed.slamb import DistributedSlamb
from .torch.rank_files import resume_state
from .torch.tensors import is_dtensor, local_of

__all__ = ["SlambDDPStrategy", "SlambModelParallelStrategy", "rank_state_path"]


def rank_state_path(checkpoint_path, rank):
    """Where :class:`SlambDDPStrategy` keeps rank ``rank``'s own state beside ``checkpoint_path``."""
    return f"{os.fspath(checkpoint_path)}.slamb_rank{rank}"


class SlambDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with slamb_comm's DDP communication hook, on CPU and CUDA alike.

    Args:
        compression: ``None`` (default): SLAMB -- ``configure_optimizers`` returns a
            :class:`slamb_comm.adapters.torch.SLAMB` (wrapped here in ``DistributedOptimizer``)
            or a ``DistributedOptimizer(SLAMB(...))``, and :func:`slamb_hook` keeps each rank's
            gradients local while SLAMB exchanges its momenta. A :class:`slamb_comm.TopK`:
            top-k gradients with error feedback (:func:`topk_hook`) under whatever torch
            optimizer ``configure_optimizers`` returns.
        **kwargs: anything ``DDPStrategy`` takes (``bucket_cap_mb``, ``find_unused_parameters``,
            ``process_group_backend``, ...), except the comm-hook arguments, which this
            strategy sets.

    After ``fit`` starts, ``hook_state`` is the :class:`SlambHookState` or :class:`TopKHookState`
    (``hook_state.calls`` counts the buckets DDP handed the hook), and after each optimizer step
    ``last_traffic`` is that step's :class:`slamb_comm.Traffic` (payload and wire bytes against a
    dense allreduce), also logged as ``slamb/payload_bytes``, ``slamb/wire_bytes``,
    ``slamb/of_dense`` and ``slamb/wire_of_dense`` (the strategy reads the optimizer's or hook
    state's ``step_traffic()`` at every step: read ``last_traffic`` instead). Checkpoints hold the
    mean of the ranks' models (the module's docstring). What works, and how (each tested at 2
    ranks on gloo):
    ``precision='bf16-mixed'``; ``'16-mixed'`` with Lightning's GradScaler (handed to the top-k
    state; on CPU Lightning maps ``precision='16-mixed'`` to bf16, ``plugins=[MixedPrecision(
    '16-mixed', 'cpu')]`` keeps fp16); ``gradient_clip_val`` (under SLAMB it clips each
    rank's local gradient, as with Horovod); ``accumulate_grad_batches`` (DDP's ``no_sync``:
    the hook runs on the last micro-batch, with the accumulated gradient), ``ModelCheckpoint``
    and ``fit(ckpt_path=...)`` with per-rank state files (see the module's docstring).
    """

    strategy_name = "slamb_ddp"

    def __init__(self, compression=None, **kwargs):
        for bad in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(bad) is not None:
                raise ValueError(f"SlambDDPStrategy registers slamb_comm's hook itself: pass no {bad}= "
                                 "(compression=slamb_comm.TopK(...) selects top-k, None SLAMB)")
        if compression is not None and not isinstance(compression, TopK):
            raise TypeError(f"compression must be None (SLAMB) or a slamb_comm.TopK, got {compression!r}")
        super().__init__(**kwargs)
        self.compression = compression
        self.hook_state = None
        self.last_traffic = None  # the last optimizer step's slamb_comm.Traffic
        self._rank_state = None  # this rank's hook state from the checkpoint, until the state exists
        self._rank_model = None  # and its parameters, put back after DDP broadcast rank 0's

    # ------------------------------------------------------------------ the hook
    def configure_ddp(self):
        """Wrap the model in DDP (as ``DDPStrategy``) and register slamb_comm's hook, whatever the device."""
        super().configure_ddp()
        if self._rank_model is not None:  # DDP's constructor broadcast rank 0's parameters: this rank's own again
            self.lightning_module.load_state_dict(self._rank_model)
            self._rank_model = None
        if self.compression is not None:
            scaler = getattr(self.precision_plugin, "scaler", None)
            state = TopKHookState(self.lightning_module.named_parameters(), self.compression, grad_scaler=scaler)
            if self._rank_state is not None:
                state.load_state_dict(self._rank_state)
                self._rank_state = None
            self.model.register_comm_hook(state, topk_hook)
        else:
            state = SlambHookState()  # bound in setup_optimizers, once configure_optimizers has run
            self.model.register_comm_hook(state, slamb_hook)
        self.hook_state = state

    def setup_optimizers(self, trainer):
        """``configure_optimizers`` (as ``DDPStrategy``), then bind its SLAMB optimizer to the hook."""
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING or self.hook_state is None:
            return
        opts = list(self.optimizers)
        if self.compression is not None:
            for opt in opts:
                if isinstance(opt, (SLAMB, OneBitLAMB, DistributedMixin)):
                    raise TypeError(f"SlambDDPStrategy(compression=TopK(...)) exchanges top-k gradients for a plain "
                                    f"torch optimizer, but configure_optimizers returned {type(opt).__name__}: return "
                                    "your torch optimizer (not DistributedOptimizer), or SlambDDPStrategy() for SLAMB")
            return
        slambs = [i for i, o in enumerate(opts) if isinstance(o, SLAMB)]
        others = [type(o).__name__ for o in opts if not isinstance(o, SLAMB)]
        if len(slambs) != 1 or others:
            raise TypeError("SlambDDPStrategy() trains the one SLAMB optimizer that configure_optimizers returns "
                            f"(got {[type(o).__name__ for o in opts]}): return slamb_comm.adapters.torch.SLAMB("
                            "self.parameters(), lr=..., ratio=0.1); to keep your own optimizer, use "
                            "SlambDDPStrategy(compression=slamb_comm.TopK(0.01)) instead")
        i = slambs[0]
        bare = opts[i]
        dist = bare if isinstance(bare, DistributedSlamb) else DistributedOptimizer(
            bare, named_parameters=self.lightning_module.named_parameters())
        self.hook_state.bind(dist)
        if dist is not bare:
            opts[i] = dist
            self.optimizers = opts  # Lightning's setter rebuilds its LightningOptimizer wrappers
            moved = [c.scheduler for c in self.lr_scheduler_configs if getattr(c.scheduler, "optimizer", None) is bare]
            for scheduler in moved:  # the schedulers step the same param_groups
                scheduler.optimizer = dist
            if moved:
                _mark_step_tracked(dist)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The step (as ``DDPStrategy``), then its bytes: ``last_traffic`` and the module's log."""
        out = super().optimizer_step(optimizer, closure, model=model, **kwargs)
        self._record_traffic()
        return out

    def _record_traffic(self):
        """Read the bytes exchanged since the last optimizer step (SLAMB's optimizer or the top-k
        hook state) into ``last_traffic`` and log them on every logger of the Trainer, at this step.
        Nothing is recorded for a step that exchanged nothing (a second optimizer under top-k,
        whose buckets the first one's read already counted)."""
        state = self.hook_state
        source = state if isinstance(state, TopKHookState) else getattr(state, "optimizer", None)
        if source is None:
            return
        traffic = source.step_traffic()
        if traffic.calls == 0:
            return
        self.last_traffic = traffic
        try:
            self.lightning_module.log_dict(traffic_metrics(traffic), on_step=True, on_epoch=False, batch_size=1)
        except MisconfigurationException:  # a step outside the Trainer's logging hooks: last_traffic only
            pass

    # ------------------------------------------------------------------ per-rank checkpoints
    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        """Every rank writes its own model, optimizer and hook state beside the checkpoint
        (atomically); then rank 0 writes Lightning's checkpoint, as ``DDPStrategy`` does, with
        the mean of the ranks' models as its ``state_dict`` (an allreduce: every rank calls
        this, as Lightning's ``Trainer.save_checkpoint`` does)."""
        own = {"world_size": self.world_size, "rank": self.global_rank, "state_dict": checkpoint.get("state_dict"),
               "optimizer_states": checkpoint.get("optimizer_states"),
               "hook_state": self.hook_state.state_dict() if isinstance(self.hook_state, TopKHookState) else None}
        path = rank_state_path(filepath, self.global_rank)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save(own, tmp)
        os.replace(tmp, path)
        if checkpoint.get("state_dict") is not None:  # the model to evaluate or ship: the mean of the replicas
            group = getattr(self.model, "process_group", None)
            checkpoint = {**checkpoint, "state_dict": averaged_state_dict(checkpoint["state_dict"], group=group)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath):
        """Every rank removes its own state file; rank 0 the checkpoint (``ModelCheckpoint``'s rotation)."""
        path = rank_state_path(filepath, self.global_rank)
        if os.path.exists(path):
            os.remove(path)
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        """Lightning's checkpoint, with this rank's own model and optimizer state put in (from
        its ``.slamb_rank<r>`` file); saved at another number of ranks, the state that
        docs/algorithm.md section 10 makes of every old rank's file; without the files, rank 0's,
        with a warning."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        own = resume_state(lambda r: rank_state_path(checkpoint_path, r), self.world_size, self.global_rank,
                           checkpoint_path)
        if own is None:
            return checkpoint
        checkpoint = dict(checkpoint)
        if own["state_dict"] is not None:
            checkpoint["state_dict"] = own["state_dict"]
            self._rank_model = own["state_dict"]
        if own["optimizer_states"] is not None:
            checkpoint["optimizer_states"] = own["optimizer_states"]
        if own["hook_state"] is not None:
            if isinstance(self.hook_state, TopKHookState):
                self.hook_state.load_state_dict(own["hook_state"])
            else:
                self._rank_state = own["hook_state"]  # the state is made in configure_ddp, after this
        return checkpoint


def _mark_step_tracked(opt):
    """As torch's LR schedulers mark an optimizer's ``step`` (so a scheduler moved onto the
    distributed optimizer does not warn that it stepped before the optimizer): torch's
    ``LRScheduler``'s own marks (:func:`slamb_comm.adapters.privates.mark_lr_scheduler_step`)."""
    opt.step = mark_lr_scheduler_step(opt, opt.step)


# ----------------------------------------------------------------------------- FSDP2 / HSDP
class SlambModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) on a ``(replicate, shard)`` mesh, for
    :class:`slamb_comm.adapters.torch.HybridSLAMB`: HSDP's layout, with SLAMB's sparse momentum
    exchange across the replicas where FSDP2's dense replica allreduce was.

    The change to a stock Lightning FSDP2 script (``ModelParallelStrategy()``, ``fully_shard(...,
    mesh=self.device_mesh["data_parallel"])`` in ``configure_model``)::

        trainer = L.Trainer(strategy=SlambModelParallelStrategy(replicas=2), ...)

        def configure_model(self):
            for block in self.model.layers:
                fully_shard(block, mesh=self.device_mesh["shard"])
            fully_shard(self.model, mesh=self.device_mesh["shard"])

        def configure_optimizers(self):
            return HybridSLAMB(self, self.device_mesh, lr=..., ratio=0.1)

    Args:
        replicas: R, the mesh's first dimension: ``"auto"`` (default) is the number of nodes (shard
            inside a node, replicate across nodes, as HSDP); the world size must be a multiple.
        **kwargs: ``ModelParallelStrategy``'s ``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``. Every rank is data-parallel (no tensor parallel
            yet), so ``data_parallel_size`` and ``tensor_parallel_size`` are not taken.

    ``self.device_mesh`` (the LightningModule's and the strategy's) is the 2-D mesh
    ``init_device_mesh(device, (R, world // R), mesh_dim_names=("replicate", "shard"))``; every rank
    draws its own batches (the sampler is over all ranks). ``configure_optimizers`` returns one
    ``HybridSLAMB`` (or ``HybridSAdamW``) on that mesh; another optimizer would train the replicas
    apart, so it raises ``TypeError``. After each optimizer step ``last_traffic`` is its
    :class:`slamb_comm.Traffic` (the bytes sent across the replicas against HSDP's dense replica
    allreduce of this rank's pieces), also logged as ``slamb/payload_bytes``, ``slamb/of_dense``, ...

    Checkpoints: Lightning's (a ``torch.distributed.checkpoint`` folder, or one file with
    ``save_distributed_checkpoint=False``) holds the model as the float64 mean of the replicas
    (they differ between SLAMB's periodic syncs), the live model untouched. The optimizer's state is
    per rank (each rank's pieces' moments), so it is not in Lightning's checkpoint: every rank writes
    ``<checkpoint>.slamb_rank<r>`` beside it with its optimizer state and its own pieces, and
    ``fit(ckpt_path=...)`` loads them: the resumed run is the interrupted one, bitwise. Only on the
    same mesh: another shape raises ``ValueError``; without the files (a checkpoint from another
    strategy) the run resumes from the mean model with a new optimizer state, and a warning says so.
    """

    strategy_name = "slamb_model_parallel"

    def __init__(self, replicas="auto", **kwargs):
        for bad in ("data_parallel_size", "tensor_parallel_size"):
            if bad in kwargs:
                raise ValueError(f"SlambModelParallelStrategy builds its (replicate, shard) mesh over every rank: pass "
                                 f"replicas=R, not {bad}= (tensor parallel is not supported yet)")
        if replicas != "auto" and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise ValueError(f"replicas must be 'auto' or a positive int, got {replicas!r}")
        super().__init__(**kwargs)
        self.replicas = replicas
        self.last_traffic = None  # the last optimizer step's slamb_comm.Traffic

    # ------------------------------------------------------------------ the mesh
    def setup_environment(self):
        """The process group (as ``ModelParallelStrategy``, every rank data-parallel), then the
        ``(replicate, shard)`` mesh, which ``configure_model`` reads as ``self.device_mesh``."""
        from torch.distributed.device_mesh import init_device_mesh

        world = self.num_nodes * self.num_processes
        R = self.num_nodes if self.replicas == "auto" else self.replicas
        if world % R:
            raise ValueError(f"SlambModelParallelStrategy(replicas={R}): the {world} ranks are not a multiple of "
                             f"{R}; the mesh is (replicas, world // replicas)")
        self._data_parallel_size, self._tensor_parallel_size = world, 1
        super().setup_environment()
        self._device_mesh = init_device_mesh(self.root_device.type, (R, world // R),
                                             mesh_dim_names=("replicate", "shard"))
        # as ModelParallelStrategy.setup_environment hands its mesh to the module (Lightning has no setter)
        hand_mesh_to_module(self.lightning_module, self._device_mesh)

    @property
    def distributed_sampler_kwargs(self):
        """Every rank is a data-parallel rank: its own batches."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_optimizers(self, trainer):
        """``configure_optimizers`` (as ``ModelParallelStrategy``); it must return one HybridSLAMB."""
        super().setup_optimizers(trainer)
        opts = list(self.optimizers)
        if len(opts) != 1 or not isinstance(opts[0], HybridSLAMB):
            raise TypeError("SlambModelParallelStrategy trains the one HybridSLAMB that configure_optimizers returns "
                            f"(got {[type(o).__name__ for o in opts]}): return slamb_comm.adapters.torch.HybridSLAMB("
                            "self, self.device_mesh, lr=..., ratio=0.1); the model is sharded over "
                            "self.device_mesh['shard'] only, so nothing else keeps the replicas together")

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The step (as ``ModelParallelStrategy``), then its bytes: ``last_traffic`` and the module's log."""
        out = super().optimizer_step(optimizer, closure, model=model, **kwargs)
        opt = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        traffic = opt.step_traffic() if isinstance(opt, HybridSLAMB) else None
        if traffic is not None and traffic.calls:
            self.last_traffic = traffic
            try:
                self.lightning_module.log_dict(traffic_metrics(traffic), on_step=True, on_epoch=False, batch_size=1)
            except MisconfigurationException:  # a step outside the Trainer's logging hooks: last_traffic only
                pass
        return out

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self):
        """The model to save: every piece (and buffer) the float64 mean over its replicas; sharded
        (DTensors) for a distributed checkpoint, whole on rank 0 otherwise. Collective; the live
        model is not touched."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        from torch.distributed.tensor import DTensor

        own = get_model_state_dict(self.model)
        mean = averaged_state_dict({k: local_of(v) for k, v in own.items()},
                                   group=self.device_mesh["replicate"].get_group())
        out = {}
        for k, v in own.items():
            m = mean[k]
            if is_dtensor(v):
                m = DTensor.from_local(m, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride())
            out[k] = m
        if saves_distributed_checkpoint(self):
            return out
        whole = {k: (v.full_tensor() if is_dtensor(v) else v).cpu() for k, v in out.items()}  # over each shard group
        return whole if self.global_rank == 0 else {}

    def optimizer_state(self, optimizer):
        """This rank's own pieces' optimizer state (written to its own file by :meth:`save_checkpoint`)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return optimizer.state_dict()

    def _own_tensors(self):
        module = self.lightning_module
        return [*module.named_parameters(), *module.named_buffers()]

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        """Every rank writes its optimizer state and its own pieces to ``<filepath>.slamb_rank<r>``
        (atomically); then Lightning's checkpoint, without the optimizer state, is written as
        ``ModelParallelStrategy`` writes it."""
        path = self.broadcast(filepath)
        own = {"world_size": self.world_size, "rank": self.global_rank, "mesh": tuple(self.device_mesh.shape),
               "pieces": {k: local_of(v).detach().cpu() for k, v in self._own_tensors()},
               "optimizer_states": checkpoint.get("optimizer_states")}
        mine = rank_state_path(path, self.global_rank)
        os.makedirs(os.path.dirname(os.path.abspath(mine)), exist_ok=True)
        torch.save(own, f"{mine}.tmp")
        os.replace(f"{mine}.tmp", mine)
        checkpoint = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, filepath):
        """Every rank removes its own state file; rank 0 the checkpoint (``ModelCheckpoint``'s rotation)."""
        mine = rank_state_path(filepath, self.global_rank)
        if os.path.exists(mine):
            os.remove(mine)
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        """The model from Lightning's checkpoint (the mean of the replicas), then this rank's own
        pieces and optimizer state from its ``.slamb_rank<r>`` file: the interrupted run, bitwise."""
        path = Path(self.broadcast(checkpoint_path))
        rest = _load_checkpoint(path=path, state={"state_dict": self.model}, strict=self.lightning_module.strict_loading,
                                optimizer_states_from_list=True, weights_only=weights_only)
        mine = rank_state_path(path, self.global_rank)
        have = torch.tensor([float(os.path.exists(mine))], device=self.root_device)
        torch_dist.all_reduce(have, op=torch_dist.ReduceOp.MIN)
        if not have.item():
            rank_zero_warn(f"{path}: no per-rank state files ({rank_state_path(path, 'N')}) on every rank: "
                           "resuming from the mean of the replicas with a new optimizer state (a valid run, not the "
                           "interrupted one)")
            return rest
        own = torch.load(mine, map_location="cpu", weights_only=False)  # slamb_comm's own file
        if own["world_size"] != self.world_size or tuple(own["mesh"]) != tuple(self.device_mesh.shape):
            raise ValueError(f"{mine} was saved on a {own['mesh']} mesh of {own['world_size']} ranks, this run is "
                             f"{tuple(self.device_mesh.shape)}: HybridSLAMB resumes on the same mesh only")
        with torch.no_grad():
            for k, v in self._own_tensors():
                if k in own["pieces"]:
                    local_of(v).copy_(own["pieces"][k])
        for opt, state in zip(self.optimizers, own["optimizer_states"] or []):
            opt.load_state_dict(state)
        return rest
