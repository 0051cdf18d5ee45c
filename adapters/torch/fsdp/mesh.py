"""A 2-D device mesh read as (replicas, pieces), for the optimizers of FSDP2-sharded models.

HSDP's layout with the replica allreduce taken out: the model sharded by
``fully_shard(module, mesh=mesh["shard"])`` over the ``"shard"`` dimension of a ``(replicate, shard)``
mesh. :class:`MeshSharding` checks the mesh and each parameter (FSDP2's ``Shard(0)`` over the shard
dimension) and holds the core's transports over each dimension; :class:`Piece` is one parameter's
piece on this rank; :class:`BackwardWatch` makes every rank of the mesh agree on a non-finite gradient
before ``backward()`` returns. Used by :class:`~.hybrid_slamb.HybridSLAMB`,
:class:`~.hybrid_topk.HybridTopK` and ``DiLoCo``/``DesLoc`` with ``mesh=``.
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

from slamb_comm.wire.layout import Shard
from slamb_comm.errors import ConfigError
from slamb_comm.exchange.status import problem_words, rejected_at_construction

from ..distributed.contract import queue_callback
from ..transport import TorchTransport
from ..tensors import is_dtensor, local_of

__all__ = ["Piece", "MeshSharding", "mesh_pieces", "BackwardWatch", "rank_bits", "ranks_of_bits"]


def rank_bits(ranks, world):
    """``ranks`` (global ranks of a ``world`` of that many) as float64 words of 31 bits each: summed over
    groups that count each rank once, distinct bits add up to their OR (exact in a float64)."""
    words = torch.zeros((world + 30) // 31, dtype=torch.float64)
    for r in ranks:
        words[r // 31] += float(1 << (r % 31))
    return words


def ranks_of_bits(words):
    """The ranks whose bits :func:`rank_bits` words (summed) hold."""
    return [31 * i + b for i, w in enumerate(words.tolist()) for b in range(31) if int(w) >> b & 1]


class Piece(NamedTuple):
    """One parameter's piece on this rank: its local shape and where it lies in the whole tensor."""

    local_shape: tuple
    shard: Shard


