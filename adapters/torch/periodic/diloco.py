"""DiLoCo and DES-LOC as torch optimizers: any inner optimizer, periodic averaging on torch.distributed.

One line around the optimizer a script already has::

    opt = slamb_comm.adapters.torch.DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-4))
    opt = slamb_comm.adapters.torch.DesLoc(torch.optim.AdamW(model.parameters(), lr=3e-4))

and no DDP (each rank trains alone between averages). The rules are the core's,
:class:`slamb_comm.methods.periodic.DiLoCo` and :class:`slamb_comm.methods.periodic.DesLoc` (docs/algorithm.md
section 12), run over :class:`~slamb_comm.adapters.torch.transport.TorchTransport` (or alone
when no process group is initialised). Parameters are bucketed by device and compute dtype
(16-bit ones through float32 copies, written back), one core object per bucket.

On a model sharded by FSDP2 over the ``"shard"`` dimension of a ``(replicate, shard)`` mesh (the
layout of :mod:`slamb_comm.adapters.torch.fsdp`), pass ``mesh=``: every average then runs over the replicas of each rank's
pieces (``local_of`` of the parameters and of Adam's moments), docs/algorithm.md section 15.2::

    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-4), mesh=mesh)
"""

import numpy as np
import torch
import torch.distributed as dist

from slamb_comm import arrays as _arr
from slamb_comm.methods import periodic as core
from slamb_comm.errors import ConfigError
from slamb_comm.exchange.transports import LocalTransport

from ..optim.bucket import Bucket, BucketKey
from ..optim.ledger import StepLedger
from ..transport import TorchTransport
from ..fsdp.mesh import mesh_pieces
from ..tensors import as_compute, cuda_scope, is_dtensor, local_of, state_dtype

__all__ = ["OuterLoop", "DiLoCo", "DesLoc"]


