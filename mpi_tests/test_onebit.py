"""The 1-bit exchange (slamb_comm.exchange.onebit, docs/onebit_lamb.md section 1) and the transports'
alltoall, under MPI (pytest-mpi):

    bash scripts/mpirun.sh 4 300 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_onebit.py

(also at 1 and 2 ranks). Every rank builds every rank's inputs from fixed seeds, computes the
dense float64 reference of the page for all ranks (tests/support/onebit_reference.py) and compares its
own result and error buffers with it. Failures are collected and raised at the end of a test on
every rank at once, after every collective of the test has run, so that no rank is left waiting.
The CuPy branches run through the strict double (tests/support/strict_cupy.py), whose fake NCCL gets
grouped send/recv here; the Horovod transport's tests skip where Horovod is not installed.
"""

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from tests.support.mpi_checks import DEVICE_TRANSPORTS, Checks as _Checks, call, device_transport  # noqa: E402
from slamb_comm.errors import LayoutError, NonFiniteError, PeerError
from slamb_comm.exchange.onebit import OneBitExchange, padded_size

from tests.support import onebit_reference as ref  # noqa: E402
from tests.support import strict_cupy  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank
BAD = P - 1  # the rank that misbehaves in the failure tests
SHAPES = [(60, 50), (13,), (4, 4, 4), (0,), (101,)]  # 3178 elements: padded at every P
N = 3178
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8)


class Checks(_Checks):
    RTOL, ATOL = 1e-12, 1e-13


def make(r, step, dtype=np.float64, xp=np):
    rng = np.random.default_rng([500 + r, step])
    return [xp.asarray(rng.standard_normal(s).astype(dtype)) for s in SHAPES]


def flat(arrays):
    return np.concatenate([np.asarray(sc.arrays.to_host(a)).ravel() for a in arrays])


def exchange(transport=None, dtype=np.float64, value_dtype=None, xp=np):
    comm = sc.Communicator(transport if transport is not None else sc.MPITransport(), make(ME, 0, dtype, xp),
                           value_dtype=value_dtype, seed=3)
    return OneBitExchange(comm)


def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


# --------------------------------------------------------------------------- alltoall
def blocks_of(r, n, dt):
    """Rank r's sendbuf: block j holds (r, j)-dependent values."""
    return np.concatenate([((np.arange(n) + 7 * r + 3 * j) % 100).astype(dt) for j in range(P)])


def check_alltoall(chk, t, xp=np, what=""):
    for dt in DTYPES:
        for n in (1, 5):
            send = xp.asarray(blocks_of(ME, n, dt))
            recv = xp.asarray(np.zeros(n * P, dt))
            t.alltoall(send, recv)
            want = np.concatenate([blocks_of(r, n, dt)[ME * n : (ME + 1) * n] for r in range(P)])
            chk.equal(sc.arrays.to_host(recv), want, f"{what} alltoall {np.dtype(dt).name} n={n}")
    _, err = call(t.alltoall, xp.asarray(np.zeros(P + 1, np.float32)), xp.asarray(np.zeros(P + 1, np.float32)))
    chk.true(P == 1 or isinstance(err, ValueError), f"{what} alltoall of a size not a multiple of P: {err!r}")


def test_mpi_transport_alltoall():
    chk = Checks()
    t = sc.MPITransport()
    assert isinstance(t, sc.Transport)
    check_alltoall(chk, t, what="mpi")
    chk.done()


