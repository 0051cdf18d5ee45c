"""Checkpoints that resize: written by P ranks, read by P' (docs/algorithm.md section 10).

    bash scripts/mpirun.sh 4 600 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_resize.py

Sub-communicators of MPI_COMM_WORLD play the two jobs: at 4 ranks a checkpoint of 4 loads on 2
and on 3 ranks, and one of 2 on 4; at 2 ranks, 2 -> 1 and 1 -> 2. Each test writes the rule in
float64 from the old ranks' states (gathered before the save, not read from the files) and
checks what ``slamb_comm.methods.checkpoint.load`` made; the SLAMB test then trains on and compares
with the dense float64 reference of section 1 at P', started from the rule's state.
"""

import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from slamb_comm.methods import checkpoint
from slamb_comm.methods.slamb import SlambRule
from tests.support.slamb_reference import ReferenceSlamb
from mpi_tests.test_slamb import SHAPES, rank_grads, rank_params

pytestmark = pytest.mark.mpi

PAIRS = [(4, 2), (4, 3), (2, 4), (2, 1), (1, 2)]


def group(n):
    """A transport over world ranks 0..n-1 (None on the others), and its communicator."""
    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    return (None, None) if sub == MPI.COMM_NULL else (sc.MPITransport(sub), sub)


def fits(pair):
    W = MPI.COMM_WORLD.size
    if max(pair) > W or (W == 4 and 1 in pair) or W == 1:
        pytest.skip(f"{pair[0]} -> {pair[1]} ranks runs at world size {4 if 3 in pair or 4 in pair else 2}")


def shared_dir(tmp_path_factory):
    world = MPI.COMM_WORLD
    return world.bcast(str(tmp_path_factory.mktemp("resize")) if world.rank == 0 else None, root=0)


def mean64(arrays, dtype=None):
    """The rule's mean: the float64 sum in old rank order times 1/P, cast to the arrays' dtype."""
    acc = np.zeros(np.shape(arrays[0]), np.float64)
    for a in arrays:
        acc += a
    return (acc * (1.0 / len(arrays))).astype(dtype or np.asarray(arrays[0]).dtype)


H, RATIO, STEPS, MORE = 100, 0.25, 6, 4


def slamb_of(transport, x):
    return SlambRule(sc.Communicator(transport, x, ratio=RATIO, seed=11), lr=0.02, weight_decay=0.01, beta3=0.9,
                 sync_interval=H)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}to{p[1]}")
