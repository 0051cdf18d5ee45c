"""The top-k exchange on a device (slamb_comm/device/topk_kernels.py, issue 33): bitwise the NumPy path,
and its counted costs against torch.topk's.

On the strict CuPy double (tests/support/strict_cupy.py), whose host build of the kernels executes every
line of their arithmetic and which charges every operation at its bytes, launches, host copies
and transient memory, :meth:`Communicator.sparse_allgather` must give, bit for bit, the NumPy
path's mean, error buffer and payload (the same picks: the ``k_elems`` largest ``|c|`` per tensor,
ties to the lower index), at 10, 100 and 1,000 tensors, for fused buffers and lists, float16,
float32 and float64 layouts and payloads, ties and whole-tensor picks, always-dense tensors, and
a non-finite value (every rank raises, nothing changes). Its costs: launches the same at 10,
100 and 1,000 tensors, device bytes within twice torch.topk's (:data:`BASELINE`), no copy to the
device after the first call, one host read, transient memory a few bytes per element.
"""

import re

import numpy as np
import pytest

import slamb_comm as sc
from tests.support import strict_cupy
from slamb_comm.device import kernels
from slamb_comm.device import topk_kernels
from tests.test_kernels_nvrtc import _nvrtc

#: Device bytes per element of ``torch.topk(a, k)`` on one float32 slice of 655,360 elements (the
#: baseline a GPU user compares with). Source: pytorch/pytorch aten/src/ATen/native/cuda/
#: TensorTopK.cu: one slice of >= 20,000 elements takes ``mbtopk`` (``should_use_multiblock``),
#: a radix select with ``RADIX_BITS = 8``: per 8 bits of the 32-bit key one
#: ``computeBlockDigitCounts`` reading the input (4 passes x 4 bytes), then ``gatherTopK`` reading
#: it once more (4 bytes) and writing k values and int64 indices: 20 bytes per element, plus its
#: per-block int16 digit counts (256 per block of >= 1,024 elements: at most 0.5 byte per element
#: written per pass, and read back) and 12 k bytes. Around it, the error feedback a user adds
#: (``c = g + e``: 12 bytes; ``c.abs()``, as topk has no magnitude order: 8; ``e = c - sent``,
#: ``sent`` gathered: O(k)) makes it at least 40 bytes per element. We hold the whole exchange,
#: error feedback, allgather and decoded mean included, to twice the topk alone.
BASELINE = 20.0
N = 655360


def _recorder(P):
    """A transport of P ranks in one process whose other ranks send what this one does (a
    collective: one launch, as NCCL's), keeping every payload it was handed."""

    class Recorder:
        rank, size, name, sent = 0, P, "recorder", []

        def allgather(self, send, recv):
            raw_s, raw_r = (getattr(a, "_a", a).reshape(-1) for a in (send, recv))
            self.sent.append(raw_s.tobytes())
            for r in range(P):
                raw_r[r * raw_s.size : (r + 1) * raw_s.size] = raw_s
            if isinstance(send, strict_cupy.ndarray):
                strict_cupy.launches["collective.allgather"] += 1
                strict_cupy.bytes_read["collective.allgather"] += send.nbytes
                strict_cupy.bytes_written["collective.allgather"] += recv.nbytes

        def allreduce(self, buf):
            raise AssertionError("the top-k exchange makes no allreduce")

        def broadcast(self, buf, root=0):
            pass

    return Recorder()


@pytest.fixture
def cp():
    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        yield mod


def _shapes(tensors):
    """Tiled tensors (above 32 KB), whole-block segments, 1-D always-dense ones, 0 and 1 elements."""
    out = []
    for i in range(tensors):
        if i % 50 == 0:
            out.append((150, 130))
        elif i % 7 == 1:
            out.append((7,))
        elif i % 11 == 2:
            out.append((0, 3))
        elif i % 13 == 3:
            out.append((1, 1))
        else:
            out.append((1 + (i * 37) % 60, 37))
    return out


def _values(rng, n, kind, dtype):
    if kind == "ties":  # few magnitudes, both signs, signed zeros
        x = rng.integers(-3, 4, n) * 0.5
        x[rng.random(n) < 0.2] = -0.0
    elif kind == "zeros":  # mostly zeros: the k-th largest is often 0, its ties fill the picks
        x = np.where(rng.random(n) < 0.97, -0.0, rng.standard_normal(n))
    else:
        x = rng.standard_normal(n) * np.exp(rng.standard_normal(n))
    return x.astype(dtype)


