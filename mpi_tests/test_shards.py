"""SLAMB on sharded tensors (docs/algorithm.md section 15): the ranks form an R x S grid (R replicas,
each tensor cut into S row pieces as FSDP2's ``Shard(0)`` cuts it); the momentum exchange runs over
the replicas of a piece, the norms over the pieces. Compared, at every step, with the dense float64
reference of SLAMB at R ranks on whole tensors (tests/support/slamb_reference.py), at every R x S grid
of the MPI world (1, 2 and 4 ranks: 1x1, 1x2, 2x1, 1x4, 2x2, 4x1)."""


import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from slamb_comm.wire.layout import Layout, Shard
from slamb_comm.wire.masks import CyclicMask
from slamb_comm.methods.slamb import SlambRule

from tests.support.slamb_reference import ReferenceSlamb

from tests.support import strict_cupy  # noqa: E402  (the device kernels run on the CPU through it)

# (3, 5000): at 4 pieces of 1, 1, 1 and 0 rows (one rank holds nothing of it); (30, 40) and (200,)
# are always dense; the others compressible
SHAPES = [(61, 200), (200,), (30, 40), (3, 5000)]


def grids(P):
    return [(R, P // R) for R in range(1, P + 1) if P % R == 0]


def rows(n0, S, s):
    """FSDP2's Shard(0) piece s of S (torch.chunk's sizes): rows [a, b)."""
    c = -(-n0 // S)
    a = min(s * c, n0)
    return a, min(a + c, n0)


def piece(a, S, s):
    lo, hi = rows(a.shape[0], S, s)
    return a[lo:hi]


def whole_params(r):
    rng = np.random.default_rng(100 + r)
    return [rng.standard_normal(s) for s in SHAPES]


def whole_grads(r, t, xs):
    rng = np.random.default_rng([7, r, t])
    return [0.5 * x + rng.standard_normal(x.shape) for x in xs]


def build(R, S, ratio, seed=11, H=4, **kw):
    """This rank's piece of replica r: (x, opt, replica index, piece index)."""
    world = MPI.COMM_WORLD
    me = world.rank
    r, s = me // S, me % S
    replicas, pieces = world.Split(color=s, key=r), world.Split(color=r, key=s)
    x = [np.ascontiguousarray(piece(a, S, s)) for a in whole_params(r)]
    shards = [Shard(shape, rows(shape[0], S, s)[0] * int(np.prod(shape[1:]))) for shape in SHAPES]
    lay = Layout([a.shape for a in x], "float64", shards=shards)
    comm = sc.Communicator(sc.MPITransport(replicas), lay, ratio=ratio, seed=seed)
    opt = SlambRule(comm, lr=0.02, weight_decay=0.01, beta3=0.9, sync_interval=H,
                    shard_group=sc.MPITransport(pieces), **kw)
    return x, opt, r, s


@pytest.mark.mpi
@pytest.mark.parametrize("ratio", [0.1, 0.3])
def test_sharded_slamb_matches_the_unsharded_reference(ratio):
    P = MPI.COMM_WORLD.size
    whole = Layout(SHAPES, "float64")
    for R, S in grids(P):
        x, opt, r, s = build(R, S, ratio)
        ref = ReferenceSlamb([whole_params(q) for q in range(R)], whole.offsets, lr=0.02, wd=0.01, beta3=0.9, H=4)
        mask = CyclicMask(whole, ratio, 11)
        worst = 0.0
        for t in range(1, 13):
            if t == 7:  # a ratio change mid-run: both masks number the whole tensors' units
                opt.set_ratio(0.5)
                mask = mask.rebased(0.5, 6)
            grads = [whole_grads(q, t, ref.x[q]) for q in range(R)]
            opt.step(x, [np.ascontiguousarray(piece(g, S, s)) for g in grads[r]])
            ref.step(grads, mask.select(t).index.astype(np.int64))
            for mine, want in zip(x, ref.x[r]):
                want = piece(want, S, s)
                if want.size:
                    worst = max(worst, float(np.max(np.abs(mine - want)) / np.max(np.abs(want))))
        assert worst < 1e-9, (R, S, worst)
        assert opt.t == 12


@pytest.mark.mpi
def test_sharded_slamb_on_the_device_kernels_matches_the_unsharded_reference():
    """The device kernels (a GPU's path) on one fused buffer of pieces, through the strict double:
    the pieces' norms summed over the shard group between the moments and the trust kernels."""
    P = MPI.COMM_WORLD.size
    whole = Layout(SHAPES, "float64")
    with strict_cupy.install() as cp:
        strict_cupy.Device.current = 0
        for R, S in grids(P):
            strict_cupy.reset_counts()
            x, opt, r, s = build(R, S, 0.1)
            flat = cp.asarray(np.concatenate([a.ravel() for a in x]))
            ref = ReferenceSlamb([whole_params(q) for q in range(R)], whole.offsets, lr=0.02, wd=0.01, beta3=0.9, H=4)
            mask, worst = CyclicMask(whole, 0.1, 11), 0.0
            for t in range(1, 8):
                grads = [whole_grads(q, t, ref.x[q]) for q in range(R)]
                opt.step(flat, cp.asarray(np.concatenate([piece(g, S, s).ravel() for g in grads[r]])))
                ref.step(grads, mask.select(t).index.astype(np.int64))
                for mine, want in zip(opt.layout.views(flat.get()), ref.x[r]):
                    want = piece(want, S, s)
                    if want.size:
                        worst = max(worst, float(np.max(np.abs(mine - want)) / np.max(np.abs(want))))
            assert worst < 1e-9, (R, S, worst)
            updates = sum(n for op, n in strict_cupy.launches.items() if op.startswith("kernel(slamb_update"))
            assert updates == 7, "the device kernels did not take every step"


@pytest.mark.mpi
def test_a_pieces_mask_is_the_unsharded_mask_restricted_to_it():
    """The layouts of the replicas of a piece agree by construction (the communicator checked it at
    construction), and the pieces' payloads add up to the unsharded payload at every step."""
    P = MPI.COMM_WORLD.size
    whole = Layout(SHAPES, "float64")
    for R, S in grids(P):
        x, opt, r, s = build(R, S, 0.25)
        gm = CyclicMask(whole, 0.25, 11)
        for t in range(1, 6):
            counts = [opt.comm.mask.count(t, i) if opt.layout.sizes[i] else 0 for i in range(len(SHAPES))]
            summed = MPI.COMM_WORLD.allreduce(np.array(counts) if r == 0 else 0 * np.array(counts))
            want = [gm.count(t, i) for i in range(len(SHAPES))]
            assert list(summed) == want, (R, S, t)


@pytest.mark.mpi
def test_a_non_finite_piece_skips_the_step_on_every_rank():
    P = MPI.COMM_WORLD.size
    for R, S in grids(P):
        x, opt, r, s = build(R, S, 0.1)
        before = [a.copy() for a in x]
        g = [np.ones_like(a) for a in x]
        if MPI.COMM_WORLD.rank == P - 1:
            g[0].flat[0] = np.inf
        opt.step(x, g)
        assert opt.t == 0 and opt.skipped_steps == 1, (R, S)
        assert all(np.array_equal(a, b) for a, b in zip(x, before))
        opt.step(x, [np.ones_like(a) for a in x])
        assert opt.t == 1


def test_sharded_layouts_refuse_what_they_cannot_do():
    lay = Layout([(2, 40)], "float32", shards=[Shard((4, 40), 80)], dense_threshold=10)
    with pytest.raises(sc.ConfigError, match="shard_group"):
        SlambRule(sc.Communicator(sc.LocalTransport(), lay, ratio=0.1))
    with pytest.raises(sc.ConfigError, match="mask='cyclic'"):
        sc.Communicator(sc.LocalTransport(), lay, ratio=0.1, mask="bernoulli")
    with pytest.raises(sc.ConfigError, match="block=1"):
        sc.Communicator(sc.LocalTransport(), lay, ratio=0.1, block=4)
    with pytest.raises(sc.ConfigError, match="does not fit"):
        Layout([(2, 40)], "float32", shards=[Shard((2, 40), 40)])
