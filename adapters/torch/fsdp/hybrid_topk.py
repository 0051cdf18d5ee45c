"""Top-k with error feedback for any torch optimizer, across the replicas of a model sharded by FSDP2.

The layout of :mod:`.hybrid_slamb` (HSDP's, with the replica allreduce taken out): a 2-D mesh
``(replicate, shard)``, the model sharded by ``fully_shard(module, mesh=mesh["shard"])``, so FSDP2
reduce-scatters each gradient inside a shard group and nothing crosses the replicas. Where HSDP
would all-reduce every gradient piece across the replicas densely, :class:`HybridTopK` exchanges
each rank's gradient pieces with their replicas through the core's top-k exchange with error
feedback (:meth:`slamb_comm.Communicator.sparse_allgather`, docs/algorithm.md section 2), writes
the mean into the local gradient pieces, and steps the wrapped optimizer::

    mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = HybridTopK(torch.optim.AdamW(model.parameters(), lr=3e-4), mesh, compression=slamb_comm.TopK(0.01))

**Top-k is taken per piece** (docs/algorithm.md section 15.1): each rank sends the
``max(1, round(ratio * n))`` largest entries of its own piece of ``n`` elements, so the result is
top-k with error feedback at ``R`` ranks on the whole tensors *with each tensor cut into its S
pieces*, not the unsharded top-k of the whole tensor (that would need a selection across the
shard group). The always-dense rule of ``TopK(dense_threshold=T)`` reads the whole tensor's shape,
so a tensor is sent whole, or not, whatever S is. The error buffers (one per piece) are this
rank's and part of ``state_dict()``.

The checks of the mesh and of each parameter are :class:`~.mesh.MeshSharding`'s (a clear
ConfigError for a 1-D mesh, parameters sharded over the whole mesh, other placements, unsharded
parameters). Construction broadcasts every piece from replica 0 (replicas start equal).
Not supported: an AMP GradScaler (unscale before ``step()``), ``op=Sum``, parameters added after
construction, the exchange from FSDP2's hooks (it runs in ``step()``).
"""


import torch
import torch.distributed as dist

from slamb_comm import arrays as _arr
from slamb_comm.wire.codecs import TopK
from slamb_comm.wire.layout import Layout
from slamb_comm.exchange.communicator import Communicator
from slamb_comm.errors import ConfigError, NonFiniteError, PeerError
from slamb_comm.wire.stats import Traffic, allreduce_wire

from ..params import run_closure
from ..tensors import as_compute, cuda_scope, local_of, state_dtype, tensor_of
from ..optim.bucket import Bucket, BucketKey
from ..optim.ledger import StepLedger
from ..distributed.contract import nonfinite_error
from .mesh import mesh_pieces, rank_bits, ranks_of_bits

__all__ = ["HybridTopK"]


# the verdicts of one step's exchange, agreed over the shard group (the worst wins)
_OK, _NON_FINITE, _FAILED = 0, 1, 2