def _run(xp, lay, steps, P, ratio, vdt, whole, fused, lists=None):
    """The exchanges of ``steps`` ((x, mode) per step) on ``xp``: per step the mean (or the
    error), the error buffer and this rank's payload, all as host bytes."""
    t = _recorder(P)
    comm = sc.Communicator(t, lay, ratio=ratio, value_dtype=vdt, seed=1, topk_dense=whole)
    got = []
    for x, mode in steps:
        arg = xp.asarray(x) if fused else [xp.asarray(v.reshape(s)) for v, s in zip(lay.flat_views(x), lay.shapes)]
        before = len(t.sent)
        try:
            if mode == "commit":
                out = comm.sparse_allgather(arg)
            else:
                out = comm.sparse_allgather(arg, commit=False)
                comm.commit_residual(skip=mode)
            out = sc.arrays.to_host(out).tobytes() if fused else b"".join(
                np.ascontiguousarray(sc.arrays.to_host(a)).tobytes() for a in out)
        except sc.NonFiniteError as e:
            out = type(e)
        payload = t.sent[before] if out is not sc.NonFiniteError else None
        res = None if comm.residual is None else sc.arrays.to_host(comm.residual).tobytes()
        got.append((out, res, payload))
    return got


def _check(cp, tensors, dtype, vdt, ratio, kind, P=1, whole=False, fused=True, bad=None):
    lay = sc.Layout(_shapes(tensors), dtype, dense_threshold=50)
    rng = np.random.default_rng([tensors, len(kind), P])
    steps = [(_values(rng, lay.total, kind, dtype), mode) for mode in ("commit", {1, 2}, "commit", ())]
    if bad is not None:
        steps[2][0][lay.offsets[0] + 77] = bad
    want = _run(np, lay, steps, P, ratio, vdt, whole, fused)
    got = _run(cp, lay, steps, P, ratio, vdt, whole, fused)
    for t, (w, g) in enumerate(zip(want, got)):
        assert g[0] == w[0], f"step {t}: the mean differs"
        assert g[1] == w[1], f"step {t}: the error buffer differs"
        assert g[2] == w[2], f"step {t}: the payload differs"
    if bad is not None:
        assert got[2][0] is sc.NonFiniteError and got[2][1] == got[1][1]


@pytest.mark.parametrize("tensors", [10, 100, 1000])
@pytest.mark.parametrize("fused", [True, False])
def test_bitwise_the_numpy_path_at_any_number_of_tensors(cp, tensors, fused):
    _check(cp, tensors, "float32", None, 0.01, "normal", fused=fused)


@pytest.mark.parametrize("dtype,vdt", [("float32", "float16"), ("float16", None), ("float64", "float32"),
                                       ("float64", "float16"), ("float16", "float32")])
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
def test_bitwise_with_every_dtype_ties_and_zeros(cp, dtype, vdt, kind):
    _check(cp, 100, dtype, vdt, 0.05, kind, fused=kind != "ties")


@pytest.mark.parametrize("ratio,whole", [(0.3, True), (0.5, False), (1.0, False)])
@pytest.mark.parametrize("P", [1, 3])
def test_bitwise_with_whole_tensors_dense_ones_and_ranks(cp, ratio, whole, P):
    """Ratios where whole tensors are picked, the always-dense tensors sent whole, and P ranks
    (the mean summed rank after rank and scaled)."""
    _check(cp, 100, "float32", "float16" if P > 1 else None, ratio, "ties", P=P, whole=whole, fused=P == 1)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # NumPy's cast of 70000 to float16
@pytest.mark.parametrize("bad", [np.nan, np.inf, 70000.0])
def test_a_non_finite_value_fails_as_on_numpy_and_changes_nothing(cp, bad):
    """NaN and Inf in c, and a float16 payload value beyond 65504: every rank raises NonFiniteError
    and the error buffer stays as it was."""
    _check(cp, 100, "float32", "float16", 0.01, "normal", P=2, bad=bad)


def test_wire_encode_and_select_are_numpy_s(cp):
    lay = sc.Layout(_shapes(60), "float32", dense_threshold=50)
    wire = sc.wire.codecs.TopKWire(lay, 0.05, "float16")
    x = _values(np.random.default_rng(3), lay.total, "ties", np.float32)
    want = wire.empty(np)
    want_pos = wire.encode(x, want)
    for arg in (cp.asarray(x), [cp.asarray(v) for v in lay.flat_views(x)]):
        buf = wire.empty(cp)
        pos = wire.encode(arg, buf)
        assert np.array_equal(sc.arrays.to_host(pos), want_pos)
        assert sc.arrays.to_host(buf).tobytes() == want.tobytes()
    pos, local = wire.select(cp.asarray(x))
    assert np.array_equal(sc.arrays.to_host(pos), want_pos)
    assert np.array_equal(sc.arrays.to_host(local), want_pos - np.repeat(lay.offsets, wire.counts))


