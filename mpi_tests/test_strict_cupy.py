"""The core's CuPy branches across ranks, on the CPU through the strict CuPy double
(tests/strict_cupy.py), over the three ways device buffers travel:

* ``mpi-staged``: :class:`MPITransport` copying through host memory (MPI without CUDA);
* ``mpi-direct``: :class:`MPITransport(cuda_aware=True)`, handing MPI the arrays themselves
  (the double's ``__cuda_array_interface__`` points at host memory, so plain MPI can read it);
* ``nccl``: :class:`NCCLTransport` on the double's NCCL, which runs its collectives over MPI.

Each is compared with the NumPy path, and SLAMB with the dense float64 reference of
ALGORITHM.md section 1, at 1, 2 and 4 ranks; host reads per step are counted.
"""

import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from slamb_comm.slamb import Slamb

from slamb_reference import ReferenceSlamb

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import strict_cupy  # noqa: E402

WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank
SHAPES = [(60, 200), (200,), (30, 40), (40, 250)]  # (30, 40) is below the dense threshold


@pytest.fixture(scope="module")
def cp():
    with strict_cupy.install() as mod:
        yield mod


def transport(kind):
    if kind == "mpi-staged":
        return sc.MPITransport(cuda_aware=False)
    if kind == "mpi-direct":
        return sc.MPITransport(cuda_aware=True)
    return sc.NCCLTransport(abort_on_exception=False)


KINDS = ["mpi-staged", "mpi-direct", "nccl"]


def rank_arrays(xp, r, seed, dtype=np.float32, shapes=SHAPES):
    rng = np.random.default_rng([seed, r])
    return [xp.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]


def host(a):
    if isinstance(a, (list, tuple)):
        return np.concatenate([np.array(sc.arrays.to_host(x)).ravel() for x in a])
    return np.array(sc.arrays.to_host(a))


def exchanges(xp, kind, mask, vdt):
    comm = sc.Communicator(transport(kind) if xp is not np else sc.MPITransport(), rank_arrays(xp, ME, 0),
                           ratio=0.1, mask=mask, value_dtype=vdt, seed=17, bucket_bytes=20_000)
    out = []
    for step in (1, 2):
        x = rank_arrays(xp, ME, 10 + step)
        _, idx = comm.masked_allreduce(x, step)
        out += [host(x), host(idx)]
        g = rank_arrays(xp, ME, 20 + step)
        out += [host(comm.sparse_allgather(g)), host(comm.residual).copy()]
        s = rank_arrays(xp, ME, 30 + step)
        comm.sync(s)
        out.append(host(s))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("vdt", ["float32", "float16"])
@pytest.mark.parametrize("mask", ["cyclic", "topk"])
@pytest.mark.parametrize("kind", KINDS)
def test_exchanges_equal_the_numpy_path(cp, kind, mask, vdt):
    ref = exchanges(np, None, mask, vdt)
    got = exchanges(cp, kind, mask, vdt)
    # the double's NCCL sums in float64 and rounds once; MPI adds in the payload's dtype
    tol = dict(rtol=0, atol=0) if kind != "nccl" or P < 3 else dict(rtol=2e-6, atol=1e-7)
    if vdt == "float16" and kind == "nccl" and P > 1:
        tol = dict(rtol=1e-3, atol=1e-3)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, **tol)
    assert all(np.array_equal(WORLD.allgather(got[-1])[r], got[-1]) for r in range(P))  # synced everywhere


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask", ["cyclic", "bernoulli"])
def test_slamb_on_the_device_matches_the_dense_reference(cp, kind, mask):
    x = rank_arrays(cp, ME, 100)
    comm = sc.Communicator(transport(kind), x, ratio=0.1, mask=mask, seed=11)
    opt = Slamb(comm, lr=0.02, weight_decay=0.01, beta3=0.9, sync_interval=4)
    ref = ReferenceSlamb([rank_arrays(np, r, 100) for r in range(P)], comm.layout.offsets, lr=0.02, wd=0.01,
                         beta3=0.9, H=4)
    worst = 0.0
    for t in range(1, 10):
        grads = [[(0.5 * a + np.random.default_rng([7, r, t]).standard_normal(a.shape)).astype(np.float32)
                  for a in ref.x[r]] for r in range(P)]
        opt.step(x, [cp.asarray(g) for g in grads[ME]])
        ref.step([[g.astype(np.float64) for g in gr] for gr in grads], np.asarray(comm.mask.select(t).index))
        mine = host(x)
        want = np.concatenate([a.ravel() for a in ref.x[ME]])
        worst = max(worst, float(np.max(np.abs(mine - want)) / np.max(np.abs(want))))
        if (t - 1) % 4 == 0:
            assert all(np.array_equal(v, mine) for v in WORLD.allgather(mine)), f"step {t}: replicas differ"
    assert worst < 1e-5, worst
    assert isinstance(opt.m, cp.ndarray)