class HybridTopK(torch.optim.Optimizer):
    """Top-k gradient exchange with error feedback across the replicas of an FSDP2-sharded model,
    around any torch optimizer (see the module's docstring; docs/algorithm.md section 15.1).

    It shares the wrapped optimizer's ``param_groups`` and ``state`` (LR schedulers and
    ``zero_grad`` act on it). ``step(closure)``: the closure (if any); then every rank's gradient
    pieces go through the top-k exchange over its replica group (one allgather per (device, dtype)
    bucket); ``local_of(p.grad)`` becomes the mean over the ``R`` replicas of their decoded top-k;
    then the wrapped optimizer steps on the DTensor parameters.

    Args:
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``) over the sharded parameters.
        mesh: the 2-D DeviceMesh ``(replicate, shard)`` the model was sharded on (over ``mesh[shard]``).
        compression: a :class:`slamb_comm.TopK` (default ``TopK(0.01)``): ratio, ``value_dtype``,
            ``on_nonfinite``, ``dense_threshold`` (read on the whole tensors' shapes).
        replicate, shard: the names of the mesh's dimensions.
        named_parameters: optional ``(name, parameter)`` pairs, for error messages.

    Gradients: a parameter whose gradient is None on some ranks and not others counts as a zero
    gradient there; None everywhere: left as it is (no exchange, error buffer kept). Non-finite
    gradients (as :class:`DistributedOptimizer` with ``TopK``): the exchange fails in the replica
    group that holds them, and one allreduce of one float over the shard group makes every rank of
    the mesh agree: under ``on_nonfinite='skip'`` every rank skips the step (gradients set to NaN,
    ``skipped_steps`` counted, the error buffers unchanged), under ``'raise'`` every rank raises
    NonFiniteError. Bad input on one rank: it raises its error, every other rank PeerError.
    """

    def __init__(self, optimizer, mesh, compression=None, replicate="replicate", shard="shard", named_parameters=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"HybridTopK wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        compression = TopK(0.01) if compression is None else compression
        if not isinstance(compression, TopK):
            raise ConfigError(f"HybridTopK takes compression=slamb_comm.TopK(ratio), got {compression!r}")
        self.optimizer, self._compression = optimizer, compression
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.state = optimizer.state
        names = {id(p): n for n, p in (named_parameters or ())}
        named = [(names.get(id(p), f"group{gi}.{pi}"), p) for gi, g in enumerate(optimizer.param_groups)
                 for pi, p in enumerate(g["params"]) if p.requires_grad]
        self._sharding, pieces = mesh_pieces(mesh, named, "HybridTopK", replicate, shard)
        self._sharding.agree_problem(compression.problem)  # an invalid option on some rank: an error on every rank
        self._sharding.broadcast([p for _, p in named])
        self._params = [p for _, p in named]
        keyed, group_of = {}, {p: g for g in optimizer.param_groups for p in g["params"]}
        for (name, p), piece in zip(named, pieces):
            keyed.setdefault((p.device, state_dtype(p.dtype)), []).append((name, p, piece))
        self._buckets, c = [], compression
        for (device, dtype), items in keyed.items():  # collective over the replica group, in the same order everywhere
            b = Bucket(BucketKey(str(device), str(dtype), None, 0), [p for _, p, _ in items],
                       [group_of[p] for _, p, _ in items], [n for n, _, _ in items], dtype)
            layout = Layout([pc.local_shape for _, _, pc in items], b.np_dtype, names=b.names,
                            dense_threshold=c.dense_threshold or 0, shards=[pc.shard for _, _, pc in items])
            b.comm = Communicator(self._sharding.replicas, layout, ratio=c.ratio, value_dtype=c.value_dtype, seed=0,
                                  topk_dense=c.dense_threshold is not None)
            self._buckets.append(b)
        self.ledger = StepLedger("HybridTopK")
        self._synchronized = self._step_ok = False

    @property
    def communicators(self):
        """The :class:`slamb_comm.Communicator` of every bucket (for statistics)."""
        return [b.comm for b in self._buckets]

    def step_traffic(self):
        """Bytes across the replicas of the step just finished, summed over buckets (a
        :class:`slamb_comm.Traffic`; the dense reference is HSDP's replica allreduce of the
        pieces), and start counting anew."""
        return self.ledger.traffic([c.stats for c in self.communicators])

    @property
    def skipped_steps(self):
        """Steps skipped on every rank for a non-finite gradient (``on_nonfinite='skip'``)."""
        return self.ledger.skipped_steps()

    def _present(self):
        """Per parameter: whether some rank of the mesh has a gradient for it (zeros where this
        rank has none and another has; None everywhere: skipped)."""
        have = torch.tensor([float(p.grad is not None) for p in self._params], dtype=torch.float64)
        if self._params:
            dist.all_reduce(have, group=self._sharding.replicas_group)
            dist.all_reduce(have, group=self._sharding.pieces_group)
            if self._buckets:  # counted where step_traffic() reads: every byte across the replicas
                n, R = have.numel() * have.element_size(), self._sharding.R
                self._buckets[0].comm.stats.record("control", Traffic.one_call(
                    payload_bytes=n, wire_bytes=allreduce_wire(n, R), dense_bytes=0, size=R,
                    elements_sent=have.numel(), elements_total=0))
        nowhere = set()
        for p, n in zip(self._params, have.tolist()):
            if n == 0:
                nowhere.add(p)
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
        return nowhere

    @torch.no_grad()
    def synchronize(self):
        """The exchange alone: ``local_of(p.grad)`` becomes the mean over the replicas of their
        decoded top-k (all buckets or none, agreed over the whole mesh). Returns False where the
        step is to be skipped (a non-finite gradient somewhere, ``on_nonfinite='skip'``)."""
        self._synchronized = self._step_ok = False  # until this exchange is through (an error leaves them so)
        nowhere = self._present()
        means, err = [], None
        try:
            for b in self._buckets:
                grads = [_arr.as_array(as_compute(local_of(p.grad), b.dtype)) if p.grad is not None
                         else _arr.as_array(torch.zeros(shape, dtype=b.dtype, device=p.device))
                         for p, shape in zip(b.params, b.comm.layout.shapes)]
                with cuda_scope(b.params[0].device):  # commit only once every bucket, on every rank, succeeded
                    means.append(b.comm.sparse_allgather(grads, commit=False))
        except Exception as e:  # on every rank of this replica group alike
            err = e
        verdict, ranks = self._agree_verdict(err)
        if verdict == _FAILED:
            if err is not None and not isinstance(err, NonFiniteError):
                raise err
            raise PeerError("the top-k exchange failed in another replica group of this mesh (see its ranks' "
                            "error); nothing changed")
        if verdict == _NON_FINITE:
            err = nonfinite_error("HybridTopK's top-k exchange", ranks, [], "nothing was changed")
            if self._compression.on_nonfinite == "raise":
                raise err
            self._skip(err)
            self._synchronized = True
            return False
        for b in self._buckets:
            with cuda_scope(b.params[0].device):  # from the local gradients, still as the exchange took them
                b.comm.commit_residual(skip={i for i, p in enumerate(b.params) if p in nowhere})
        for b, mean in zip(self._buckets, means):
            for p, m in zip(b.params, mean):
                if p in nowhere:
                    continue
                g = local_of(p.grad)
                g.copy_(tensor_of(m).view(g.shape).to(g.dtype))
        self._synchronized = self._step_ok = True
        return True

    def _agree_verdict(self, err):
        """Over the shard group: the step's verdict (the worst of its replica groups': :data:`_FAILED`, then
        :data:`_NON_FINITE`) and the global ranks whose gradients were not finite, from this replica group's
        exchange error ``err``. One allreduce of a few floats (each replica group counted once)."""
        sh = self._sharding
        bad = err.ranks if isinstance(err, NonFiniteError) else ()
        counts = torch.tensor([float(err is not None and not isinstance(err, NonFiniteError)),
                               float(isinstance(err, NonFiniteError))], dtype=torch.float64)
        word = torch.cat([counts, rank_bits([sh.global_rank(r) for r in bad], dist.get_world_size())])
        dist.all_reduce(word, group=sh.pieces_group)
        verdict = _FAILED if word[0] > 0 else _NON_FINITE if word[1] > 0 else _OK
        return verdict, ranks_of_bits(word[2:])

    def _skip(self, err):
        """On every rank alike: NaN gradients (so an AMP GradScaler would skip too), no inner step."""
        for p in self._params:
            if p.grad is not None:
                local_of(p.grad).fill_(float("nan"))
        self.ledger.skip(err if err is not None else "non-finite gradients in another replica group")

    def step(self, closure=None):
        """The closure (if any), the exchange (unless :meth:`synchronize` ran since the last step),
        then the wrapped optimizer's step on the mean (skipped on every rank after a non-finite
        gradient under ``on_nonfinite='skip'``). Returns the closure's loss."""
        loss = run_closure(closure)
        if not self._synchronized:
            self.synchronize()  # raises (on every rank) with nothing changed, or returns with _synchronized set
        self._synchronized = False
        if self._step_ok:
            self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """The wrapped optimizer's state, plus this rank's error buffers under ``'slamb_comm_topk'``
        (pieces: save one file per rank)."""
        sd = self.optimizer.state_dict()
        sd["slamb_comm_topk"] = [
            {"residual": None if b.comm.residual is None else torch.from_numpy(_arr.to_host(b.comm.residual).copy()),
             "seed": int(b.comm.seed), "digest": b.comm.state_dict()["digest"]}
            for b in self._buckets
        ]
        return sd

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output, error buffers included, exactly."""
        state_dict = dict(state_dict)
        mine = state_dict.pop("slamb_comm_topk", None)
        self.optimizer.load_state_dict(state_dict)
        self.state, self.param_groups = self.optimizer.state, self.optimizer.param_groups
        if mine is not None:
            if len(mine) != len(self._buckets):
                raise ValueError(f"the saved top-k state has {len(mine)} buckets, this HybridTopK {len(self._buckets)}")
            for b, s in zip(self._buckets, mine):
                st = b.comm.state_dict()
                st.update(seed=s["seed"], digest=s["digest"],
                          residual=None if s["residual"] is None else s["residual"].numpy())
                b.comm.load_state_dict(st)