def test_slamb_checkpoint_resizes_by_the_rule_and_trains_on_as_the_reference(pair, tmp_path_factory):
    fits(pair)
    old, new = pair
    world, me = MPI.COMM_WORLD, MPI.COMM_WORLD.rank
    ckpt = shared_dir(tmp_path_factory) + "/ckpt"
    tr, sub = group(old)
    gathered = None
    if tr is not None:  # the old job: its parameters differ per rank after step 1 (H = 100)
        x = rank_params(me, np.float64)
        opt = slamb_of(tr, x)
        for t in range(1, STEPS + 1):
            opt.step(x, rank_grads(me, t, x, np.float64))
        sd = opt.state_dict()
        checkpoint.save(ckpt, {"x": x, "opt": sd}, tr)
        gathered = sub.gather((np.concatenate([a.ravel() for a in x]), sd["m"], sd["v"], sd["f"]), root=0)
    olds = world.bcast(gathered, root=0)
    world.Barrier()
    tr2, _ = group(new)
    failed = []
    if tr2 is not None:
        st = checkpoint.load(ckpt, tr2)
        want = {k: mean64([o[i] for o in olds]) for i, k in enumerate(("x", "m", "v"))}
        got_x = np.concatenate([a.ravel() for a in st["x"]])
        for k, got in (("x", got_x), ("m", st["opt"]["m"]), ("v", st["opt"]["v"])):
            if not np.array_equal(got, want[k]):
                failed.append(f"{k}: {np.max(np.abs(got - want[k])):.3g} from the rule's float64 mean")
        if not np.array_equal(st["opt"]["f"], olds[0][3]) or st["opt"]["step"] != STEPS:
            failed.append("freshness or step not kept")
        x = [a.copy() for a in st["x"]]
        opt = slamb_of(tr2, x)
        opt.load_state_dict(st["opt"])
        lay = opt.layout
        split = lambda flat: [flat[o:o + n].reshape(s) for o, n, s in zip(lay.offsets, lay.sizes, lay.shapes)]  # noqa: E731
        ref = ReferenceSlamb([split(want["x"])] * new, lay.offsets, lr=0.02, wd=0.01, beta3=0.9, H=H)
        ref.m = [[a.copy() for a in split(want["m"])] for _ in range(new)]
        ref.v = [[a.copy() for a in split(want["v"])] for _ in range(new)]
        ref.f = [a.copy() for a in split(olds[0][3].astype(np.float64))]
        ref.t = STEPS
        for t in range(STEPS + 1, STEPS + MORE + 1):
            grads = [rank_grads(r, t, ref.x[r], np.float64) for r in range(new)]
            opt.step(x, [g.copy() for g in grads[me]])
            ref.step(grads, opt.comm.mask.select(t).index.astype(np.int64))
        worst = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(x, ref.x[me]))
        if worst > 1e-9:
            failed.append(f"after the resize, {worst:.3g} from section 1's reference at P' = {new}")
    world.Barrier()
    assert not failed, f"rank {me}: {failed}"


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}to{p[1]}")
def test_topk_residuals_average_and_onebit_server_errors_rechunk(pair, tmp_path_factory):
    """TopK's error buffers become their mean; 1-bit LAMB's worker errors their mean, and its
    server errors (one chunk per old rank) are cut anew: concatenated over the new ranks they
    are the old concatenation, element for element. Both exchange on afterwards."""
    fits(pair)
    old, new = pair
    world, me = MPI.COMM_WORLD, MPI.COMM_WORLD.rank
    ckpt = shared_dir(tmp_path_factory) + "/ckpt"

    def comm_of(tr, x):
        return sc.Communicator(tr, x, ratio=0.1, seed=5, dense_threshold=0)

    tr, sub = group(old)
    gathered = None
    n = sum(int(np.prod(s)) for s in SHAPES)
    if tr is not None:
        x = [a.astype(np.float32) for a in rank_params(me, np.float32)]
        c = comm_of(tr, x)
        for t in range(1, 4):
            c.sparse_allgather(rank_grads(me, t, x, np.float32))
            c.onebit_allreduce(rank_grads(me, 10 + t, x, np.float32))
        sd = c.state_dict()
        checkpoint.save(ckpt, sd, tr)
        ob = sd["onebit"]
        gathered = sub.gather((sd["residual"], ob["worker_error"][:n], ob["server_error"]), root=0)
    olds = world.bcast(gathered, root=0)
    world.Barrier()
    tr2, sub2 = group(new)
    failed = []
    if tr2 is not None:
        x = [a.astype(np.float32) for a in rank_params(me, np.float32)]
        c = comm_of(tr2, x)
        c.load_state_dict(checkpoint.load(ckpt, tr2))
        if not np.array_equal(c.residual, mean64([o[0] for o in olds])):
            failed.append("TopK residual is not the old ranks' mean")
        ex = c.onebit  # the exchange whose errors were re-chunked
        if not np.array_equal(ex.worker_error[:n], mean64([o[1] for o in olds])) or ex.worker_error[n:].any():
            failed.append("1-bit worker error is not the old ranks' mean, padded anew")
        mine = sub2.allgather(ex.server_error)
        if not np.array_equal(np.concatenate(mine)[:n], np.concatenate([o[2] for o in olds])[:n]):
            failed.append("1-bit server errors were not cut anew from the old concatenation")
        for t in range(4, 6):  # and the exchanges go on
            c.sparse_allgather(rank_grads(me, t, x, np.float32))
            c.onebit_allreduce(rank_grads(me, 10 + t, x, np.float32))
    world.Barrier()
    assert not failed, f"rank {me}: {failed}"


def test_resize_false_refuses_and_same_size_is_bitwise(tmp_path_factory):
    world, me = MPI.COMM_WORLD, MPI.COMM_WORLD.rank
    ckpt = shared_dir(tmp_path_factory) + "/ckpt"
    tr = sc.MPITransport()
    state = {"x": rank_params(me, np.float32), "rng": np.array([me]), "step": 3}
    checkpoint.save(ckpt, state, tr)
    got = checkpoint.load(ckpt, tr)
    assert all(np.array_equal(a, b) for a, b in zip(got["x"], state["x"])) and got["rng"][0] == me
    if world.size > 1:
        solo = sc.MPITransport(MPI.COMM_SELF)
        with pytest.raises(checkpoint.CheckpointError, match="resize=False"):
            checkpoint.load(ckpt, solo, resize=False)
        one = checkpoint.load(ckpt, solo)  # every old rank averaged into one; the integer one taken from rank 0
        assert one["rng"][0] == 0 and one["step"] == 3
        assert np.array_equal(one["x"][0], mean64([rank_params(r, np.float32)[0] for r in range(world.size)]))