# --------------------------------------------------------------------------- the exchange vs the page
def test_matches_the_float64_reference_and_loses_nothing():
    chk = Checks()
    ex = exchange()
    we = se = None
    Np = padded_size(N, P)
    sum_in, sum_out = np.zeros(N), np.zeros(N)
    for step in range(1, 6):
        xs = [flat(make(r, step)) for r in range(P)]
        want, we, se = ref.exchange(xs, we, se)
        x = make(ME, step)
        ex.allreduce(x)
        chk.close(flat(x), want, f"step {step}: result")
        chk.close(ex.worker_error, we[ME], f"step {step}: worker error")
        chk.close(ex.server_error, se[ME], f"step {step}: server error")
        chk.true(len(set(WORLD.allgather(digest(flat(x))))) == 1, f"step {step}: result differs between ranks")
        # nothing is lost, with everyone's error buffers: position by position on the first N
        sum_in += np.mean(xs, axis=0)
        sum_out += flat(x)
        all_we = WORLD.allgather(ex.worker_error)
        all_se = np.concatenate(WORLD.allgather(ex.server_error))
        total = sum_out + all_se[:N] + np.mean(all_we, axis=0)[:N]
        chk.close(total, sum_in, f"step {step}: outputs + errors vs inputs", rtol=0, atol=1e-11)
    last = ex.comm.stats.last
    B = ex.block
    chk.true(ex.padded == Np and B == 16 + -(-(Np // P // 8) // 8) * 8, f"padding/blocks {ex.padded}, {B}")
    chk.true(last.payload_bytes == (P + 1) * B, f"payload {last.payload_bytes}")
    chk.true(abs(last.wire_bytes - 2 * (P - 1) * B) < 1e-9, f"wire {last.wire_bytes}")
    chk.done()


def test_float32_first_step():
    chk = Checks()
    ex = exchange(dtype=np.float32)
    x = make(ME, 1, np.float32)
    want, _, _ = ref.exchange([flat(make(r, 1, np.float32)) for r in range(P)], scale_dtype=np.float32)
    ex.allreduce(x)
    chk.true(x[0].dtype == np.float32, "dtype kept")
    chk.close(flat(x), want, "float32 result", rtol=1e-5, atol=1e-7)
    chk.done()


# --------------------------------------------------------------------------- failures
def _state(ex):
    return ex.worker_error.copy(), ex.server_error.copy()


def test_non_finite_on_one_rank_raises_on_every_rank_and_changes_nothing():
    chk = Checks()
    ex = exchange()
    ex.allreduce(make(ME, 1))
    before = _state(ex)
    x = make(ME, 2)
    if ME == BAD:
        x[0][5, 5] = np.nan
    keep = flat(x)
    _, err = call(ex.allreduce, x)
    chk.raised(err, NonFiniteError, "NaN on the last rank", ranks=(BAD,))
    chk.equal(flat(x), keep, "x unchanged")
    chk.true(all(np.array_equal(a, b) for a, b in zip(_state(ex), before)), "error buffers unchanged")
    _, err = call(ex.allreduce, make(ME, 2))  # the exchange goes on, alike on every rank
    chk.true(err is None, f"exchange after the failure: {err!r}")
    chk.done()


def test_bad_input_on_one_rank_raises_on_every_rank():
    chk = Checks()
    ex = exchange()
    ex.allreduce(make(ME, 1))
    before = _state(ex)
    x = make(ME, 2)
    if ME == BAD:
        x[0] = x[0].reshape(50, 60)
    _, err = call(ex.allreduce, x)
    if ME == BAD:
        chk.raised(err, LayoutError, "bad rank")
    else:
        chk.raised(err, PeerError, "other ranks", ranks=(BAD,))
    chk.true(all(np.array_equal(a, b) for a, b in zip(_state(ex), before)), "error buffers unchanged")
    chk.done()


# --------------------------------------------------------------------------- state
def test_state_dict_round_trip_continues_bitwise():
    chk = Checks()
    a = exchange()
    for step in range(1, 4):
        a.allreduce(make(ME, step))
    b = exchange()
    b.load_state_dict(a.state_dict())
    for step in range(4, 7):
        xa, xb = make(ME, step), make(ME, step)
        a.allreduce(xa)
        b.allreduce(xb)
        chk.equal(flat(xa), flat(xb), f"step {step}: resumed result")
        chk.equal(a.worker_error, b.worker_error, f"step {step}: worker error")
        chk.equal(a.server_error, b.server_error, f"step {step}: server error")
    if P > 1:  # another rank's state is refused (server errors belong to one rank's chunk)
        other = WORLD.sendrecv(a.state_dict(), dest=(ME + 1) % P, source=(ME - 1) % P)
        _, err = call(b.load_state_dict, other)
        chk.raised(err, sc.LayoutMismatchError, "another rank's state")
    chk.done()


# --------------------------------------------------------------------------- CuPy branches (strict double)
class _FakeGroup:
    """Grouped point-to-point calls for the double's fake NCCL: queued between groupStart and
    groupEnd, then exchanged in one MPI alltoall (as NCCL runs a group's calls together)."""

    ops = None

    @staticmethod
    def start():
        _FakeGroup.ops = []

    @staticmethod
    def end():
        ops, _FakeGroup.ops = _FakeGroup.ops, None
        if not ops:
            return
        comm = ops[0][0]._comm
        out = [None] * comm.Get_size()
        for c, kind, ptr, count, dt, peer in ops:
            if kind == "send":
                out[peer] = strict_cupy._host(ptr, count, dt).copy()
        got = comm.alltoall(out)
        for c, kind, ptr, count, dt, peer in ops:
            if kind == "recv":
                strict_cupy._host(ptr, count, dt)[...] = got[peer]

    @staticmethod
    def op(kind):
        def f(self, ptr, count, datatype, peer, stream):
            if _FakeGroup.ops is None:
                raise RuntimeError(f"fake NCCL: {kind} outside groupStart/groupEnd")
            strict_cupy.cuda_log.append((f"nccl.{kind}", stream))
            _FakeGroup.ops.append((self, kind, ptr, count, datatype, peer))
        return f


@pytest.fixture(scope="module")
def cp():
    nccl, comm_cls = strict_cupy.nccl, strict_cupy.NcclCommunicator
    nccl.groupStart, nccl.groupEnd = _FakeGroup.start, _FakeGroup.end
    comm_cls.send, comm_cls.recv = _FakeGroup.op("send"), _FakeGroup.op("recv")
    try:
        with strict_cupy.install() as mod:
            strict_cupy.Device.current = 0
            yield mod
    finally:
        del nccl.groupStart, nccl.groupEnd, comm_cls.send, comm_cls.recv




@pytest.mark.parametrize("kind", DEVICE_TRANSPORTS)
def test_cupy_alltoall(cp, kind):
    chk = Checks()
    check_alltoall(chk, device_transport(kind), xp=cp, what=kind)
    if kind == "nccl":  # NumPy buffers staged through the device
        check_alltoall(chk, device_transport(kind), what="nccl (numpy)")
    chk.done()


@pytest.mark.parametrize("kind", DEVICE_TRANSPORTS)
def test_cupy_exchange_equals_numpy_path(cp, kind):
    chk = Checks()
    a, b = exchange(), exchange(device_transport(kind), xp=cp)
    for step in range(1, 4):
        xa, xb = make(ME, step), make(ME, step, xp=cp)
        a.allreduce(xa)
        strict_cupy.reset_syncs()
        b.allreduce(xb)
        if kind == "nccl":  # NCCL orders on the device: the status words are the one host read
            chk.true(strict_cupy.total_syncs() == 1, f"host reads {dict(strict_cupy.syncs)}")
        chk.equal(flat(xa), flat(xb), f"{kind} step {step}")
    chk.true(isinstance(b.worker_error, cp.ndarray), "state on the device")
    chk.equal(a.worker_error, b.worker_error.get(), f"{kind} worker error")
    chk.equal(a.server_error, b.server_error.get(), f"{kind} server error")
    x = make(ME, 9, xp=cp)
    if ME == BAD:
        x[4][3] = np.inf
    _, err = call(b.allreduce, x)
    chk.raised(err, NonFiniteError, f"{kind}: Inf on the last rank", ranks=(BAD,))
    chk.done()


@pytest.mark.parametrize("kind", ["numpy"] + DEVICE_TRANSPORTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fused_and_list_inputs_give_the_same_bits(cp, kind, dtype):
    """The caller's arrays go in with one copy or one concatenate and come back with one copy
    per tensor (a list) or one (a fused buffer): the same bits either way, on every rank."""
    chk = Checks()
    xp = np if kind == "numpy" else cp
    mk = (lambda: None) if kind == "numpy" else (lambda: device_transport(kind))
    a, b = exchange(mk(), dtype, xp=xp), exchange(mk(), dtype, xp=xp)
    for step in range(1, 4):
        xa = make(ME, step, dtype, xp)
        xb = xp.concatenate([v.reshape(-1) for v in make(ME, step, dtype, xp)])
        a.allreduce(xa)
        b.allreduce(xb)
        ha, hb = flat(xa), np.asarray(sc.arrays.to_host(xb))
        chk.true(ha.dtype == hb.dtype and ha.tobytes() == hb.tobytes(), f"{kind} step {step}: list != fused")
        for ea, eb, what in ((a.worker_error, b.worker_error, "worker"), (a.server_error, b.server_error, "server")):
            ea, eb = sc.arrays.to_host(ea), sc.arrays.to_host(eb)
            chk.true(ea.tobytes() == eb.tobytes(), f"{kind} step {step}: {what} errors differ")
    chk.done()


# --------------------------------------------------------------------------- Horovod
@pytest.fixture(scope="module")
def hvd():
    pytest.importorskip("torch")
    h = pytest.importorskip("horovod.torch")
    h.init()
    return h


def test_horovod_transport_alltoall_and_exchange(hvd):
    from slamb_comm.adapters.horovod import HorovodTransport

    chk = Checks()
    ht = HorovodTransport()
    chk.true(isinstance(ht, sc.Transport), "HorovodTransport follows the protocol")
    check_alltoall(chk, ht, what="horovod")
    a, b = exchange(), exchange(ht)
    for step in range(1, 4):
        xa, xb = make(ME, step), make(ME, step)
        a.allreduce(xa)
        b.allreduce(xb)
        chk.equal(flat(xa), flat(xb), f"horovod step {step}")
    chk.equal(a.server_error, b.server_error, "horovod server error")
    chk.done()


# --------------------------------------------------------------------------- the 1-bit LAMB rule
LAMB_OPTIONS = [dict(), dict(weight_decay=0.01, bias_correction=True, factor_threshold=0.3)]


def lamb_for(**kw):
    from slamb_comm.methods.onebit_lamb import OneBitLambRule

    comm = sc.Communicator(sc.MPITransport(), make(ME, 0), seed=3)
    return OneBitLambRule(comm, **kw)


def params():
    return make(99, 0)  # the same initial parameters on every rank


@pytest.mark.parametrize("kw", LAMB_OPTIONS)
def test_onebit_lamb_matches_the_float64_simulation(kw):
    chk = Checks()
    kw = dict(lr=0.01, freeze_step=3, **kw)
    opt = lamb_for(**kw)
    sim = ref.OneBitLambReference([int(np.prod(s)) for s in SHAPES], P, **kw)
    x, xr = params(), [a.reshape(-1) for a in params()]
    for step in range(1, 9):
        opt.step(x, make(ME, 10 + step))
        sim.step(xr, [make(r, 10 + step) for r in range(P)])
        chk.close(flat(x), flat(xr), f"step {step}: parameters", rtol=1e-10, atol=1e-12)
        chk.true(len(set(WORLD.allgather(digest(flat(x))))) == 1, f"step {step}: parameters differ between ranks")
        chk.close(opt.phi, sim.phi, f"step {step}: factors", rtol=1e-10)
    chk.close(opt.kappa, sim.kappa, "frozen LAMB coefficients")
    chk.close(opt.gamma, sim.gamma, "momentum scaling factors")
    if P > 1:
        chk.close(opt.exchange.worker_error, sim.we[ME], "worker error", rtol=1e-9, atol=1e-12)
    kinds = opt.comm.stats.by_kind
    chk.true(kinds["sync"].calls == 3 and (P == 1 or kinds["onebit_allreduce"].calls == 5), f"exchanges {kinds}")
    chk.done()


def test_onebit_lamb_non_finite_on_one_rank_is_skipped_everywhere():
    chk = Checks()
    for freeze in (100, 1):  # warm-up, compression
        opt = lamb_for(lr=0.01, freeze_step=freeze)
        x = params()
        opt.step(x, make(ME, 1))
        opt.step(x, make(ME, 2))
        keep, t = flat(x), opt.t
        g = make(ME, 3)
        if ME == BAD:
            g[0][1, 1] = np.inf
        _, err = call(opt.step, x, g)
        chk.true(err is None and opt.skipped_steps == 1 and opt.t == t, f"freeze {freeze}: skipped ({err!r})")
        chk.equal(flat(x), keep, f"freeze {freeze}: parameters unchanged")
        opt.on_nonfinite = "raise"
        _, err = call(opt.step, x, g)
        chk.raised(err, NonFiniteError, f"freeze {freeze}: raise mode", ranks=(BAD,))
        opt.step(x, make(ME, 4))
        chk.true(len(set(WORLD.allgather(digest(flat(x))))) == 1, f"freeze {freeze}: parameters in step")
    chk.done()


def test_onebit_lamb_state_round_trip_is_bitwise():
    chk = Checks()
    a = lamb_for(lr=0.01, freeze_step=2, weight_decay=0.01)
    x = params()
    for step in range(1, 5):
        a.step(x, make(ME, step))
    b = lamb_for(lr=0.01, freeze_step=2, weight_decay=0.01)
    b.load_state_dict(a.state_dict())
    xb = [v.copy() for v in x]
    for step in range(5, 8):
        a.step(x, make(ME, step))
        b.step(xb, make(ME, step))
        chk.equal(flat(x), flat(xb), f"step {step}: resumed parameters")
    chk.done()


def test_horovod_alltoall_while_a_rank_has_joined(hvd):
    """The last rank calls hvd.join() at once; the others' alltoalls go through the join-safe
    fallback, in which the joined rank's blocks are zeros."""
    from slamb_comm.adapters.horovod import HorovodTransport

    chk = Checks()
    ht = HorovodTransport()
    if ME != P - 1:
        for dt in (np.float32, np.uint8, np.float16):
            for n in (1, 5):  # as int32 words where the bytes allow it, else byte by byte
                send = blocks_of(ME, n, dt) + dt(1)
                recv = np.full(n * P, 77, dt)
                ht.alltoall(send, recv)
                want = np.concatenate([blocks_of(r, n, dt)[ME * n : (ME + 1) * n] + dt(1) if r != P - 1
                                       else np.zeros(n, dt) for r in range(P)])
                chk.equal(recv, want, f"alltoall under join, {np.dtype(dt).name} n={n}")
    hvd.join()
    chk.done()
