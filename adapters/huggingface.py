"""Hugging Face adapter: :class:`SlambTrainer` for ``transformers.Trainer`` and :func:`install`
for an Accelerate loop, SLAMB or top-k on the DDP model they build.

Neither ``transformers.Trainer`` (no comm-hook argument; its ``_wrap_model`` replaces the
Accelerator's DDP kwargs) nor Accelerate (its ``comm_hook`` takes only its own enum) lets a
user hand DDP a hook, and both wrap the model in DDP inside ``prepare``. So the hook goes in
after ``prepare``:

* **Trainer**: ``SlambTrainer(...)`` in place of ``Trainer(...)``. SLAMB by default (built from
  the ``TrainingArguments``' lr, betas, eps and weight decay, with ``slamb={"ratio": 0.1, ...}``
  for SLAMB's own options, or the ``SLAMB`` you pass in ``optimizers=``), or
  ``compression=slamb_comm.TopK(0.01)`` for top-k under the Trainer's own optimizer.
* **Accelerate**: one line after ``accelerator.prepare``::

      model, optimizer, loader = accelerator.prepare(model, SLAMB(model.parameters(), lr=1e-3, ratio=0.1), loader)
      slamb_comm.adapters.huggingface.install(model, optimizer)            # SLAMB
      slamb_comm.adapters.huggingface.install(model, compression=slamb_comm.TopK(0.01),
                                              grad_scaler=accelerator.scaler)  # or top-k, any optimizer

Checkpoints: the Trainer saves rank 0's model and optimizer; :class:`SlambTrainer` also writes
every rank's own model, optimizer and hook state (``slamb_rank<r>.pt`` in the checkpoint
folder) and ``resume_from_checkpoint`` loads it, so the resumed run is the interrupted one.
With Accelerate, :func:`save_rank_state` / :func:`load_rank_state` do the same beside
``accelerator.save_state``. docs/integrations.md says what works and what resume means.

The saved model is the mean of the ranks' replicas (SLAMB's differ between its periodic syncs):
``SlambTrainer.save_model`` and its checkpoints' weights, and, after :func:`install`,
Accelerate's ``get_state_dict`` / ``save_model`` / ``save_state`` weights, through
:func:`slamb_comm.adapters.torch.averaged_state_dict`. The live model and the per-rank files
keep each rank's own parameters, so a resume is still the interrupted run.

Bytes: ``SlambTrainer`` adds ``slamb/payload_bytes``, ``slamb/wire_bytes``, ``slamb/of_dense``
and ``slamb/wire_of_dense`` to its logs (log history, TensorBoard, W&B, ...) and keeps the last
step's :class:`slamb_comm.Traffic` in ``trainer.last_traffic``; an Accelerate loop logs
:func:`step_metrics` with ``accelerator.log``.
"""

import logging
import os
import weakref
from dataclasses import dataclass

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
import transformers

from slamb_comm.wire.codecs import TopK
from slamb_comm.wire.stats import Traffic

from .privates import trainer_load_optimizer_and_scheduler, trainer_save, trainer_save_optimizer_and_scheduler
from .torch import SLAMB, DistributedOptimizer, OneBitLAMB, SAdamW, SlambHookState, TopKHookState, slamb_hook, topk_hook
from .torch.averaging import averaged_state_dict, traffic_metrics
from .torch.distributed.ddp_misuse import comm_hook_states
from .torch.distributed.contract import DistributedMixin
from .torch.distributed.slamb import DistributedSlamb
from .torch.rank_files import resume_state

__all__ = ["install", "SlambTrainer", "save_rank_state", "load_rank_state", "step_metrics"]

_log = logging.getLogger("slamb_comm")

# benchmarks/lr_table.py (docs/integrations.md section 9): SLAMB and dense LAMB trained within a few
# percent of their best from 0.003 (the example LM; 0.01 on the tiny GPT-2) up, best at 0.01 on both
# models, where AdamW was best at 0.001-0.003. Below the floor SlambTrainer warns that the lr looks
# like AdamW's and names the start.
LAMB_LR_FLOOR = 3e-3
LAMB_LR_START = 1e-2


