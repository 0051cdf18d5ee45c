"""slamb_comm.arrays.cast_into / cast: NumPy's astype bit for bit, without NumPy's element-wise
float16 conversion; and the core's float16 exchanges bitwise the same as through astype.

Every conversion is checked on both NumPy paths: torch's vectorised cast (torch already in
sys.modules) and the integer bit manipulation (torch hidden from sys.modules), each spied on
to make sure that the path under test is the one taken. Timings are in benchmarks/codec.py
(``--parts fp16``), not here.
"""

import functools
import sys
import warnings

import numpy as np
import pytest

import slamb_comm as sc
from tests.support import strict_cupy
from slamb_comm import arrays as A
from slamb_comm.exchange import masked as C
from slamb_comm.methods.slamb import SlambRule
from slamb_comm.exchange.transports import LocalTransport

U = {np.dtype(np.float16): np.uint16, np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}


def bits(a):
    a = np.asarray(a)
    return a.view(U[a.dtype])


def reference(x, dtype):
    with np.errstate(all="ignore"):  # NumPy warns of overflow in the cast; the bits are the point
        return x.astype(dtype)


@pytest.fixture(params=["numpy", "torch"])
def path(request, monkeypatch):
    """Which implementation cast_into takes on NumPy arrays: a list of the path's name and then
    one entry per torch cast made."""
    calls = []
    if request.param == "torch":
        pytest.importorskip("torch")
        real = A._torch_cast

        def spy(torch, x, out):
            calls.append((x.dtype, out.dtype))
            return real(torch, x, out)

        monkeypatch.setattr(A, "_torch_cast", spy)
    else:
        monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not loaded

        def refuse(*a):
            raise AssertionError("the torch path was taken with torch not loaded")

        monkeypatch.setattr(A, "_torch_cast", refuse)
    calls.append(request.param)
    return calls


def check(x, dtype, path=None):
    got = A.cast(x, dtype)
    want = reference(x, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = np.flatnonzero(bits(got).ravel() != bits(want).ravel())
    assert diff.size == 0, [(hex(int(v)), hex(int(g)), hex(int(w))) for v, g, w in
                            zip(bits(x).ravel()[diff[:8]], bits(got).ravel()[diff[:8]], bits(want).ravel()[diff[:8]])]
    out = np.full(x.shape, 7, dtype)
    assert A.cast_into(out, x) is out
    assert np.array_equal(bits(out), bits(want))
    if path is not None and path[0] == "torch" and x.size >= A.SMALL_CAST and not (
            x.dtype == np.float64 and dtype == np.float16):
        del path[1:]
        A.cast(x, dtype)
        assert len(path) > 1, "torch was loaded but its cast was not used"


ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


@functools.cache
def float32_patterns():
    """Every exponent with the mantissas that matter for rounding to float16 (ties, one below
    and above, the sticky bits, odd and even kept bits), both signs; every float16 value, the
    midpoints between neighbours (ties) and their float32 neighbours; the edges of float16's
    range; NaNs with payloads in every part of the mantissa; random patterns."""
    mant = np.array([0, 1, 2, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x3000, 0x3001, 0x2FFF, 0x5000,
                     0x7FE000, 0x7FEFFF, 0x7FF000, 0x7FF001, 0x7FFFFF, 0x400000, 0x400001, 0x3FFFFF, 0x0FF000],
                    np.uint32)
    exps = np.arange(256, dtype=np.uint32) << 23
    grid = (exps[:, None] | mant[None, :]).ravel()
    h = ALL_HALVES[np.isfinite(ALL_HALVES) & (bits(ALL_HALVES) < 0x8000)].astype(np.float32)
    h = np.sort(h)
    mids = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(np.float32)  # exact: 12 significant bits
    mids = np.concatenate([mids, [np.float32(65520.0)]])  # the tie between 65504 and "65536": Inf
    near = np.concatenate([h, mids])
    near = np.concatenate([near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(0))])
    edges = np.array([65504, 65519.996, 65520, 65520.004, 65535, 65536, 65537, 1e5, 3.4e38, 2.0**-14,
                      2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-26, 1023.5 * 2.0**-24, 1e-45, 1e-40, 1.1754942e-38,
                      np.inf, 0.0], np.float32)
    edges = np.concatenate([edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(0))])
    nans = np.array([0x7F800001, 0x7F800FFF, 0x7F801000, 0x7F802000, 0x7F9FFFFF, 0x7FA00000, 0x7FBFFFFF,
                     0x7FC00000, 0x7FC00001, 0x7FE00000, 0x7FFFE000, 0x7FFFFFFF], np.uint32)
    rand = np.random.default_rng(21).integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    allp = np.concatenate([grid, bits(near), bits(edges), nans, rand])
    return np.concatenate([allp, allp | np.uint32(0x80000000)]).view(np.float32)