@pytest.mark.mpi
@pytest.mark.parametrize("tensors", [1, 100])
def test_host_reads_per_slamb_step_with_nccl(cp, tensors):
    """At most two per step, periodic-sync steps included, for 1 and for 100 tensors: the
    exchange's status word, and the sync's."""
    shapes = [(64, 160)] * tensors
    x = rank_arrays(cp, ME, 5, shapes=shapes)
    comm = sc.Communicator(transport("nccl"), x, ratio=0.1, seed=3, value_dtype="float16")
    opt = Slamb(comm, lr=0.01, sync_interval=2)
    counts = []
    for t in range(1, 5):
        g = rank_arrays(cp, ME, 40 + t, shapes=shapes)
        strict_cupy.reset_syncs()
        opt.step(x, g)
        counts.append(strict_cupy.total_syncs())
    syncs = 1 if P > 1 else 0  # steps 1 and 3 average the parameters (one rank has nothing to average)
    assert counts == [1 + syncs, 1, 1 + syncs, 1], (counts, dict(strict_cupy.syncs))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["mpi-staged", "mpi-direct"])
def test_host_reads_per_slamb_step_with_mpi(cp, kind):
    """MPI does not know CUDA streams: each collective costs one more synchronisation (staging
    through the host, or waiting for the stream before handing MPI the pointer)."""
    shapes = [(64, 160)] * 10
    x = rank_arrays(cp, ME, 5, shapes=shapes)
    comm = sc.Communicator(transport(kind), x, ratio=0.1, seed=3)
    opt = Slamb(comm, lr=0.01, sync_interval=2)
    counts = []
    for t in range(1, 3):
        g = rank_arrays(cp, ME, 40 + t, shapes=shapes)
        strict_cupy.reset_syncs()
        opt.step(x, g)
        counts.append(strict_cupy.total_syncs())
    # step 1: exchange (1 collective + its status) and sync (1 bucket + its status); step 2: exchange
    assert counts == [4 if P > 1 else 2, 2], (counts, dict(strict_cupy.syncs))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_odd_float16_topk_payloads_stay_aligned(cp, kind):
    """Defect 1: rank r >= 1's payload started 2 bytes off a multiple of 4 when K was odd with
    float16 values, and its int32 indices faulted on a GPU (the double raises)."""
    x = [cp.ones((10, 1223), np.float32)]
    comm = sc.Communicator(transport(kind), x, ratio=0.1, value_dtype="float16", seed=1)
    assert comm.wire.k_total % 2 == 1
    out = comm.sparse_allgather([cp.full((10, 1223), float(ME + 1), np.float32)])
    assert isinstance(out[0], cp.ndarray)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_on_one_rank_raises_on_every_rank(cp, kind):
    """Defect 8: a bfloat16 device tensor used to raise CuPy's own error on that rank only."""
    if P == 1:
        pytest.skip("needs two ranks")

    comm = sc.Communicator(transport(kind), rank_arrays(cp, ME, 0), ratio=0.1, seed=1)
    x = rank_arrays(cp, ME, 1)
    if ME == P - 1:
        x[0] = strict_cupy.Bfloat16CudaTensor((60, 200))
        with pytest.raises(sc.DTypeError, match="bfloat16"):
            comm.masked_allreduce(x, 1)
    else:
        with pytest.raises(sc.PeerError) as err:
            comm.masked_allreduce(x, 1)
        assert err.value.ranks == (P - 1,)
    comm.sync(rank_arrays(cp, ME, 2))  # and the next collective works