def _ddp_of(model):
    """The ``DistributedDataParallel`` module ``model`` is or wraps (``.module`` chain), or None."""
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model, seen = getattr(model, "module", None), seen + 1
    return None


def _distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def _swap(accelerated, inner):
    """Put ``inner`` inside an Accelerate ``AcceleratedOptimizer`` in place of what it wrapped
    (and redo its GradScaler step patch, which is bound to the wrapped optimizer's ``step``)."""
    # Accelerate's own constructor again, on the same object: it keeps the optimizer and redoes
    # its GradScaler step patch (attributes of its own, no public setter) for the new one
    AcceleratedOptimizer.__init__(
        accelerated, inner, device_placement=accelerated.device_placement, scaler=accelerated.scaler)


def install(model, optimizer=None, compression=None, grad_scaler=None):
    """slamb_comm's DDP hook on a model that Accelerate (or a Trainer) already wrapped in DDP.

    Args:
        model: what ``accelerator.prepare`` returned (a ``DistributedDataParallel``, or a
            wrapper whose ``.module`` chain holds one).
        optimizer: for SLAMB (``compression=None``): what ``prepare`` returned for a
            :class:`slamb_comm.adapters.torch.SLAMB` (an ``AcceleratedOptimizer``), or the SLAMB
            itself, or a ``DistributedOptimizer(SLAMB(...))``. A bare SLAMB is wrapped in
            :func:`~slamb_comm.adapters.torch.DistributedOptimizer` and put back inside the
            ``AcceleratedOptimizer``, so the loop keeps calling ``optimizer.step()``.
        compression: a :class:`slamb_comm.TopK` for top-k with error feedback under any torch
            optimizer (``optimizer`` is then not needed).
        grad_scaler: top-k only: the AMP ``GradScaler`` that scales the loss
            (``accelerator.scaler``), so the error buffers stay in unscaled units.

    Returns the hook state (:class:`SlambHookState` or :class:`TopKHookState`; ``state.calls``
    counts the buckets DDP handed the hook; :func:`step_metrics` reads its bytes), or None in a
    single process, where Accelerate does not wrap the model and a bare SLAMB steps alone (P = 1).
    Call it before the first backward pass, once per DDP model.

    Under SLAMB, Accelerate's ``get_state_dict(model)`` -- and so ``save_model`` and the weights
    of ``save_state`` -- then returns the mean of the ranks' replicas of this model
    (:func:`slamb_comm.adapters.torch.averaged_state_dict`), an allreduce: call them on every
    rank, as Accelerate asks under FSDP and DeepSpeed. The live model is not touched.
    """
    ddp = _ddp_of(model)
    if ddp is None:
        if _distributed():
            raise TypeError(f"install() needs the DDP model that accelerator.prepare returned, got "
                            f"{type(model).__name__} with {torch.distributed.get_world_size()} processes: pass "
                            "the prepared model (FSDP and DeepSpeed are not supported)")
        return None
    if any(isinstance(s, (SlambHookState, TopKHookState)) for s in comm_hook_states(ddp)):
        raise RuntimeError("slamb_comm's hook is registered on this DDP model already: call install() once")
    if compression is not None:
        return _install_topk(ddp, optimizer, compression, grad_scaler)
    if grad_scaler is not None:
        raise ValueError("grad_scaler= is for top-k; SLAMB exchanges the unscaled gradients by itself")
    return _install_slamb(ddp, optimizer)