class MeshSharding:
    """A 2-D device mesh read as (replicas, pieces): the transports over each dimension and, per
    parameter, the piece this rank holds. ``replicate`` and ``shard`` name the mesh's dimensions;
    ``who``, the class its errors name (HybridSLAMB, HybridTopK, DiLoCo, ...)."""

    def __init__(self, mesh, replicate="replicate", shard="shard", who="HybridSLAMB"):
        self.who = who
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            raise ConfigError(
                f"a 1-D mesh {names or ''} is pure FSDP: every rank holds one piece and there are no replicas to "
                f"exchange with. {who} needs a 2-D mesh init_device_mesh(device, (R, S), mesh_dim_names="
                "('replicate', 'shard')) with the model sharded by fully_shard(module, mesh=mesh['shard'])")
        if mesh.ndim != 2 or names != (replicate, shard):
            raise ConfigError(
                f"{who} takes a 2-D mesh with dimensions ({replicate!r}, {shard!r}); got {mesh.ndim}-D "
                f"{names}. Meshes with other dimensions (tensor or context parallel) are not supported yet; "
                "pass replicate= and shard= if your dimensions have other names")
        self.mesh, self.shard_mesh = mesh, mesh[shard]
        self.replicas_group, self.pieces_group = mesh[replicate].get_group(), self.shard_mesh.get_group()
        #: the core's transports: over the replicas of this rank's pieces, and over the other pieces
        self.replicas, self.group = TorchTransport(self.replicas_group), TorchTransport(self.pieces_group)
        self.R, self.S, self.s = mesh.size(0), mesh.size(1), self.shard_mesh.get_local_rank()

    def piece(self, p, name):
        """Parameter ``p``'s :class:`Piece` on this rank; ConfigError for what is not supported."""
        if not is_dtensor(p):
            raise ConfigError(f"parameter {name!r} is not sharded: {self.who} takes a model whose parameters "
                              "fully_shard(module, mesh=mesh['shard']) sharded (wrap every module that holds "
                              "parameters, or the root)")
        where = p.device_mesh
        if where.ndim == 2:
            raise ConfigError(f"parameter {name!r} is sharded over the whole 2-D mesh: FSDP2 then all-reduces its "
                              "gradient across the replicas itself, densely. Shard over the pieces only: "
                              f"fully_shard(module, mesh=mesh['shard']); {self.who} makes the replica exchange")
        if where.mesh.tolist() != self.shard_mesh.mesh.tolist():
            raise ConfigError(f"parameter {name!r} is sharded over ranks {where.mesh.tolist()}, not over this "
                              f"mesh's shard dimension {self.shard_mesh.mesh.tolist()}")
        kinds = [type(pl).__name__ + str(getattr(pl, "dim", "")) for pl in p.placements]
        if kinds != ["Shard0"]:
            raise ConfigError(f"parameter {name!r} has placements {list(p.placements)}: {self.who} supports "
                              "FSDP2's default Shard(0) (no shard_placement_fn, no tensor parallel)")
        shape, local = tuple(p.shape), tuple(local_of(p).shape)
        n0 = shape[0] if shape else 1
        chunk = -(-n0 // self.S)
        start_row = min(self.s * chunk, n0)
        rows = min(start_row + chunk, n0) - start_row
        if local != (rows, *shape[1:]):
            raise ConfigError(f"parameter {name!r}: this rank's piece is {list(local)}, but rows {start_row}.."
                              f"{start_row + rows} of {list(shape)} were expected (torch.chunk's pieces)")
        inner = 1
        for d in shape[1:]:
            inner *= d
        return Piece(local, Shard(shape, start_row * inner))

    def global_rank(self, r):
        """The global rank of rank ``r`` of this rank's replica group."""
        return dist.get_global_rank(self.replicas_group, r)

    def agree_problem(self, problem):
        """Collective over the whole mesh, at construction: if some rank has a ``problem`` (its invalid option,
        kept by the constructor), that rank raises it and every other rank PeerError naming it (the highest
        such rank) and its error. Two allreduces of one word (its replicas, then its pieces), two more of the
        error's text where some rank has one."""
        me = dist.get_rank()
        word = torch.tensor([me + 1 if problem is not None else 0], dtype=torch.int64)
        for group in (self.replicas_group, self.pieces_group):  # together: every rank of the mesh once
            dist.all_reduce(word, op=dist.ReduceOp.MAX, group=group)
        culprit = int(word[0]) - 1
        if culprit < 0:
            return
        text = torch.from_numpy(problem_words(problem if me == culprit else None))
        for group in (self.replicas_group, self.pieces_group):
            dist.all_reduce(text, group=group)
        if problem is not None:
            raise problem
        raise rejected_at_construction([culprit], {culprit: text.numpy()})

    def broadcast(self, params):
        """Every piece from replica 0 to the other replicas (once, at construction)."""
        src = dist.get_global_rank(self.replicas_group, 0)
        with torch.no_grad():
            for p in params:
                dist.broadcast(local_of(p), src=src, group=self.replicas_group)


def mesh_pieces(mesh, named, who, replicate="replicate", shard="shard"):
    """:class:`MeshSharding` of ``mesh`` and the :class:`Piece` of every ``(name, parameter)`` in
    ``named``; ConfigError (naming ``who``) for what is not supported."""
    sharding = MeshSharding(mesh, replicate, shard, who=who)
    return sharding, [sharding.piece(p, name) for name, p in named]


class BackwardWatch:
    """Every rank learns, before ``backward()`` returns, whether any rank's gradient has a NaN or Inf,
    and then every rank's gradient pieces hold NaN: so a ``GradScaler`` skips (and halves its scale)
    on every rank alike, as under DDP, where the allreduce spreads an inf to every rank.

    FSDP2's all-reduce hook of every FSDP module of ``model`` notes whether its reduce-scatter output
    (this rank's pieces of that module's gradients) is finite (one pass, no host read); the first
    call of a backward pass queues a callback at its end (after FSDP2's own, which is queued before
    the first module reduces) that calls ``after()`` (HybridSLAMB's overlapped exchange starts what the
    backward pass left: :meth:`~.overlap.FsdpOverlap.end_of_backward`), sums the notes over the
    mesh (one bit per rank, in one float per 31 ranks, over the replicas, then over the pieces) and
    poisons the pieces if some rank's were not finite; :attr:`ranks` says which."""

    def __init__(self, model, sharding, params, after=None):
        modules = [m for m in model.modules() if hasattr(m, "set_all_reduce_hook")]
        if not modules:
            raise ConfigError("model= has no module that fully_shard sharded: pass the root module of the "
                              "sharded model")
        self.sharding, self.params, self.after = sharding, params, after
        self.bad, self.queued = None, False
        #: the global ranks whose gradients the last agreement found not finite (the optimizer takes them)
        self.ranks = []
        self.replica_bytes = 0  # what its agreements sent across the replicas since the last take_bytes()
        for m in modules:
            m.set_all_reduce_hook(self.note)

    def note(self, reduced):
        """FSDP2's hook: one module's reduce-scatter output on this rank."""
        bad = ~torch.isfinite(reduced).all()
        self.bad = bad if self.bad is None else self.bad | bad
        if not self.queued:
            try:
                queue_callback(self.agree)
                self.queued = True
            except RuntimeError:  # not inside a backward pass: step() agrees instead
                pass

    def take_bytes(self):
        """The bytes its agreements sent across the replicas since the last call."""
        sent, self.replica_bytes = self.replica_bytes, 0
        return sent

    def agree(self):
        """At the end of backward (or at step(), if no backward pass queued it): the collective
        decision, and the poison."""
        self.queued = False
        if self.bad is None:
            return
        if self.after is not None:
            self.after()
        me, world = dist.get_rank(), dist.get_world_size()
        word = rank_bits([me], world) * self.bad.to(device="cpu", dtype=torch.float64)  # this rank's bit, if bad
        self.bad = None
        dist.all_reduce(word, group=self.sharding.replicas_group)
        dist.all_reduce(word, group=self.sharding.pieces_group)
        self.replica_bytes += word.numel() * word.element_size()
        self.ranks = ranks_of_bits(word)
        if self.ranks:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        local_of(p.grad).fill_(float("nan"))