def _transport(process_group):
    """The group's transport; alone (P = 1) when no process group is initialised and none is given."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return LocalTransport()
    return TorchTransport(process_group)


def _computes(b, tensors):
    """``tensors`` (a DTensor's local piece for FSDP2's) as contiguous tensors of bucket ``b``'s compute
    dtype (views where they are already)."""
    return [as_compute(local_of(t), b.dtype) for t in tensors]


def _arrays(computes):
    return [_arr.as_array(c) for c in computes]


def _write_back(tensors, computes):
    """Copy the compute tensors that are copies (16-bit, non-contiguous) back into ``tensors``."""
    for t, c in zip(tensors, computes):
        t = local_of(t)
        if c.data_ptr() != t.data_ptr() or c.dtype != t.dtype:
            t.detach().copy_(c)


def _buckets(optimizer):
    """The wrapped optimizer's parameters by (device, compute dtype): one :class:`~.bucket.Bucket` each,
    whose ``rule`` is the core object."""
    out = {}
    for gi, g in enumerate(optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            out.setdefault((p.device, state_dtype(p.dtype)), []).append((p, g, f"group{gi}.{pi}"))
    return [Bucket(BucketKey(str(device), str(dtype), None, 0), [p for p, _, _ in items], [g for _, g, _ in items],
                   [n for _, _, n in items], dtype) for (device, dtype), items in out.items()]


def _to_torch(state):
    """A core state dict with NumPy arrays as CPU tensors (``torch.load(weights_only=True)`` takes them)."""
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}


def _to_numpy(state):
    return {k: v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class OuterLoop(torch.optim.Optimizer):
    """A torch optimizer that shares the wrapped one's ``param_groups`` and ``state`` (so LR
    schedulers and ``zero_grad`` act on it) and runs a core's outer step after its ``step``: the
    base of :class:`DiLoCo`, :class:`DesLoc` and :mod:`.sparseloco`'s optimizers."""

    method = None
    takes_mesh = False  # whether the subclass passes mesh= (FSDP2 pieces, averaged over their replicas)

    def __init__(self, optimizer, process_group, make_core, mesh=None, replicate="replicate", shard="shard"):
        """Wrap ``optimizer``; ``make_core(transport, arrays, names)`` builds a bucket's core object
        (collective: rank 0's parameters everywhere). ``process_group`` or ``mesh``: see :class:`DiLoCo`."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{self.method} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.state = optimizer.state
        self.ledger = StepLedger(self.method)
        #: the parameters by (device, compute dtype), each :class:`~.bucket.Bucket`'s ``rule`` its core object
        self.buckets = _buckets(optimizer)
        if mesh is not None and process_group is not None:
            raise ConfigError(f"{self.method}: pass mesh= (a model sharded by FSDP2) or process_group=, not both")
        if mesh is not None:
            transport = self._mesh_transport(mesh, replicate, shard)
        else:
            sharded = [n for b in self.buckets for p, n in zip(b.params, b.names) if is_dtensor(p)]
            if sharded:
                fix = (f"Shard the model with fully_shard(module, mesh=mesh['shard']) on a 2-D mesh init_device_mesh("
                       f"device, (R, S), mesh_dim_names=('replicate', 'shard')) and pass {self.method}(optimizer, "
                       "mesh=mesh): it averages each piece over its replicas" if self.takes_mesh else
                       f"{self.method} does not support sharded parameters yet (DiLoCo and DesLoc take mesh=)")
                raise ConfigError(f"{self.method}: parameter(s) {sharded[:3]} are DTensors (sharded by FSDP2): "
                                  f"averaging them over a process group would mix different pieces. {fix}")
            transport = _transport(process_group)
        with torch.no_grad():
            for b in self.buckets:
                comp = _computes(b, b.params)
                with cuda_scope(b.params[0].device):
                    b.rule = make_core(transport, _arrays(comp), b.names)
                _write_back(b.params, comp)  # rank 0's parameters, from the construction's broadcast

    def _mesh_transport(self, mesh, replicate, shard):
        """The transport over the replicas of this rank's pieces, every parameter checked to be a
        piece of ``mesh[shard]`` (FSDP2's Shard(0)); ConfigError for what is not supported."""
        named = [(n, p) for b in self.buckets for p, n in zip(b.params, b.names)]
        sharding, _ = mesh_pieces(mesh, named, self.method, replicate, shard)
        return sharding.replicas

    @property
    def cores(self):
        """The core objects (:mod:`slamb_comm.methods.periodic`), one per (device, dtype) bucket."""
        return [b.rule for b in self.buckets]

    def step_traffic(self):
        """Bytes of the step just finished, summed over buckets (a :class:`slamb_comm.Traffic`;
        no payload on the steps that average nothing, and the dense reference of a step on
        every step, docs/algorithm.md section 4), and start counting anew."""
        cores = self.cores
        dense = sum(c.layout.total * c.layout.dtype.itemsize for c in cores)
        size = cores[-1].comm.size if cores else 1
        # a dense step's allreduce per step since the last call, also on steps that average nothing
        return self.ledger.traffic([c.stats for c in cores], dense, size, max((c.t for c in cores), default=0))

    def state_dict(self):
        """The wrapped optimizer's ``state_dict()`` plus a ``'periodic'`` entry: per bucket, the
        core's state (step count; for DiLoCo the anchor and outer momentum, as CPU tensors)."""
        sd = self.optimizer.state_dict()
        sd["periodic"] = {"method": self.method, "buckets": [_to_torch(c.state_dict()) for c in self.cores]}
        return sd

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output: the wrapped optimizer's part, then the cores' exactly."""
        sd = dict(state_dict)
        periodic = sd.pop("periodic", None)
        if periodic is None or periodic.get("method") != self.method:
            found = "no 'periodic' entry" if periodic is None else f"one saved by {periodic.get('method')}"
            raise ValueError(f"this state dict has {found}: load one saved by {self.method}.state_dict(), or load "
                             f"a plain optimizer's into {self.method}.optimizer (the outer state then starts anew)")
        if len(periodic["buckets"]) != len(self.buckets):
            raise ValueError(f"the state dict has {len(periodic['buckets'])} parameter buckets, this "
                             f"{self.method} has {len(self.buckets)}")
        self.optimizer.load_state_dict(sd)
        self.state, self.param_groups = self.optimizer.state, self.optimizer.param_groups  # torch replaced them
        for c, s in zip(self.cores, periodic["buckets"]):
            c.load_state_dict(_to_numpy(s))
        self.ledger.restart(max((c.t for c in self.cores), default=0))

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """The inner optimizer's step, then (every ``sync_interval`` steps, on every rank) the outer step."""
        loss = self.optimizer.step(closure)
        for b in self.buckets:
            if not b.rule.due():
                b.rule.step(None)
                continue
            comp = _computes(b, b.params)
            with cuda_scope(b.params[0].device):
                b.rule.step(_arrays(comp))
            _write_back(b.params, comp)
        return loss


class DiLoCo(OuterLoop):
    """DiLoCo (Douillard et al. 2023) around any torch optimizer (docs/algorithm.md section 12).

    Every rank steps its own ``optimizer`` (the inner one, e.g. AdamW) with no communication.
    Every ``sync_interval`` steps, the pseudo-gradient ``anchor - x`` is averaged over the
    group (one allreduce), an outer Nesterov SGD step moves the anchor, and the parameters
    become the anchor on every rank. The inner optimizer's state stays local.

    Construction is collective: every rank's parameters are set to rank 0's. Do not wrap the
    model in DDP (it would average gradients every step).

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``).
        process_group: the group to average in (default: the default group; alone when
            torch.distributed is not initialised).
        mesh: instead of ``process_group``, for a model sharded by FSDP2 over ``mesh["shard"]``
            of a 2-D ``(replicate, shard)`` DeviceMesh: each rank's pieces are averaged over their
            replicas (docs/algorithm.md section 15.2); ConfigError for other meshes and
            placements (:class:`~slamb_comm.adapters.torch.fsdp.mesh.MeshSharding`'s checks), and for DTensor parameters
            without ``mesh=``. ``replicate``/``shard``: the mesh's dimension names.
        sync_interval: H, inner steps between outer steps (default 50).
        outer_lr: the outer learning rate (default 0.7). outer_momentum: Nesterov momentum
            in [0, 1) (default 0.9).
        value_dtype: the pseudo-gradient's dtype on the wire: 'float32' (default), 'float16'
            (half the bytes), or None (the parameters' compute dtype, float64 for float64).

    ``step(closure)`` returns the inner step's loss; :meth:`step_traffic` the bytes;
    ``state_dict()`` holds the inner state plus the anchor and outer momentum.
    """

    method = "DiLoCo"
    takes_mesh = True

    def __init__(self, optimizer, process_group=None, sync_interval=core.DEFAULT_INTERVAL, outer_lr=0.7,
                 outer_momentum=0.9, value_dtype="float32", *, mesh=None, replicate="replicate", shard="shard"):
        super().__init__(optimizer, process_group, lambda t, arrays, names: core.DiLoCo(
            t, arrays, sync_interval=sync_interval, outer_lr=outer_lr, outer_momentum=outer_momentum,
            value_dtype=value_dtype, names=names), mesh, replicate, shard)


class DesLoc(OuterLoop):
    """DES-LOC (Iacob et al., ICLR 2026) around an Adam-family torch optimizer (docs/algorithm.md section 12).

    Every rank steps its own ``optimizer`` with no communication; the parameters are averaged
    over the group every ``sync_interval`` steps, the first moment (``exp_avg``) every
    ``moment1_interval`` steps and the second (``exp_avg_sq``) every ``moment2_interval``
    steps, each on its own period. Construction is collective (rank 0's parameters everywhere).
    A parameter that has no optimizer state yet on a rank (no gradient so far) sends zeros for
    its moments there and keeps none.

    Args:
        optimizer: an Adam-family optimizer whose state has ``exp_avg`` and ``exp_avg_sq``
            (Adam, AdamW, NAdam, RAdam); TypeError otherwise (e.g. SGD: use :class:`DiLoCo`).
        process_group, mesh, replicate, shard: as :class:`DiLoCo` (with ``mesh=``, Adam's moments
            are averaged piece by piece too).
        sync_interval: Kx (default 50). moment1_interval: Ku (default ``3 * sync_interval``).
        moment2_interval: Kv (default ``6 * sync_interval``).
    """

    method = "DesLoc"
    takes_mesh = True

    def __init__(self, optimizer, process_group=None, sync_interval=core.DEFAULT_INTERVAL, moment1_interval=None,
                 moment2_interval=None, *, mesh=None, replicate="replicate", shard="shard"):
        if isinstance(optimizer, torch.optim.Optimizer) and "betas" not in optimizer.defaults:
            raise TypeError(f"DesLoc averages Adam's moments (state 'exp_avg', 'exp_avg_sq'); "
                            f"{type(optimizer).__name__} has none: wrap torch.optim.Adam/AdamW, or use DiLoCo, "
                            "which works with any optimizer")
        self._checked = False
        super().__init__(optimizer, process_group, lambda t, arrays, names: core.DesLoc(
            t, arrays, sync_interval=sync_interval, moment1_interval=moment1_interval,
            moment2_interval=moment2_interval, names=names), mesh, replicate, shard)

    def _moments(self, b, key):
        """Per parameter: the state tensor ``key``, or zeros where the parameter has no state yet."""
        out = []
        for p in b.params:
            st = self.optimizer.state.get(p) or {}
            if st and key not in st:
                raise TypeError(f"DesLoc averages the optimizer state {key!r}, which "
                                f"{type(self.optimizer).__name__} does not keep (its state has {sorted(st)}): "
                                "wrap torch.optim.Adam/AdamW, or use DiLoCo")
            out.append(st[key] if st else torch.zeros(local_of(p).shape, dtype=b.dtype, device=p.device))
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """The inner optimizer's step, then the averages that are due, on every rank."""
        loss = self.optimizer.step(closure)
        if not self._checked:  # after the first inner step: the state must be Adam's (same on every rank)
            for b in self.buckets:
                self._moments(b, "exp_avg"), self._moments(b, "exp_avg_sq")
            self._checked = True
        for b in self.buckets:
            due = b.rule.due()
            parts = {"x": b.params} if "x" in due else {}
            for name, key in (("m", "exp_avg"), ("v", "exp_avg_sq")):
                if name in due:
                    parts[name] = self._moments(b, key)
            comp = {n: _computes(b, ts) for n, ts in parts.items()}
            with cuda_scope(b.params[0].device):
                b.rule.step(**{n: _arrays(c) for n, c in comp.items()})
            for n, ts in parts.items():
                _write_back(ts, comp[n])
        return loss