def _install_topk(ddp, optimizer, compression, grad_scaler):
    """:func:`install`'s top-k hook under the plain torch ``optimizer`` (or None)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # inside an AcceleratedOptimizer, or as given
    if not isinstance(compression, TopK):
        raise TypeError(f"compression must be a slamb_comm.TopK, got {compression!r}")
    if isinstance(inner, (SLAMB, OneBitLAMB, DistributedMixin)):
        raise TypeError(f"install(compression=TopK(...)) is for a plain torch optimizer, got "
                        f"{type(inner).__name__}: under DDP keep your optimizer unwrapped, or install() "
                        "without compression for SLAMB")
    state = TopKHookState(ddp.module.named_parameters(), compression, grad_scaler=grad_scaler)
    if optimizer in _LOADED_HOOK_STATES:  # from load_rank_state
        state.load_state_dict(_LOADED_HOOK_STATES.pop(optimizer))
    ddp.register_comm_hook(state, topk_hook)
    return state


def _install_slamb(ddp, optimizer):
    """:func:`install`'s SLAMB hook: the SLAMB inside ``optimizer`` made distributed (in place,
    inside the ``AcceleratedOptimizer``) and bound to the hook."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, SLAMB):
        raise TypeError("install(model, optimizer) trains a slamb_comm.adapters.torch.SLAMB optimizer (prepare "
                        f"SLAMB(model.parameters(), lr=..., ratio=0.1)), got {type(inner).__name__}; to keep your "
                        "optimizer, use install(model, compression=slamb_comm.TopK(0.01))")
    dist = inner if isinstance(inner, DistributedSlamb) else DistributedOptimizer(
        inner, named_parameters=ddp.module.named_parameters())
    if dist is not inner:
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise TypeError("install() got a bare SLAMB that is not inside an AcceleratedOptimizer: pass what "
                            "accelerator.prepare returned (or DistributedOptimizer(SLAMB(...)) yourself)")
        _swap(optimizer, dist)
    ddp.register_comm_hook(SlambHookState(dist), slamb_hook)
    _average_saved_weights(ddp)
    return dist.hook_state


def step_metrics(hook_state):
    """The bytes of the optimizer steps since the last call, as logger metrics: in an Accelerate
    loop, once per step after ``optimizer.step()``::

        accelerator.log(slamb_comm.adapters.huggingface.step_metrics(state), step=step)

    where ``state`` is what :func:`install` returned. ``slamb/payload_bytes`` and
    ``slamb/wire_bytes`` are what this rank handed to the collectives and put on its link,
    ``slamb/of_dense`` and ``slamb/wire_of_dense`` their ratios to a dense allreduce of the
    gradients (:func:`slamb_comm.adapters.torch.traffic_metrics`, docs/algorithm.md section 4).
    ``{}`` when ``hook_state`` is None (one process: nothing is exchanged)."""
    source = _traffic_source(hook_state)
    return {} if source is None else traffic_metrics(source.step_traffic())


def _traffic_source(hook_state):
    """What counts a step's bytes: the top-k hook state itself, or the SLAMB optimizer a
    :class:`SlambHookState` is bound to (None for no state, or an unbound one)."""
    if isinstance(hook_state, TopKHookState):
        return hook_state
    return getattr(hook_state, "optimizer", None)


# ----------------------------------------------------------------------------- the saved model under Accelerate
_LOADED_HOOK_STATES = weakref.WeakKeyDictionary()  # optimizer -> a top-k hook state load_rank_state read
_AVERAGED = weakref.WeakKeyDictionary()  # a DDP model install() put SLAMB on, and its .module -> DDP's group


def _average_saved_weights(ddp):
    """From now on Accelerate's ``get_state_dict`` of ``ddp`` (or of its unwrapped module) is the
    mean of the replicas over DDP's process group."""
    _AVERAGED[ddp] = _AVERAGED[ddp.module] = ddp.process_group
    _wrap_get_state_dict()