def float64_patterns():
    """float32's patterns widened, plus what only float64 has: values a hair off a float16 tie
    that float32 would round onto it (a conversion through float32 would round twice), ties
    of float16 subnormals, huge and tiny exponents, NaN payloads."""
    x32 = float32_patterns()
    x = x32[~np.isnan(x32)].astype(np.float64)
    h = np.sort(ALL_HALVES[np.isfinite(ALL_HALVES) & (bits(ALL_HALVES) < 0x8000)].astype(np.float64))
    mids = (h[:-1] + h[1:]) / 2
    off = np.concatenate([mids * (1 + 2.0**-40), mids * (1 - 2.0**-40), np.nextafter(mids, np.inf),
                          np.nextafter(mids, 0), mids])
    exps = np.arange(2048, dtype=np.uint64) << np.uint64(52)
    mant = np.array([0, 1, 0x3FFFFFFFFFF, 0x40000000000, 0x40000000001, 0x80000000000, 0xFFFFFFFFFFFFF,
                     0x8000000000000, 0x7FFFFFFFFFFFF], np.uint64)
    grid = (exps[:, None] | mant[None, :]).ravel().view(np.float64)
    nans = np.array([0x7FF0000000000001, 0x7FF0040000000000, 0x7FF003FFFFFFFFFF, 0x7FF8000000000000,
                     0x7FFFFFFFFFFFFFFF], np.uint64).view(np.float64)
    rand = np.random.default_rng(22).integers(0, 1 << 63, 1 << 17, dtype=np.uint64)
    rand = np.concatenate([rand, rand | np.uint64(1 << 63)]).view(np.float64)
    allp = np.concatenate([x, off, grid, nans, rand])
    return np.concatenate([allp, -allp])


# ------------------------------------------------------------------------------ bit for bit
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_every_float16_pattern(path, dtype):
    check(ALL_HALVES, dtype, path)


def test_encode_float32_patterns(path):
    check(float32_patterns(), np.float16, path)


def test_encode_float64_patterns(path):
    check(float64_patterns(), np.float16)  # never torch: its float64 -> float16 rounds twice
    assert len(path) == 1


@pytest.mark.parametrize("n", [1, 2, 7, 63, 64, 65, 1000, 4095, 4096, 4097, 3 * 4096 + 5])
@pytest.mark.parametrize("small", [64, 1])
def test_block_edges(path, n, small, monkeypatch):
    """Blocks of 4096 (the NumPy path's loop): lengths at and around block edges, NaN/Inf
    patched in any block, sizes that leave a short last block; below and above SMALL_CAST
    (and with it at 1, the bit manipulation on 1 element)."""
    monkeypatch.setattr(A, "CAST_BLOCK", 4096)
    monkeypatch.setattr(A, "SMALL_CAST", small)
    rng = np.random.default_rng(n)
    pats = float32_patterns()
    x = pats[rng.integers(0, pats.size, n)]
    check(x, np.float16, path)
    h = ALL_HALVES[rng.integers(0, 1 << 16, n)]
    check(h, np.float32, path)
    check(reference(x, np.float64), np.float16)


def test_the_value_ranges_of_the_benchmark(path):
    """Standard normal, float16-subnormal (|x| ~ 1e-6) and zero values, both ways, both signs."""
    rng = np.random.default_rng(5)
    for x in (rng.standard_normal(100_000), 1e-6 * rng.standard_normal(100_000), np.zeros(1000), -np.zeros(1000)):
        x = x.astype(np.float32)
        check(x, np.float16, path)
        check(reference(x, np.float16), np.float32, path)


