"""The core's CuPy branches across ranks, on the CPU through the strict CuPy double
(tests/support/strict_cupy.py), over the three ways device buffers travel:

* ``mpi-staged``: :class:`MPITransport` copying through host memory (MPI without CUDA);
* ``mpi-direct``: :class:`MPITransport(cuda_aware=True)`, handing MPI the arrays themselves
  (the double's ``__cuda_array_interface__`` points at host memory, so plain MPI can read it);
* ``nccl``: :class:`NCCLTransport` on the double's NCCL, which runs its collectives over MPI.

Each is compared with the NumPy path, and SLAMB with the dense float64 reference of
docs/algorithm.md section 1, at 1, 2 and 4 ranks; host reads per step are counted. The transports'
own defects (NCCL's stream ordering, asking MPI whether it is CUDA-aware) are tested here
too: they initialise MPI, which must not happen in the single-process suite (an ``mpirun``
started later from that process would fail).
"""


import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from tests.support.mpi_checks import DEVICE_TRANSPORTS, device_transport
from slamb_comm.methods.slamb import SlambRule

from tests.support.slamb_reference import ReferenceSlamb

from tests.support import strict_cupy  # noqa: E402

WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank
SHAPES = [(60, 200), (200,), (30, 40), (40, 250)]  # (30, 40) is below the dense threshold


@pytest.fixture(scope="module")
def cp():
    with strict_cupy.install() as mod:
        yield mod




def rank_arrays(xp, r, seed, dtype=np.float32, shapes=SHAPES):
    rng = np.random.default_rng([seed, r])
    return [xp.asarray(rng.standard_normal(s).astype(dtype)) for s in shapes]


def host(a):
    if isinstance(a, (list, tuple)):
        return np.concatenate([np.array(sc.arrays.to_host(x)).ravel() for x in a])
    return np.array(sc.arrays.to_host(a))


def exchanges(xp, kind, mask, vdt):
    comm = sc.Communicator(device_transport(kind) if xp is not np else sc.MPITransport(), rank_arrays(xp, ME, 0),
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
@pytest.mark.parametrize("kind", DEVICE_TRANSPORTS)
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
@pytest.mark.parametrize("kind", DEVICE_TRANSPORTS)
@pytest.mark.parametrize("mask", ["cyclic", "bernoulli"])
def test_slamb_on_the_device_matches_the_dense_reference(cp, kind, mask):
    x = rank_arrays(cp, ME, 100)
    comm = sc.Communicator(device_transport(kind), x, ratio=0.1, mask=mask, seed=11)
    opt = SlambRule(comm, lr=0.02, weight_decay=0.01, beta3=0.9, sync_interval=4)
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
    """For 1 and for 100 tensors: none on a step (the device decides a non-finite step, issue 43), two on
    a periodic-sync step (its own verdict, which the sync must not average past, and the sync's status)."""
    shapes = [(64, 160)] * tensors
    x = rank_arrays(cp, ME, 5, shapes=shapes)
    comm = sc.Communicator(device_transport("nccl"), x, ratio=0.1, seed=3, value_dtype="float16")
    opt = SlambRule(comm, lr=0.01, sync_interval=2)
    counts = []
    for t in range(1, 5):
        g = rank_arrays(cp, ME, 40 + t, shapes=shapes)
        strict_cupy.reset_syncs()
        opt.step(x, g)
        counts.append(strict_cupy.total_syncs())
    syncs = 2 if P > 1 else 0  # steps 1 and 3 average the parameters (one rank has nothing to average)
    assert counts == [syncs, 0, syncs, 0], (counts, dict(strict_cupy.syncs))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["mpi-staged", "mpi-direct"])
def test_host_reads_per_slamb_step_with_mpi(cp, kind):
    """MPI does not know CUDA streams: each collective costs one more synchronisation (staging
    through the host, or waiting for the stream before handing MPI the pointer)."""
    shapes = [(64, 160)] * 10
    x = rank_arrays(cp, ME, 5, shapes=shapes)
    comm = sc.Communicator(device_transport(kind), x, ratio=0.1, seed=3)
    opt = SlambRule(comm, lr=0.01, sync_interval=2)
    counts = []
    for t in range(1, 3):
        g = rank_arrays(cp, ME, 40 + t, shapes=shapes)
        strict_cupy.reset_syncs()
        opt.step(x, g)
        counts.append(strict_cupy.total_syncs())
    # step 1: exchange (1 collective), its verdict (the sync's step waits for it) and sync (its status word
    # alone, read, then 1 bucket); step 2: the exchange's collective alone (its verdict on the device)
    assert counts == [5 if P > 1 else 1, 1], (counts, dict(strict_cupy.syncs))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", DEVICE_TRANSPORTS)