def _wrap_get_state_dict():
    """Once per process: ``accelerate.Accelerator.get_state_dict`` averages the models in
    ``_AVERAGED`` and returns every other model's state as before.

    Why a wrapper: Accelerate has no hook on the weights it saves (``register_save_state_pre_hook``
    covers ``save_state`` only, not ``save_model``), and ``save_model`` and ``save_state`` both
    read them through ``get_state_dict``. It changes nothing for a model :func:`install` did not
    put SLAMB on."""
    original = accelerate.Accelerator.get_state_dict
    if getattr(original, "slamb_comm_averages", False):
        return

    def get_state_dict(self, model, unwrap=True):
        state = original(self, model, unwrap=unwrap)
        ddp = _ddp_of(model)
        for m in (model, ddp):
            if m is not None and m in _AVERAGED:
                return averaged_state_dict(state, group=_AVERAGED[m])
        return state

    get_state_dict.__doc__ = original.__doc__
    get_state_dict.__wrapped__ = original
    get_state_dict.slamb_comm_averages = True
    accelerate.Accelerator.get_state_dict = get_state_dict


# ----------------------------------------------------------------------------- per-rank state
def save_rank_state(directory, model, optimizer, hook_state=None):
    """Write this rank's own model, optimizer and top-k hook state to ``directory/slamb_rank<r>.pt``
    (atomically): SLAMB's moments (and its parameters between periodic syncs) and top-k's error
    buffers differ per rank, and a Trainer or ``accelerator.save_state`` keeps rank 0's only.
    Call it on every rank."""
    rank = torch.distributed.get_rank() if _distributed() else 0
    world = torch.distributed.get_world_size() if _distributed() else 1
    unwrapped = _ddp_of(model).module if _ddp_of(model) is not None else model
    own = {"world_size": world, "model": unwrapped.state_dict(), "optimizer": optimizer.state_dict(),
           "hook_state": hook_state.state_dict() if isinstance(hook_state, TopKHookState) else None}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"slamb_rank{rank}.pt")
    torch.save(own, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    return path


def load_rank_state(directory, model, optimizer, hook_state=None):
    """Load :func:`save_rank_state`'s file for this rank into ``model`` (after DDP wrapped it:
    DDP's constructor broadcasts rank 0's parameters), ``optimizer`` and ``hook_state`` (a top-k
    state, or None: then :func:`install` loads it when it makes the state). Files saved at
    another number of ranks are all read, and every rank loads the state docs/algorithm.md
    section 10 makes of them (moments, error buffers and parameters averaged). Returns False,
    with a warning, if there are no such files: every rank then goes on from what it has (rank
    0's state, if the caller loaded it)."""
    rank = torch.distributed.get_rank() if _distributed() else 0
    world = torch.distributed.get_world_size() if _distributed() else 1
    own = resume_state(lambda r: os.path.join(directory, f"slamb_rank{r}.pt"), world, rank, directory)
    if own is None:
        return False
    unwrapped = _ddp_of(model).module if _ddp_of(model) is not None else model
    unwrapped.load_state_dict(own["model"])
    optimizer.load_state_dict(own["optimizer"])
    if own["hook_state"] is not None:
        if isinstance(hook_state, TopKHookState):
            hook_state.load_state_dict(own["hook_state"])
        else:
            _LOADED_HOOK_STATES[optimizer] = own["hook_state"]
    return True


# ----------------------------------------------------------------------------- transformers.Trainer
class _Install(transformers.TrainerCallback):
    """Registers the hook at ``on_train_begin``: after ``accelerator.prepare`` wrapped the model
    in DDP and the checkpoint was loaded, before the first forward pass."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        ddp = _ddp_of(t.model_wrapped)
        if ddp is not None and any(isinstance(s, (SlambHookState, TopKHookState)) for s in comm_hook_states(ddp)):
            return  # a second train() on the same DDP model
        scaler = getattr(t.accelerator, "scaler", None) if t.compression is not None else None
        t.hook_state = install(t.model_wrapped, t.optimizer, compression=t.compression, grad_scaler=scaler)


@dataclass
class _Unlogged:
    """The bytes of the optimizer steps since the Trainer's last log, and how many steps."""

    traffic: Traffic
    steps: int = 0


class _StepTraffic(transformers.TrainerCallback):
    """After every optimizer step (``on_step_end``, before the Trainer decides to log): that step's
    bytes into ``trainer.last_traffic``, and added to what :meth:`SlambTrainer.log` logs next."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        source = _traffic_source(t.hook_state)
        if source is None:
            return
        t.last_traffic = source.step_traffic()
        t.unlogged_traffic = _Unlogged(t.unlogged_traffic.traffic + t.last_traffic, t.unlogged_traffic.steps + 1)


class SlambTrainer(transformers.Trainer):
    """``transformers.Trainer`` training with SLAMB, or with top-k gradients, under DDP.

    Args:
        slamb: SLAMB's own options (``ratio``, ``beta3``, ``sync_interval``, ``value_dtype``,
            ``dense_threshold``, ...) for the SLAMB built from the ``TrainingArguments``
            (``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay`` on the
            Trainer's decay parameters). Ignored when ``optimizers=`` holds a SLAMB.
        compression: a :class:`slamb_comm.TopK`: top-k with error feedback under the Trainer's
            own optimizer (``args.optim``) instead of SLAMB.
        *args, **kwargs: as ``transformers.Trainer``.

    After ``train()`` starts, ``hook_state`` is the hook's state (``calls``), and after each
    optimizer step ``last_traffic`` is that step's :class:`slamb_comm.Traffic` (payload and wire
    bytes against a dense allreduce). Every log of the Trainer after optimizer steps (log
    history, TensorBoard, W&B, ...) carries ``slamb/payload_bytes``, ``slamb/wire_bytes`` (per
    step, over the steps since the last log), ``slamb/of_dense`` and ``slamb/wire_of_dense``.

    ``save_model()`` and the checkpoints write the mean of the ranks' replicas as the model
    (:func:`slamb_comm.adapters.torch.averaged_state_dict`; SLAMB's replicas differ between its
    periodic syncs), while each rank's own model and optimizer state go into its
    ``slamb_rank<r>.pt``: ``save_model()`` is an allreduce under SLAMB, so call it on every
    rank (as the Trainer's checkpoints do, and as FSDP and DeepSpeed require).

    Learning rate: SLAMB's update is LAMB's, scaled by each layer's weight norm (the trust
    ratio), so an lr tuned for AdamW is too small (docs/integrations.md section 9). Below
    ``LAMB_LR_FLOOR`` a warning names the lr to start from; the lr is not changed.

    The Trainer's defaults work: ``max_grad_norm=1.0`` clips each rank's
    local gradient under SLAMB (the mean of the top-k payloads under top-k),
    ``gradient_accumulation_steps`` uses DDP's ``no_sync`` (the hook sees the accumulated
    gradient at the last micro-batch), ``save_steps`` checkpoints carry every rank's own state
    and ``resume_from_checkpoint`` loads it. FSDP and DeepSpeed are refused.
    """

    def __init__(self, *args, slamb=None, compression=None, **kwargs):
        if compression is not None and not isinstance(compression, TopK):
            raise TypeError(f"compression must be None (SLAMB) or a slamb_comm.TopK, got {compression!r}")
        if compression is not None and slamb is not None:
            raise ValueError("pass slamb= (SLAMB's options) or compression= (top-k under your optimizer), not both")
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ValueError("SlambTrainer runs on DDP; FSDP and DeepSpeed shard what SLAMB keeps per rank")
        self.slamb = dict(slamb or {})
        self.compression = compression
        self.hook_state = None
        self.last_traffic = None  # the last optimizer step's slamb_comm.Traffic
        self.unlogged_traffic = _Unlogged(Traffic())
        self._mean_state = None  # the mean of the replicas, while save_model runs
        self.add_callback(_Install(self))
        self.add_callback(_StepTraffic(self))

    def create_optimizer(self, model=None):
        """The SLAMB optimizer (built from the arguments unless ``optimizers=`` gave one),
        wrapped in ``DistributedOptimizer`` when there are several processes; under
        ``compression=`` the Trainer's own optimizer."""
        model = self.model if model is None else model
        if self.compression is None and self.optimizer is None:
            decay = set(self.get_decay_parameter_names(model))
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in params if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
            opts = {"lr": self.args.learning_rate, "betas": (self.args.adam_beta1, self.args.adam_beta2),
                    "eps": self.args.adam_epsilon, **self.slamb}
            self.optimizer = SLAMB([g for g in groups if g["params"]], **opts)
        super().create_optimizer(model)
        if self.compression is None:
            if not isinstance(self.optimizer, SLAMB):
                raise TypeError(f"SlambTrainer trains SLAMB, but optimizers= gave {type(self.optimizer).__name__}: "
                                "pass a slamb_comm.adapters.torch.SLAMB, or none (SLAMB from the arguments), or "
                                "compression=slamb_comm.TopK(...) to keep your optimizer")
            _warn_if_adamw_lr(self.optimizer)
            if _distributed() and not isinstance(self.optimizer, DistributedSlamb):
                self.optimizer = DistributedOptimizer(self.optimizer, named_parameters=model.named_parameters())
        return self.optimizer

    def log(self, logs, *args, **kwargs):
        """The Trainer's ``log``, with the bytes of the optimizer steps since the last log added
        (``slamb/...``, per step: :func:`slamb_comm.adapters.torch.traffic_metrics`)."""
        unlogged, self.unlogged_traffic = self.unlogged_traffic, _Unlogged(Traffic())
        super().log({**logs, **traffic_metrics(unlogged.traffic, unlogged.steps)}, *args, **kwargs)

    def save_model(self, output_dir=None, _internal_call=False):
        """The Trainer's ``save_model`` with the mean of the ranks' replicas as the weights (under
        SLAMB, several processes: an allreduce, so every rank calls it). The live model and the
        per-rank files keep each rank's own parameters."""
        if self.compression is None and _distributed():
            ddp = _ddp_of(self.model_wrapped)
            self._mean_state = averaged_state_dict(self.model, group=getattr(ddp, "process_group", None))
        try:
            super().save_model(output_dir, _internal_call=_internal_call)
        finally:
            self._mean_state = None

    # The Trainer's own save and load steps (private methods, no public hook: its callbacks run
    # after the checkpoint is complete and never see a resume's directory), extended.
    def _save(self, output_dir=None, state_dict=None):
        trainer_save(SlambTrainer, self, output_dir, self._mean_state if state_dict is None else state_dict)

    def _save_optimizer_and_scheduler(self, output_dir):
        trainer_save_optimizer_and_scheduler(SlambTrainer, self, output_dir)
        save_rank_state(output_dir, self.model, self.optimizer, self.hook_state)

    def _load_optimizer_and_scheduler(self, checkpoint):
        trainer_load_optimizer_and_scheduler(SlambTrainer, self, checkpoint)
        if checkpoint is not None:
            load_rank_state(checkpoint, self.model, self.optimizer, self.hook_state)


_WARNED_LR = []  # once per process


def _warn_if_adamw_lr(optimizer):
    """Log once (rank 0) when a SLAMB's lr is below :data:`LAMB_LR_FLOOR`: an AdamW learning rate
    that LAMB's trust ratio turns into tiny steps. SAdamW (AdamW's update) is left alone."""
    if _WARNED_LR or isinstance(optimizer, SAdamW):
        return
    lr = max(g.get("initial_lr", g["lr"]) for g in optimizer.param_groups)  # before any warm-up schedule
    if lr >= LAMB_LR_FLOOR or (_distributed() and torch.distributed.get_rank() != 0):
        return
    _WARNED_LR.append(lr)
    _log.warning("slamb_comm: SlambTrainer's learning rate %g looks like an AdamW one: SLAMB steps each layer by "
                 "lr x its weight norm (LAMB's trust ratio), so it trains far more slowly at an AdamW lr. Start from "
                 "learning_rate=%g, 3-10x an AdamW lr (benchmarks/lr_table.py, docs/integrations.md section 9). "
                 "The lr is used as given.", lr, LAMB_LR_START)