def test_signalling_nans_stay_numpys_with_torch(path):
    """The hardware quietens signalling NaNs (torch's cast); NumPy keeps them, and so does cast."""
    x = np.array([1.0, 0x7F800001, 0x7F802000, 0xFF800001], np.uint32)
    x[0] = np.float32(1.0).view(np.uint32)
    check(np.tile(x.view(np.float32), 5000), np.float16, path)
    h = np.array([0x3C00, 0x7C01, 0xFC01, 0x7D00, 0x7E00], np.uint16).view(np.float16)
    check(np.tile(h, 5000), np.float32, path)


# ------------------------------------------------------------------------------ no flags, no warnings
def test_no_floating_point_flag_and_no_warning(path):
    x = np.array([1e-6, 1e-8, 1e-45, 65520.0, 1e30, np.inf, np.nan, -0.0], np.float32)
    x = np.repeat(x, 1000)
    with np.errstate(all="raise"), warnings.catch_warnings():
        warnings.simplefilter("error")
        h = A.cast(x, np.float16)
        A.cast(h, np.float32)
        A.cast(x.astype(np.float64), np.float16)
        A.cast(x[::1000], np.float16)  # below SMALL_CAST: NumPy's own cast, its flags silenced
    assert np.array_equal(bits(h), bits(reference(x, np.float16)))


# ------------------------------------------------------------------------------ arrays of any form
def test_shapes_strides_broadcasting_and_empty(path):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 48)) * 1e-5).astype(np.float32)
    check(x, np.float16, path)  # 2-D
    check(x[:, ::3], np.float16)  # a strided source
    check(x.T, np.float16)
    out = np.zeros((64, 96), np.float16)
    A.cast_into(out[:, ::2], x)  # a strided destination
    assert np.array_equal(bits(out[:, ::2]), bits(reference(x, np.float16)))
    assert not bits(out[:, 1::2]).any()
    row = np.zeros((5, 48), np.float16)
    A.cast_into(row, x[0])  # broadcast
    assert all(np.array_equal(bits(r), bits(reference(x[0], np.float16))) for r in row)
    assert A.cast(np.zeros(0, np.float32), np.float16).shape == (0,)
    assert A.cast(np.float32(3.5).reshape(()), np.float16).shape == ()
    ro = x.copy()
    ro.flags.writeable = False  # torch.from_numpy would warn: the NumPy path takes it
    check(ro, np.float16)


def test_other_dtype_pairs_and_copy_flag(path):
    x = np.random.default_rng(4).standard_normal(1000)
    for src, dst in [(np.float64, np.float32), (np.float32, np.float64), (np.float32, np.float32),
                     (np.float16, np.float16), (np.float64, np.float64)]:
        check(x.astype(src), dst)
    a = x.astype(np.float32)
    assert A.cast(a, np.float32, copy=False) is a
    b = A.cast(a, np.float32)
    assert b is not a and np.array_equal(a, b)
    h = A.cast(a, np.float16, copy=False)
    assert h.dtype == np.float16
    with pytest.raises(ValueError):
        ro = np.zeros(10, np.float16)
        ro.flags.writeable = False
        A.cast_into(ro, a[:10])


# ------------------------------------------------------------------------------ the strict CuPy double
def test_strict_cupy_double():
    with strict_cupy.install() as cp:
        strict_cupy.Device.current = 0
        x = float32_patterns()[:5000]
        dx = cp.asarray(x)
        out = cp.zeros(x.size, np.float16)
        with np.errstate(over="ignore"):  # the double casts with NumPy, which warns of overflow
            assert A.cast_into(out, dx) is out
        assert isinstance(out, cp.ndarray)
        assert np.array_equal(bits(out.get()), bits(reference(x, np.float16)))
        back = A.cast(out, np.float32)
        assert isinstance(back, cp.ndarray) and back.dtype == np.float32
        assert np.array_equal(bits(back.get()), bits(reference(reference(x, np.float16), np.float32)))
        assert A.cast(dx, np.float32, copy=False) is dx
        with pytest.raises(TypeError):
            A.cast_into(out, x)  # a host array into a device array
        with pytest.raises(TypeError):
            A.cast_into(np.zeros(x.size, np.float16), dx)


