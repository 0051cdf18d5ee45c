"""1-bit LAMB and the 1-bit exchange on a device (slamb_comm.device.onebit_kernels; docs/onebit_lamb.md section 5).

On the strict CuPy double (tests/support/strict_cupy.py), which runs the kernels' host build: the device
paths give the NumPy path's results (the exchange bit for bit; 1-bit LAMB within float rounding:
its per-tensor norms are summed per tile) at 10, 100 and 1,000 tensors, in both stages, for a
fused buffer and a list of arrays, float16 where it applies, with a non-finite gradient; their
counted costs (launches the same at any number of tensors, device bytes per parameter, no copy to
the device after the first step, host reads); and NVRTC compiles every kernel (no device needed).
"""

import gc
import pickle
import re

import numpy as np
import pytest

import slamb_comm as sc
from tests.support import strict_cupy
from slamb_comm.device import kernels
from slamb_comm.device import onebit_kernels
from slamb_comm.errors import NonFiniteError
from slamb_comm.exchange.onebit import tree_depth
from slamb_comm.methods.onebit_lamb import OneBitLambRule
from tests.test_communicator_local import ThreadRanks

TENSORS = (10, 100, 1000)


def _raw(buf):
    return buf._a if isinstance(buf, strict_cupy.ndarray) else buf