def test_odd_float16_topk_payloads_stay_aligned(cp, kind):
    """Defect 1: rank r >= 1's payload started 2 bytes off a multiple of 4 when K was odd with
    float16 values, and its int32 indices faulted on a GPU (the double raises)."""
    x = [cp.ones((10, 1223), np.float32)]
    comm = sc.Communicator(device_transport(kind), x, ratio=0.1, value_dtype="float16", seed=1)
    assert comm.wire.k_total % 2 == 1
    out = comm.sparse_allgather([cp.full((10, 1223), float(ME + 1), np.float32)])
    assert isinstance(out[0], cp.ndarray)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", DEVICE_TRANSPORTS)
def test_bfloat16_on_one_rank_raises_on_every_rank(cp, kind):
    """Defect 8: a bfloat16 device tensor used to raise CuPy's own error on that rank only."""
    if P == 1:
        pytest.skip("needs two ranks")

    comm = sc.Communicator(device_transport(kind), rank_arrays(cp, ME, 0), ratio=0.1, seed=1)
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


# ----------------------------------------------------------------------------- transports (defects 3, 5)
@pytest.mark.mpi
def test_defect3_nccl_on_its_own_stream_is_ordered_with_the_current_stream(cp):
    s = cp.cuda.Stream()
    t = sc.NCCLTransport(stream=s, abort_on_exception=False)
    buf = cp.ones(8, np.float32)
    strict_cupy.cuda_log.clear()
    strict_cupy.reset_syncs()
    t.allreduce(buf)
    log = [e for e in strict_cupy.cuda_log if e[0] != "device"]
    cur = cp.cuda.get_current_stream().ptr
    (rec1, ev1, on1), (wait1, s1, ev1b), (call, sc_), (rec2, ev2, on2), (wait2, s2, ev2b) = log
    assert (rec1, on1) == ("record", cur) and (wait1, s1, ev1b) == ("wait", s.ptr, ev1)  # s waits for the filler
    assert (call, sc_) == ("nccl.allReduce", s.ptr)
    assert (rec2, on2) == ("record", s.ptr) and (wait2, s2, ev2b) == ("wait", cur, ev2)  # the reader waits for s
    assert strict_cupy.total_syncs() == 0  # ordered on the device, not by the host
    np.testing.assert_array_equal(host(buf), np.full(8, float(P)))


@pytest.mark.mpi
def test_defect5_cuda_awareness_is_asked_of_the_mpi_library(cp, monkeypatch):
    import ctypes

    from slamb_comm.exchange.transports import mpi_cuda_support

    assert isinstance(mpi_cuda_support(), bool)
    assert sc.MPITransport().cuda_aware == mpi_cuda_support()  # here: Open MPI without CUDA, False

    class CudaAwareLib:  # what a CUDA-built Open MPI answers
        def __init__(self, path):
            self.path = path
            self.MPIX_Query_cuda_support = lambda: 1

    monkeypatch.setattr(ctypes, "CDLL", CudaAwareLib)
    assert mpi_cuda_support() is True and sc.MPITransport().cuda_aware is True
    monkeypatch.undo()
    # float16 device buffers are summed through host memory even on a CUDA-aware MPI: the sum op
    # is Python code that reads host memory
    t = sc.MPITransport(cuda_aware=True)
    seen = []

    class Spy:  # mpi4py's methods are read-only: wrap the communicator
        def __init__(self, comm):
            self.comm = comm

        def __getattr__(self, name):
            return getattr(self.comm, name)

        def Allreduce(self, send, recv, op=None):
            seen.append(type(recv[0] if isinstance(recv, list) else recv))
            return self.comm.Allreduce(send, recv, op=op)

    t.comm = Spy(t.comm)
    buf = cp.ones(5, np.float16)
    t.allreduce(buf)
    assert seen and all(c is np.ndarray for c in seen)