# ------------------------------------------------------------------------------ the core, bitwise as before
class Twin(LocalTransport):
    """Two ranks that send the same: the sum of every allreduce is twice this rank's values
    (exact), so the mean's division and the float16 sums' overflow checks are exercised."""

    size = 2

    def allreduce(self, buf):
        buf *= buf.dtype.type(2)

    def allgather(self, sendbuf, recvbuf):
        n = sendbuf.size
        recvbuf[:n] = sendbuf
        recvbuf[n : 2 * n] = sendbuf


def _astype_everywhere(monkeypatch):
    """The core as it was before cast_into: NumPy's assignment and astype."""
    def cast_into(out, x):
        out[...] = x
        return out

    monkeypatch.setattr(A, "cast_into", cast_into)
    monkeypatch.setattr(A, "cast", lambda x, dtype, copy=True: x.astype(dtype, copy=copy))
    monkeypatch.setattr(C, "_take", lambda xp, sel, views, out: sel.take(views, out=out))


SHAPES = [(300, 120), (50,), (3, 3), (200, 700)]


def _arrays(seed, scale):
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal(s)).astype(np.float32) for s in SHAPES]


def _run_core(mask, transport, scale):
    x = _arrays(0, scale)
    comm = sc.Communicator(transport(), x, ratio=0.1, mask=mask, value_dtype="float16", seed=9, dense_threshold=100)
    out = [a.copy() for a in x]
    comm.masked_allreduce(out, 1)
    flat = np.concatenate([a.ravel() for a in x])
    comm.masked_allreduce(flat, 2)
    opt = SlambRule(sc.Communicator(transport(), x, ratio=0.1, mask=mask, value_dtype="float16", seed=9,
                                dense_threshold=100), lr=0.01, weight_decay=0.01)
    p = [a.copy() for a in x]
    for t in range(1, 5):
        opt.step(p, [(t * a).astype(np.float32) for a in _arrays(t, scale)])
    return out + [flat] + p + [opt.m.copy(), opt.v.copy()]


@pytest.mark.parametrize("mask", ["cyclic", "bernoulli", "topk"])
@pytest.mark.parametrize("scale", [1.0, 1e-6], ids=["normal", "subnormal"])
@pytest.mark.parametrize("transport", [LocalTransport, Twin], ids=["1rank", "2ranks"])
def test_core_float16_is_bitwise_as_before(path, mask, scale, transport, monkeypatch):
    monkeypatch.setattr(A, "CAST_BLOCK", 4096)  # several blocks per tensor
    used = []
    for name in ("_encode_half", "_decode_half"):
        real = getattr(A, name)
        monkeypatch.setattr(A, name, lambda *a, _real=real, _name=name: used.append(_name) or _real(*a))
    new = _run_core(mask, transport, scale)
    if path[0] == "torch":
        assert len(path) > 1, "the core did not cast through torch"
    else:
        assert set(used) == {"_encode_half", "_decode_half"}, "the core did not cast through cast_into"
    with monkeypatch.context() as m:
        _astype_everywhere(m)
        old = _run_core(mask, transport, scale)
    assert len(new) == len(old)
    for a, b in zip(new, old):
        assert a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


# ------------------------------------------------------------------------------ the benchmark runs
def test_codec_benchmark_fp16_part(tmp_path):
    import csv
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_csv = tmp_path / "fp16.csv"
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "codec.py"), "--parts", "fp16",
                          "--fp16-log2", "12", "--repeats", "2", "--out", str(out_csv), "--no-plot"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "| op | values | method |" in out
    with open(out_csv) as fh:
        rows = list(csv.DictReader(fh))
    arms = {(r["op"], r["values"], r["method"]) for r in rows if r["op"] != "copy"}
    assert {(op, v, "cast_into, no torch") for op in ("encode", "decode")
            for v in ("subnormal", "normal", "zero")} <= arms
    assert {r["method"] for r in rows if r["op"] == "copy"} == {"memcpy float32", "memcpy float16"}
    assert all(float(r["vs_baseline"]) > 0 for r in rows if r["op"] != "copy")