class Twin:
    """Rank 0 of 2 in one process, its twin sending exactly what it sends; each collective counts
    one device operation (as an NCCL call), its bytes are not charged."""

    rank, size, name = 0, 2, "twin"

    def allgather(self, sendbuf, recvbuf):
        strict_cupy.launches["collective.allgather"] += 1
        s, r = _raw(sendbuf).reshape(-1), _raw(recvbuf).reshape(-1)
        r[: s.size] = s
        r[s.size :] = s

    def alltoall(self, sendbuf, recvbuf):
        strict_cupy.launches["collective.alltoall"] += 1
        s, r = _raw(sendbuf).reshape(-1), _raw(recvbuf).reshape(-1)
        r[: s.size // 2] = s[: s.size // 2]
        r[s.size // 2 :] = s[: s.size // 2]

    def allreduce(self, buf):
        strict_cupy.launches["collective.allreduce"] += 1
        _raw(buf)[...] *= 2

    def broadcast(self, buf, root=0):
        pass

    def barrier(self):
        pass


def shapes_of(tensors, total, empty=False):
    """``tensors`` shapes of about ``total / tensors`` elements (sizes varied), one of 0 if ``empty``."""
    n = total // tensors
    sizes = [max(1, n + (i % 7) - 3) for i in range(tensors)]
    if empty:
        sizes[tensors // 2] = 0
    return [(s,) if i % 3 else (1, s) for i, s in enumerate(sizes)]


def host(a):
    return np.array(sc.arrays.to_host(a))


def flat(a):
    if isinstance(a, (list, tuple)):
        return np.concatenate([host(v).ravel() for v in a])
    return host(a)


def on(xp, values, shapes, fused):
    """``values`` (host, fused) on ``xp``: one fused buffer, or a list of arrays shaped like the layout."""
    if fused:
        return xp.asarray(values.copy())
    out, o = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(xp.asarray(values[o : o + n].reshape(s)))
        o += n
    return out


@pytest.fixture
def cp():
    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        yield mod


# --------------------------------------------------------------------------- NVRTC
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_every_kernel_compiles_under_nvrtc(arch):
    """The same text NVRTC compiles for a GPU (options of slamb_comm.device.kernels: IEEE arithmetic, no
    contraction): every kernel the launches name is an entry of the PTX, and no multiply-add."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 -- not installed, or the library cannot be loaded: the same answer
        pytest.skip(f"NVRTC cannot be loaded ({type(e).__name__}: {e})")
    prog = nvrtc.createProgram(onebit_kernels.SOURCE, "onebit.cu", (), ())
    try:
        nvrtc.compileProgram(prog, [*kernels.OPTIONS, f"--gpu-architecture={arch}"])
    except Exception as e:  # noqa: BLE001 -- NVRTCError: its log says why
        raise AssertionError(f"NVRTC failed for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    entries = set(re.findall(r"\.visible\s+\.entry\s+(\w+)\s*\(", ptx))
    assert len(onebit_kernels.KERNELS) == 46 and set(onebit_kernels.KERNELS) <= entries
    assert not re.search(r"\bfma\.", ptx), "a multiply-add was contracted: the host build would round differently"


def test_tree_depth_is_numpys_pairwise_tree():
    assert [tree_depth(n) for n in (8, 128, 136, 256, 264, 32768, 32776)] == [0, 0, 1, 1, 2, 8, 9]
    with pytest.raises(ValueError):
        tree_depth(12)


# --------------------------------------------------------------------------- the exchange
@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("dtype, vdt", [("float16", None), ("float32", "float16"), ("float64", None),
                                        ("float32", "float64")])
@pytest.mark.parametrize("total", [5, 7000, 90001])
def test_exchange_gives_numpys_bits(P, dtype, vdt, total):
    """Fused and list inputs, one subtree or many, every value dtype: x and both error buffers are
    the NumPy path's bits, over four calls (the errors carried), on every rank."""
    shapes = shapes_of(7, total, empty=True)
    lay = sc.Layout(shapes, dtype, dense_threshold=0)
    runs = {}
    for lib, fused in (("numpy", True), ("strict", True), ("strict", False)):
        with strict_cupy.install() as cpm:
            strict_cupy.Device.current = 0
            xp = np if lib == "numpy" else cpm

            def rank(r, transport, xp=xp, fused=fused):
                comm = sc.Communicator(transport, lay, value_dtype=vdt, seed=1)
                got = []
                for step in range(4):
                    vals = np.random.default_rng(10 * step + r).standard_normal(lay.total).astype(dtype)
                    x = on(xp, vals, shapes, fused)
                    comm.onebit_allreduce(x)
                    ex = comm.onebit
                    got += [flat(x), host(ex.worker_error), host(ex.server_error)]
                return got

            runs[lib, fused] = ThreadRanks(P).run(rank)
    want = runs["numpy", True]
    for key, got in runs.items():
        for r in range(P):
            for a, b in zip(got[r], want[r]):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (key, r)


def _count_exchange(cp, tensors, fused, calls=3):
    gc.collect()  # a communicator of an earlier call (a cycle with its exchanges) must not die mid-measurement
    shapes = shapes_of(tensors, 100_000)
    lay = sc.Layout(shapes, "float32", dense_threshold=0)
    comm = sc.Communicator(Twin(), lay, seed=1)
    rng = np.random.default_rng(tensors)
    xs = [on(cp, rng.standard_normal(lay.total).astype(np.float32), shapes, fused) for _ in range(calls)]
    counted = []
    for x in xs:
        with strict_cupy.counting() as c:
            comm.onebit_allreduce(x)
        counted.append(c)
    return counted, lay.total


@pytest.mark.parametrize("fused", [True, False])
def test_exchange_costs_do_not_grow_with_the_tensors(cp, fused):
    """Four kernels and the two collectives at 10, 100 and 1,000 tensors, about 33 bytes of device
    traffic per element at two ranks, one host read; no copy to the device after the first call
    for a fused buffer (a list's table of addresses is copied when its arrays are new)."""
    for tensors in TENSORS:
        counted, n = _count_exchange(cp, tensors, fused)
        last = counted[-1]
        kernels_ = {k: v for k, v in last.by_op.items() if k.startswith("kernel(")}
        assert last.launches == 6 and sum(kernels_.values()) == 4, last.by_op
        assert last.bytes / n <= 34 and last.syncs == 1, last
        table = 0 if fused else 8 * tensors  # new arrays: their table of addresses, copied and kept
        assert last.h2d == (0 if fused else 1) and last.peak == last.kept == table, (last, last.by_h2d)


# --------------------------------------------------------------------------- 1-bit LAMB
KW = dict(lr=0.01, freeze_step=3)
OPTIONS = [dict(), dict(weight_decay=0.01), dict(weight_decay=0.1, bias_correction=True, factor_threshold=0.3,
                                                    coeff_beta=0.5)]


def _pair(xp, shapes, dtype, transport, vdt=None, **kw):
    lay = sc.Layout(shapes, dtype, dense_threshold=0)
    return OneBitLambRule(sc.Communicator(transport, lay, value_dtype=vdt, seed=1), **kw), lay


def _compare(a, b, rtol, atol, what):
    np.testing.assert_allclose(flat(b), flat(a), rtol=rtol, atol=atol, err_msg=what)


def _run_both(cp, tensors, fused, P, dtype="float64", vdt=None, steps=6, bad_step=None, **kw):
    """The NumPy and the device optimizer side by side; after every step x, m, v, f, the error
    buffers and the per-tensor numbers compared."""
    kw = dict(KW, **kw)
    shapes = shapes_of(tensors, 20 * tensors + 3000, empty=True)
    mk = (lambda: Twin()) if P == 2 else (lambda: None)
    a, lay = _pair(np, shapes, dtype, mk(), vdt, **kw)
    b, _ = _pair(cp, shapes, dtype, mk(), vdt, **kw)
    rng = np.random.default_rng(tensors)
    x0 = rng.standard_normal(lay.total).astype(dtype)
    xa, xb = on(np, x0, shapes, True), on(cp, x0, shapes, fused)
    # float32: the NumPy path sums the per-tensor norms in float32 (np.dot), the device in float64
    tol = dict(rtol=1e-11, atol=1e-13) if dtype == "float64" else dict(rtol=1e-5, atol=1e-6)
    rtol = 1e-12 if dtype == "float64" else 1e-6
    for step in range(1, steps + 1):
        g = (rng.standard_normal(lay.total) * 0.1 * step).astype(dtype)
        if step == bad_step:
            g[lay.offsets[-1]] = np.inf
        for opt, x, xp in ((a, xa, np), (b, xb, cp)):
            opt.step(x, on(xp, g, shapes, fused if xp is cp else True))
        _compare(xa, xb, what=f"step {step}: x", **tol)
        for name in ("m", "v", "f"):
            if getattr(a, name) is not None:
                _compare(getattr(a, name), getattr(b, name), what=f"step {step}: {name}", **tol)
        if a.exchange.worker_error is not None:
            _compare(a.exchange.worker_error, b.exchange.worker_error, what=f"step {step}: worker error", **tol)
            _compare(a.exchange.server_error, b.exchange.server_error, what=f"step {step}: server error", **tol)
        for name in ("kappa", "phi", "lamb_coeffs", "gamma"):
            if getattr(a, name) is not None:
                np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=rtol, err_msg=f"{step}: {name}")
        assert (a.t, a.skipped_steps, a.gamma is None) == (b.t, b.skipped_steps, b.gamma is None)
    return a, b


@pytest.mark.parametrize("tensors", TENSORS)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("P", [1, 2])
def test_lamb_matches_the_numpy_path(cp, tensors, fused, P):
    """Warm-up (3 steps) then compression (3 steps), a tensor of 0 elements among them."""
    a, b = _run_both(cp, tensors, fused, P, weight_decay=0.01)
    assert b.compressing and isinstance(b.m, cp.ndarray) and b.gamma is not None


@pytest.mark.parametrize("kw", OPTIONS)
@pytest.mark.parametrize("dtype, vdt", [("float32", None), ("float32", "float16"), ("float64", "float32")])
def test_lamb_options_and_dtypes(cp, kw, dtype, vdt):
    _run_both(cp, 30, True, 2, dtype, vdt, steps=7, **kw)


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("bad_step", [2, 5])
def test_non_finite_gradient_skips_the_step_and_changes_nothing(cp, P, bad_step):
    """In the warm-up (step 2) and in the compression stage (step 5, its first one, and its γ):
    skipped on the device as on the host, nothing changed; with on_nonfinite='raise' it raises."""
    a, b = _run_both(cp, 20, False, P, steps=7, bad_step=bad_step, weight_decay=0.01)
    assert a.skipped_steps == b.skipped_steps == 1
    shapes = shapes_of(20, 3400, empty=True)
    opt, lay = _pair(cp, shapes, "float32", Twin() if P == 2 else None, on_nonfinite="raise", **dict(KW, freeze_step=1))
    x = cp.asarray(np.ones(lay.total, np.float32))
    for step in (1, 2):
        opt.step(x, cp.asarray(np.full(lay.total, 0.1 * step, np.float32)))
    before, keep = pickle.dumps(opt.state_dict()), host(x)
    g = np.full(lay.total, 0.1, np.float32)
    g[7] = np.nan
    with pytest.raises(NonFiniteError):
        opt.step(x, cp.asarray(g))
    assert pickle.dumps(opt.state_dict()) == before and host(x).tobytes() == keep.tobytes()


def test_state_round_trip_continues_bitwise(cp):
    """A device optimizer's state, saved and loaded into a new one (κ, φ, γ copied in again), and
    both continue with the same bits; the loaded one goes on at the first step's costs."""
    shapes = shapes_of(12, 4000)
    a, lay = _pair(cp, shapes, "float32", Twin(), weight_decay=0.01, **KW)
    rng = np.random.default_rng(3)
    x = cp.asarray(rng.standard_normal(lay.total).astype(np.float32))
    grads = [rng.standard_normal(lay.total).astype(np.float32) for _ in range(8)]
    for g in grads[:5]:
        a.step(x, cp.asarray(g))
    b, _ = _pair(cp, shapes, "float32", Twin(), weight_decay=0.01, **KW)
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    xb = x.copy()
    for g in grads[5:]:
        a.step(x, cp.asarray(g))
        b.step(xb, cp.asarray(g))
        assert host(x).tobytes() == host(xb).tobytes()
    assert (a.phi, a.kappa, a.gamma) == (b.phi, b.kappa, b.gamma)


def _count_steps(cp, tensors, freeze, fused=True, steps=5):
    shapes = shapes_of(tensors, 100_000)
    opt, lay = _pair(cp, shapes, "float32", Twin(), lr=1e-3, freeze_step=freeze, weight_decay=0.01)
    rng = np.random.default_rng(tensors)
    x = on(cp, rng.standard_normal(lay.total).astype(np.float32), shapes, fused)
    grads = on(cp, np.zeros(lay.total, np.float32), shapes, fused)
    counted = []
    for _ in range(steps):
        g = on(cp, (rng.standard_normal(lay.total) * 0.1).astype(np.float32), shapes, fused)
        if not fused:  # the same arrays every step, as a framework's gradients
            for a, b in zip(grads, g):
                a[...] = b
            g = grads
        with strict_cupy.counting() as c:
            opt.step(x, g)
        counted.append(c)
    assert opt.skipped_steps == 0
    return counted, lay.total


@pytest.mark.parametrize("stage", ["warm-up", "compression"])
@pytest.mark.parametrize("fused", [True, False])
def test_step_costs_do_not_grow_with_the_tensors(cp, stage, fused):
    """At 10, 100 and 1,000 tensors the same launches (warm-up: 12, the dense allreduce's
    included; compression: 8, the two collectives included), at most 88 bytes of device traffic
    per parameter (2x a fused LAMB step), two host reads, no memory of the model's size made and
    no copy to the device after the first step (a fused gradient a new buffer every step; a list's
    arrays kept, as a framework's)."""
    freeze = 100 if stage == "warm-up" else 2
    launches = set()
    for tensors in TENSORS:
        counted, n = _count_steps(cp, tensors, freeze, fused)
        for c in counted[3:]:
            launches.add(c.launches)
            assert c.bytes / n <= 88 and c.h2d == 0 and c.syncs == 2 and c.peak <= 64, (tensors, c, c.by_op)
        assert counted[0].syncs == 2
    assert launches == {12 if stage == "warm-up" else 8}, launches


def test_first_compression_step_fixes_gamma_on_the_device(cp):
    """The first compression step computes γ with one more launch, and the exchange's buffers
    are made (one zero fill), with no more host reads and no copy to the device."""
    counted, n = _count_steps(cp, 100, 2)
    assert counted[2].launches == 10 and counted[2].syncs == 2 and counted[2].h2d == 0, counted[2].by_op