# --------------------------------------------------------------------------- costs
def _costs(cp, tensors, P, vdt, how):
    """The counts of the 3rd exchange (two before it) of N float32 elements in ``tensors`` tensors:
    a fused buffer, a list at the same addresses (new values written in place), or a list of new
    arrays."""
    n = N // tensors // 64 * 64
    lay = sc.Layout([(n // 64, 64)] * (tensors - 1) + [(N - n * (tensors - 1),)], "float32", dense_threshold=0)
    comm = sc.Communicator(_recorder(P), lay, ratio=0.01, value_dtype=vdt, seed=1)
    rng = np.random.default_rng(tensors)
    kept = [cp.asarray(v.reshape(s)) for v, s in zip(lay.flat_views(np.zeros(N, np.float32)), lay.shapes)]
    for step in range(3):
        x = (rng.standard_normal(N) * 0.1).astype(np.float32)
        if how == "fused":
            arg = cp.asarray(x)
        elif how == "same list":
            for a, v in zip(kept, lay.flat_views(x)):
                a[...] = cp.asarray(v.reshape(a.shape))
            arg = kept
        else:
            arg = [cp.asarray(v.reshape(s)) for v, s in zip(lay.flat_views(x), lay.shapes)]
        strict_cupy.reset_peak()
        with strict_cupy.counting() as c:
            comm.sparse_allgather(arg)
        if step == 0:
            first = c
    return first, c


@pytest.mark.parametrize("how", ["fused", "same list", "new list"])
@pytest.mark.parametrize("vdt,P", [("float32", 1), ("float16", 2)])
def test_costs_against_torch_topk(cp, how, vdt, P):
    """At 10, 100 and 1,000 tensors of 655,360 float32 in all, ratio 0.01: 8 device operations
    (the payload's zeros, the selection's 4 kernels, the allgather, the status words' copy, the
    decode), the same at any number of tensors; at most twice :data:`BASELINE` device bytes per
    element (measured: about 30 when every tensor is tiled, 17 when each fits a block's shared
    memory); no copy to the device after the first call (one at the first, the tables), but of a
    list's addresses when they are new (arrays at new places); one host read; transient memory: the new
    error buffer (4 bytes per element), the mean (4) and less than one more."""
    counted = {t: _costs(cp, t, P, vdt, how) for t in (10, 100, 1000)}
    launches = {t: c.launches for t, (_, c) in counted.items()}
    assert len(set(launches.values())) == 1 and launches[10] == 8, (launches, counted[10][1].by_op)
    for t, (first, c) in counted.items():
        assert c.bytes / N <= 2 * BASELINE, (t, c.bytes / N, c.by_op_bytes)
        assert c.h2d <= (how == "new list") and first.h2d == 1, (t, c.by_h2d, first.by_h2d)  # new: unless reused
        assert c.syncs == 1 and first.syncs == 1, (t, c.by_sync)
        assert c.peak / N < 9, (t, c.peak / N)
    assert counted[10][1].bytes / N > 24 and counted[1000][1].bytes / N < 18  # tiled / in shared memory


@pytest.mark.parametrize("dtype,launches", [("float16", 3), ("float32", 4), ("float64", 7)])
def test_the_selection_s_launches_per_dtype(cp, dtype, launches):
    """1 + (digits - 1) + 1 kernels: float16's keys have 2 digits, float32's 3, float64's 6; a
    select adds the indices' cast. No host read, no copy to the device after the first."""
    lay = sc.Layout([(300, 100), (20, 30), (5,)], dtype)
    wire = sc.wire.codecs.TopKWire(lay, 0.1, dtype)
    x = cp.asarray(np.random.default_rng(0).standard_normal(lay.total).astype(dtype))
    wire.select(x)
    with strict_cupy.counting() as c:
        wire.select(x)
    assert c.launches == launches + 1 and c.h2d == 0 and c.syncs == 0, c.by_op
    assert len(topk_kernels.schedule(dtype)) == launches - 1


# --------------------------------------------------------------------------- NVRTC
def _names():
    codes = ("h2", "f4", "f8")
    return ({f"topk_pass_{p}" for p in codes}
            | {f"topk_{k}_{p}{v}" for k in ("first", "write", "decode") for p in codes for v in codes})


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_kernels_compile_under_nvrtc(arch):
    """The text the double runs compiles under NVRTC (the compiler of cupy.RawModule on a GPU)
    with the library's options, to the A100's and H100's machine code (NVRTC's ptxas: no device
    needed): every kernel an entry, no multiply-add contracted, and every kernel's static shared
    memory within the 48 KB a block may have without opting in (the largest: topk_first's 32 KB
    segment, 8 KB histogram and scan arrays)."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(topk_kernels.SOURCE, "topk.cu", (), ())
    try:
        nvrtc.compileProgram(prog, [*kernels.OPTIONS, f"--gpu-architecture={arch}", "--ptxas-options=-v"])
    except Exception as e:  # noqa: BLE001 -- NVRTCError: its log says why
        raise AssertionError(f"NVRTC failed for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    entries = set(re.findall(r"\.visible\s+\.entry\s+(\w+)\s*\(", ptx))
    assert len(_names()) == 30 and _names() <= entries, sorted(_names() - entries)
    assert not re.search(r"\bfma\.", ptx), "a multiply-add was contracted: the host build would round differently"
    chunks = re.split(r"Compiling entry function '(\w+)'", nvrtc.getProgramLog(prog))[1:]
    smem = {name: int(re.search(r"(\d+) bytes smem", text).group(1)) for name, text in zip(chunks[::2], chunks[1::2])}
    assert set(smem) == _names() and max(smem.values()) <= 48 * 1024, smem
