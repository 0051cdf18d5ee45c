"""Unit and property tests of slamb_comm.wire.codecs: layout, top-k, masks, the wire layout.

Everything is checked against docs/algorithm.md sections 1, 2 and 4, with no communication
(LocalTransport only).
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import slamb_comm as sc
from slamb_comm.wire.codecs import TopKWire, check_ratio
from slamb_comm.wire.masks import make_mask
from slamb_comm.errors import ConfigError, DTypeError

SHAPES = [(100, 120), (50,), (30, 40), (100, 120), (7, 9, 150)]  # 12000, 50, 1200, 12000, 9450


def layout(shapes=SHAPES, dtype="float32", **kw):
    return sc.Layout(shapes, dtype, **kw)


# --------------------------------------------------------------------------- Layout
class TestLayout:
    def test_offsets_sizes_total(self):
        lay = sc.Layout([(3, 4), (5,), (2, 3, 4), ()], "float32")
        assert lay.sizes == [12, 5, 24, 1]
        assert lay.offsets == [0, 12, 17, 41]
        assert lay.total == 42
        assert lay.segments() == [(0, 12), (12, 5), (17, 24), (41, 1)]
        assert len(lay) == 4
        assert lay.names == ["0", "1", "2", "3"]

    def test_always_dense_rule(self):
        shapes = [(100, 120), (50,), (10000,), (90, 100), (1, 8999), (0, 5), (), (3, 3000)]
        lay = sc.Layout(shapes, "float32")
        # ndim <= 1 or fewer than 9000 elements: always dense
        assert lay.dense == [False, True, True, False, True, True, True, False]
        # the threshold is "fewer than", and it is configurable
        assert sc.Layout([(90, 100)], dense_threshold=9001).dense == [True]
        assert sc.Layout([(2, 2), (4,)], dense_threshold=0).dense == [False, True]

    def test_dense_and_compressible_index_partition_the_buffer(self):
        lay = layout()
        both = np.concatenate([lay.dense_index, lay.compressible_index])
        assert np.array_equal(np.sort(both), np.arange(lay.total))
        expect_dense = np.concatenate(
            [np.arange(o, o + n) for (o, n), d in zip(lay.segments(), lay.dense) if d]
        )
        assert np.array_equal(np.sort(lay.dense_index), expect_dense)
        assert lay.dense == [False, True, True, False, False]

    def test_views_share_memory_and_have_the_shapes(self):
        lay = layout()
        flat = np.arange(lay.total, dtype=np.float32)
        views = lay.views(flat)
        assert [v.shape for v in views] == lay.shapes
        for v, (o, n) in zip(views, lay.segments()):
            assert np.shares_memory(v, flat)
            assert v.ravel()[0] == o and v.ravel()[-1] == o + n - 1
        views[1][...] = -1.0
        assert np.all(flat[lay.offsets[1] : lay.offsets[1] + 50] == -1.0)

    def test_digest(self):
        base = sc.Layout([(3, 4), (5,)], "float32")
        assert base.digest() == sc.Layout([(3, 4), (5,)], "float32", names=["a", "b"]).digest()
        assert len(base.digest()) == 16
        others = [
            sc.Layout([(4, 3), (5,)], "float32"),  # shape
            sc.Layout([(5,), (3, 4)], "float32"),  # order
            sc.Layout([(3, 4), (5,)], "float64"),  # dtype
            sc.Layout([(3, 4), (5,)], "float16"),
            sc.Layout([(3, 4)], "float32"),  # count
            sc.Layout([(3, 4), (5,)], "float32", dense_threshold=10),
        ]
        digests = {base.digest()} | {o.digest() for o in others}
        assert len(digests) == 1 + len(others)
        assert base.digest(0.1, "cyclic") != base.digest(0.2, "cyclic")
        assert base.digest(0.1, "cyclic") != base.digest(0.1, "topk")

    def test_from_arrays(self):
        arrs = [np.zeros((2, 3), np.float64), np.zeros(4, np.float64)]
        lay = sc.Layout.from_arrays(arrs, names=["w", "b"])
        assert lay.shapes == [(2, 3), (4,)] and lay.dtype == np.float64 and lay.names == ["w", "b"]
        with pytest.raises(DTypeError):
            sc.Layout.from_arrays([np.zeros(3, np.float32), np.zeros(3, np.float64)])

    @pytest.mark.parametrize("dtype", ["int32", "int8", "uint8", "complex64", "bool"])
    def test_unsupported_array_dtype(self, dtype):
        with pytest.raises(DTypeError):
            sc.Layout([(3,)], dtype)

    def test_bad_options(self):
        with pytest.raises(ConfigError):
            sc.Layout([(3,), (4,)], names=["only-one"])
        with pytest.raises(ConfigError):
            sc.Layout([(3,)], dense_threshold=-1)


# --------------------------------------------------------------------------- k_elems, check_ratio
def test_k_elems_examples():
    assert sc.k_elems(0.1, 0) == 0
    assert sc.k_elems(0.1, 1) == 1
    assert sc.k_elems(0.1, 4) == 1  # round(0.4) = 0 -> at least 1
    assert sc.k_elems(0.1, 12000) == 1200
    assert sc.k_elems(0.1, 50) == 5
    assert sc.k_elems(1.0, 7) == 7
    assert sc.k_elems(0.5, 3) == round(1.5)


@given(st.floats(min_value=1e-6, max_value=1.0), st.integers(min_value=0, max_value=10**7))
def test_k_elems_formula(ratio, n):
    k = sc.k_elems(ratio, n)
    if n == 0:
        assert k == 0
    else:
        assert k == max(1, round(ratio * n))
        assert 1 <= k <= n


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.0000001, 1.5, 2, float("nan"), float("inf"), "abc", None, [0.1]])
def test_check_ratio_rejects(bad):
    with pytest.raises(ConfigError):
        check_ratio(bad)


@pytest.mark.parametrize("good", [1e-9, 0.1, 0.5, 1, 1.0, np.float32(0.1), np.float64(0.25)])
def test_check_ratio_accepts(good):
    assert 0 < check_ratio(good) <= 1


# --------------------------------------------------------------------------- top-k
def _check_topk(x, k, idx):
    n = x.size
    kk = min(max(k, 0), n)
    idx = np.asarray(idx)
    assert idx.size == kk
    assert np.unique(idx).size == kk
    assert np.all((idx >= 0) & (idx < n))
    if 0 < kk < n:
        kept = np.zeros(n, bool)
        kept[idx] = True
        mag = np.abs(x.astype(np.float64))
        assert mag[kept].min() >= mag[~kept].max()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hnp.arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        st.integers(1, 300),
        elements=st.floats(-1e4, 1e4, allow_nan=False, width=16),
    ),
    st.data(),
)
def test_topk_indices_keeps_the_largest_magnitudes(x, data):
    k = data.draw(st.integers(-1, x.size + 2))
    _check_topk(x, k, sc.topk_indices(x, k))


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1000])
def test_topk_indices_edge_sizes(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    for k in sorted({0, 1, n - 1, n, n + 5}):
        _check_topk(x, k, sc.topk_indices(x, k))
    assert np.array_equal(np.sort(sc.topk_indices(x, n)), np.arange(n))


def test_topk_indices_with_ties_and_signs():
    x = np.array([1, -3, 3, 0, -3, 2, 3], np.float32)
    idx = sc.topk_indices(x, 3)
    _check_topk(x, 3, idx)
    assert idx.tolist() == [1, 2, 4]  # four |x| == 3: the lowest indices win, in increasing order
    assert sc.topk_indices(np.array([-5, 1, 4], np.float32), 1).tolist() == [0]


def _reference_topk(x, k):
    """Independent reference: stable sort by decreasing |x|, first k, in increasing index order."""
    k = max(0, min(k, x.size))
    return np.sort(np.argsort(-np.abs(x.astype(np.float64)), kind="stable")[:k])


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        st.integers(1, 200),
        elements=st.floats(-100, 100, allow_nan=False, width=16),
    ),
    st.data(),
)
def test_topk_indices_is_the_stable_reference(x, data):
    k = data.draw(st.integers(0, x.size))
    got = sc.topk_indices(x, k)
    assert np.array_equal(got, _reference_topk(x, k))
    assert np.array_equal(got, sc.wire.codecs.topk_indices_reference(x, k))


# Large inputs take the fast path (sampled threshold + selection in a band): it must give
# exactly the reference, whatever the distribution, including ones that fool the sample.
_N_BIG = [16385, 70000, 200000, 300001]


def _big_case(kind, n, rng):
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "float16 ties":
        return rng.standard_normal(n).astype(np.float16)
    if kind == "few values":
        return rng.integers(-3, 4, n).astype(np.float32)
    if kind == "mostly zero":
        x = np.zeros(n, np.float32)
        x[rng.choice(n, n // 50, replace=False)] = rng.standard_normal(n // 50)
        return x
    if kind == "all equal":
        return np.full(n, -2.5, np.float32)
    if kind == "ascending":
        return np.linspace(0, 1, n).astype(np.float32)
    if kind == "descending":
        return np.linspace(1, -0.1, n).astype(np.float64)
    if kind == "heavy tail":
        return (rng.standard_cauchy(n) * 1e3).astype(np.float32)
    if kind == "strided large":  # what the strided sample sees is large, the rest small
        x = rng.uniform(0, 0.5, n).astype(np.float32)
        x[:: max(1, n // 65536)] = rng.uniform(1, 2, x[:: max(1, n // 65536)].size)
        return x
    if kind == "strided small":  # what the strided sample sees is small, the rest large
        x = rng.uniform(1, 2, n).astype(np.float32)
        x[:: max(1, n // 65536)] = rng.uniform(0, 0.5, x[:: max(1, n // 65536)].size)
        return x
    if kind == "hidden peaks":  # peaks off the sample; the sample's max (x[0]) above the rest
        x = rng.uniform(0, 0.5, n).astype(np.float32)
        x[0] = 1.0
        stride = max(1, n // 65536)
        off = np.flatnonzero(np.arange(n) % stride != 0) if stride > 1 else np.arange(1, n)
        p = _peaks(n)
        x[off[rng.choice(off.size, p, replace=False)]] = rng.uniform(2, 3, p)
        return x
    raise AssertionError(kind)


def _peaks(n):
    """A count of peaks for which the fast path's upper sample bound sits right at the sample's max."""
    stride = max(1, n // 65536)
    s = -(-n // stride)
    return max(1, round(31 * n / s))


_BIG_KINDS = ["normal", "float16 ties", "few values", "mostly zero", "all equal", "ascending", "descending",
              "heavy tail", "strided large", "strided small", "hidden peaks"]


@pytest.mark.parametrize("kind", _BIG_KINDS)
@pytest.mark.parametrize("n", _N_BIG)
def test_topk_indices_fast_path_is_exact(kind, n):
    rng = np.random.default_rng(n)
    x = _big_case(kind, n, rng)
    ks = {1, 2, 7, 93, 200, 201, n // 1000, n // 100, n // 10, n // 3, n // 3 + 1, n // 2, (3 * n) // 4, n - 1}
    stride = max(1, n // 65536)
    ks |= {(n + stride - 1) // stride, (n + stride - 1) // stride + 1}  # around the sample's size
    ks |= {_peaks(n) - 1, _peaks(n), _peaks(n) + 1}
    for k in sorted(k for k in ks if 0 < k < n):
        got = sc.topk_indices(x, k)
        assert np.array_equal(got, _reference_topk(x, k)), (kind, n, k)


@settings(max_examples=25, deadline=None)
@given(st.integers(16385, 150000), st.floats(0.0001, 0.999), st.integers(0, 2**32 - 1), st.sampled_from(_BIG_KINDS))
def test_topk_indices_fast_path_property(n, ratio, seed, kind):
    x = _big_case(kind, n, np.random.default_rng(seed))
    k = sc.k_elems(ratio, n)
    got = sc.topk_indices(x, k)
    assert np.array_equal(got, _reference_topk(x, k))


def _wire_roundtrip(x, ratio, vdt):
    lay = sc.Layout([x.shape], x.dtype.name)
    wire = TopKWire(lay, ratio, vdt)
    buf = wire.empty(np)
    pos = wire.encode(x, buf)
    out = np.zeros_like(x)
    wire.decode_add(buf, out)
    return wire, buf, pos, out


@settings(max_examples=150, deadline=None)
@given(
    hnp.arrays(np.float32, st.integers(1, 400), elements=st.floats(-1e3, 1e3, allow_nan=False, width=32)),
    st.floats(0.001, 1.0),
)
def test_decode_encode_keeps_exactly_the_topk(x, ratio):
    wire, buf, pos, out = _wire_roundtrip(x, ratio, "float32")
    k = sc.k_elems(ratio, x.size)
    _check_topk(x, k, pos)
    kept = np.zeros(x.size, bool)
    kept[pos] = True
    assert np.array_equal(out[kept], x[kept])
    assert np.all(out[~kept] == 0)


class TestTopKWire:
    @pytest.mark.parametrize("data_dtype", ["float16", "float32", "float64"])
    @pytest.mark.parametrize("vdt", ["float16", "float32", "float64"])
    def test_roundtrip(self, data_dtype, vdt):
        rng = np.random.default_rng(7)
        lay = sc.Layout([(100, 120), (50,), (3, 3)], data_dtype)
        flat = rng.standard_normal(lay.total).astype(data_dtype)
        wire = TopKWire(lay, 0.1, vdt)
        buf = wire.empty(np)
        pos = wire.encode(flat, buf)
        out = np.zeros(lay.total, data_dtype)
        wire.decode_add(buf, out)
        # per tensor: exactly the k_elems largest magnitudes of that tensor
        expect = np.zeros(lay.total, data_dtype)
        for (o, n) in lay.segments():
            seg = flat[o : o + n]
            k = sc.k_elems(0.1, n)
            sel = np.argsort(-np.abs(seg.astype(np.float64)), kind="stable")[:k]
            expect[o + sel] = seg[sel].astype(vdt).astype(data_dtype)
        assert np.array_equal(np.sort(pos), np.flatnonzero(expect != 0))
        assert np.array_equal(out, expect)
        # decode_add adds: a second decode doubles the kept values
        wire.decode_add(buf, out)
        assert np.array_equal(out, (expect.astype(np.float64) * 2).astype(data_dtype))

    @pytest.mark.parametrize("vdt,itemsize", [("float16", 2), ("fp16", 2), ("float32", 4), ("float64", 8)])
    def test_byte_layout(self, vdt, itemsize):
        lay = sc.Layout([(100, 120), (50,), (3,)], "float32")
        wire = TopKWire(lay, 0.1, vdt)
        counts = [1200, 5, 1]
        assert wire.counts == counts and wire.k_total == 1206
        k = 1206
        assert wire.idx_at == 8
        assert wire.val_at == 8 + math.ceil(4 * k / 8) * 8
        assert wire.val_at % 8 == 0
        # the payload is padded to 8 bytes, so rank r's payload in an allgather buffer starts
        # aligned for its int32 and float views (a GPU faults on a misaligned typed read)
        assert wire.nbytes == math.ceil((wire.val_at + itemsize * k) / 8) * 8
        buf = wire.empty(np)
        assert buf.dtype == np.uint8 and buf.size == wire.nbytes
        assert wire.empty(np, ranks=3).size == 3 * wire.nbytes
        flat = np.random.default_rng(0).standard_normal(lay.total).astype(np.float32)
        pos = wire.encode(flat, buf)
        status, idx, val = wire.parts(buf)
        assert status[0] == 0
        assert idx.dtype == np.int32 and idx.size == k and val.size == k
        assert val.dtype.itemsize == itemsize
        # indices are local to their tensor
        assert idx[:1200].max() < 12000 and idx[1200:1205].max() < 50 and idx[1205] < 3
        assert np.array_equal(val, flat[pos].astype(val.dtype))
        # odd K: padding keeps the values 8-byte aligned
        w2 = TopKWire(sc.Layout([(3,)]), 1.0, "float64")
        assert w2.val_at == 8 + 16 and w2.nbytes == 8 + 16 + 24
        # odd K with 2-byte values: the total is still a multiple of 8
        w3 = TopKWire(sc.Layout([(3,)]), 1.0, "float16")
        assert w3.nbytes == 8 + 16 + 8 and w3.nbytes % 8 == 0

    @pytest.mark.parametrize("bad", ["bfloat16", "bf16", "int8", "int32", "float128", "complex64"])
    def test_bad_value_dtype(self, bad):
        with pytest.raises(DTypeError):
            TopKWire(sc.Layout([(4,)]), 0.5, bad)


# --------------------------------------------------------------------------- the fused top-k
# TopKWire.select picks every tensor's top-k of a fused buffer at once (on a device: the radix
# select of slamb_comm/device/topk_kernels.py, no sort); decode_all adds every rank's payload with one indexed add per rank.
# Both must be bitwise what the per-tensor code gives: the stable reference per tensor, and the
# payloads added tensor by tensor, rank after rank.
_FUSED = [(130, 150), (7,), (0,), (1,), (33, 5), (40, 40), (3,), (2, 3, 4), (1, 1)]


@pytest.fixture
def strict_cp():
    from tests.support import strict_cupy

    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        yield mod


def _fused_case(rng, lay, kind):
    n = lay.total
    if kind == "ties":
        x = rng.integers(-3, 4, n) * 0.5
    elif kind == "zeros":
        x = np.where(rng.random(n) < 0.8, np.where(rng.random(n) < 0.5, -0.0, 0.0), rng.standard_normal(n))
    elif kind == "inf":  # the selection itself is defined for infinities (the communicator rejects them)
        x = rng.standard_normal(n)
        x[rng.choice(n, 40, replace=False)] = np.inf
        x[rng.choice(n, 40, replace=False)] = -np.inf
    else:
        x = rng.standard_normal(n)
    return x.astype(lay.dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "inf"])
@pytest.mark.parametrize("ratio,whole", [(0.01, False), (0.3, False), (0.3, True), (1.0, False)])
def test_select_is_the_reference_per_tensor_on_both_libraries(strict_cp, dtype, kind, ratio, whole):
    lay = sc.Layout(_FUSED, dtype, dense_threshold=50)
    wire = TopKWire(lay, ratio, dtype, whole_dense=whole)
    x = _fused_case(np.random.default_rng(len(kind) + len(dtype)), lay, kind)
    want_local = [sc.wire.codecs.topk_indices_reference(x[o : o + n], k)
                  for (o, n), k in zip(lay.segments(), wire.counts)]
    want_pos = np.concatenate([w + o for w, o in zip(want_local, lay.offsets)])
    want_local = np.concatenate(want_local)
    for xp in (np, strict_cp):
        pos, local = wire.select(xp.asarray(x))
        pos, local = sc.arrays.to_host(pos), sc.arrays.to_host(local)
        assert pos.dtype == np.int64 and np.array_equal(pos, want_pos), xp.__name__
        assert np.array_equal(local, want_local), xp.__name__


@pytest.mark.parametrize("vdt", ["float16", "float32", "float64"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_decode_all_adds_every_rank_as_decode_add_one_by_one(strict_cp, vdt, dtype, ranks):
    lay = sc.Layout(_FUSED, dtype, dense_threshold=50)
    wire = TopKWire(lay, 0.1, vdt)
    rng = np.random.default_rng(ranks)
    recv = np.concatenate([_encoded(wire, _fused_case(rng, lay, "ties" if r % 2 else "normal")) for r in range(ranks)])
    acc = np.promote_types(dtype, np.float32)
    want = np.zeros(lay.total, acc)
    per_tensor = lay.flat_views(want)  # the per-tensor decode, rank after rank
    for r in range(ranks):
        wire.decode_add(recv[r * wire.nbytes : (r + 1) * wire.nbytes], per_tensor)
    for xp in (np, strict_cp):
        out = xp.zeros(lay.total, acc)
        wire.decode_all(xp.asarray(recv).reshape(ranks, wire.nbytes), out)
        assert sc.arrays.to_host(out).tobytes() == want.tobytes(), xp.__name__


def _encoded(wire, x):
    buf = wire.empty(np)
    wire.encode(x, buf)
    return buf


def test_the_per_tensor_table_is_copied_to_the_device_once(strict_cp):
    from tests.support import strict_cupy

    lay = sc.Layout(_FUSED * 50, "float32", dense_threshold=50)
    wire = TopKWire(lay, 0.1, "float32")
    x = strict_cp.asarray(np.random.default_rng(0).standard_normal(lay.total).astype(np.float32))
    with strict_cupy.counting() as first:
        wire.select(x)
    with strict_cupy.counting() as again:
        wire.select(x)
    assert first.h2d == 1 and again.h2d == 0 and again.syncs == 0
    # the radix select's 4 kernels (no sort) and the cast of the indices;
    # x read 4 times (4 bytes per element each), and a tenth of the elements picked (their 16
    # bytes, the cast's 12) (42 operations and 397 bytes per element before)
    assert again.launches == 5 and again.bytes / lay.total < 21, (again.by_op, again.bytes / lay.total)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hnp.arrays(
        st.sampled_from([np.float16, np.float32, np.float64]),
        st.integers(1, 300),
        elements=st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-8, np.inf, -np.inf, np.nan]),
    ),
    st.data(),
)
def test_small_topk_is_the_reference_with_ties_infinities_and_nan(x, data):
    """Small inputs take one partition instead of the reference's sort: the same indices, also
    for ties, signed zeros, infinities and NaN (ranked below everything by the reference)."""
    k = data.draw(st.integers(0, x.size))
    assert np.array_equal(sc.topk_indices(x, k), sc.wire.codecs.topk_indices_reference(x, k))


# --------------------------------------------------------------------------- masks
def _compressible_part(lay, idx):
    idx = np.asarray(idx)
    return idx[~np.isin(idx, lay.dense_index)]


class TestCyclicMask:
    @pytest.mark.parametrize("ratio,chunks", [(0.1, 10), (0.3, 4), (0.25, 4), (0.07, 15), (0.5, 2), (1.0, 1), (0.9, 2)])
    def test_covers_every_element_once_per_cycle(self, ratio, chunks):
        lay = layout()
        mask = sc.CyclicMask(lay, ratio, seed=123)
        assert mask.num_chunks == chunks == math.ceil(1 / ratio)
        seen = []
        sizes = []
        for t in range(1, chunks + 1):
            idx = mask.select(t).index
            assert np.unique(idx).size == idx.size  # no duplicates
            assert np.all(np.isin(lay.dense_index, idx))  # always-dense elements every step
            part = _compressible_part(lay, idx)
            assert idx.size == lay.dense_index.size + part.size
            seen.append(part)
            sizes.append(part.size)
        allc = np.concatenate(seen)
        assert allc.size == lay.compressible_index.size  # exactly once
        assert np.array_equal(np.sort(allc), np.sort(lay.compressible_index))
        assert max(sizes) - min(sizes) <= 1  # near-equal chunks
        # the cycle repeats with period C
        for t in range(1, chunks + 1):
            assert np.array_equal(mask.select(t).index, mask.select(t + chunks).index)
            assert np.array_equal(mask.select(t).index, mask.select(t + 7 * chunks).index)

    @settings(max_examples=30, deadline=None)
    @given(st.floats(0.01, 1.0), st.integers(0, 2**62))
    def test_cover_property(self, ratio, seed):
        lay = sc.Layout([(40, 30), (7,), (20, 20)], dense_threshold=500)
        mask = sc.CyclicMask(lay, ratio, seed)
        c = mask.num_chunks
        assert c >= 1 and c - 1 < 1 / ratio <= c + 1e-6
        parts = [_compressible_part(lay, mask.select(t).index) for t in range(1, c + 1)]
        allc = np.concatenate(parts)
        assert np.array_equal(np.sort(allc), np.sort(lay.compressible_index))
        sizes = [p.size for p in parts]
        assert max(sizes) - min(sizes) <= 1

    def test_random_chunks_not_blocks(self):
        lay = layout()
        part = _compressible_part(lay, sc.CyclicMask(lay, 0.1, 5).select(1).index)
        # a random permutation spreads chunk 0 over all compressible tensors
        for (o, n), d in zip(lay.segments(), lay.dense):
            if not d:
                assert np.count_nonzero((part >= o) & (part < o + n)) > 0

    def test_seed(self):
        lay = layout()
        a, b, c = sc.CyclicMask(lay, 0.1, 42), sc.CyclicMask(lay, 0.1, 42), sc.CyclicMask(lay, 0.1, 43)
        for t in range(1, 11):
            assert np.array_equal(a.select(t).index, b.select(t).index)
        assert any(not np.array_equal(a.select(t).index, c.select(t).index) for t in range(1, 11))
        assert a.state_dict() == {"kind": "cyclic", "ratio": 0.1, "seed": 42, "block": 1}

    def test_only_dense_tensors(self):
        lay = sc.Layout([(5,), (3, 3)])
        mask = sc.CyclicMask(lay, 0.1, 0)
        for t in (1, 2, 11):
            assert np.array_equal(np.sort(mask.select(t).index), np.arange(lay.total))


class TestBernoulliMask:
    def test_reproducible_from_seed_and_step(self):
        lay = layout()
        a, b = sc.BernoulliMask(lay, 0.1, 9), sc.BernoulliMask(lay, 0.1, 9)
        for t in (1, 2, 3, 1000):
            assert np.array_equal(a.select(t).index, b.select(t).index)
        # same step twice, in any order, gives the same mask: it depends on (seed, t) only
        m5 = a.select(5).index
        a.select(6).index
        assert np.array_equal(a.select(5).index, m5)
        assert not np.array_equal(a.select(1).index, a.select(2).index)
        assert not np.array_equal(a.select(1).index, sc.BernoulliMask(lay, 0.1, 10).select(1).index)

    @pytest.mark.parametrize("ratio", [0.05, 0.1, 0.5])
    def test_fraction_and_dense(self, ratio):
        lay = layout()
        mask = sc.BernoulliMask(lay, ratio, 1)
        n = lay.compressible_index.size
        sd = math.sqrt(n * ratio * (1 - ratio))
        counts = []
        for t in range(1, 21):
            idx = mask.select(t).index
            assert np.unique(idx).size == idx.size
            assert np.all(np.isin(lay.dense_index, idx))
            part = _compressible_part(lay, idx)
            assert abs(part.size - ratio * n) < 6 * sd
            counts.append(part.size)
        assert abs(np.mean(counts) - ratio * n) < 6 * sd / math.sqrt(len(counts))

    def test_ratio_one_selects_everything(self):
        lay = layout()
        assert np.array_equal(np.sort(sc.BernoulliMask(lay, 1.0, 3).select(4).index), np.arange(lay.total))


class TestTopKUnionMask:
    def test_single_rank_is_dense_plus_per_tensor_topk(self):
        lay = layout()
        flat = np.random.default_rng(3).standard_normal(lay.total).astype(np.float32)
        mask = sc.TopKUnionMask(lay, 0.1, 0)
        idx = mask.select(1, np, flat, sc.LocalTransport()).index
        expect = [lay.dense_index]
        for (o, n), d in zip(lay.segments(), lay.dense):
            if not d:
                k = sc.k_elems(0.1, n)
                expect.append(o + np.argsort(-np.abs(flat[o : o + n]))[:k])
        expect = np.sort(np.concatenate(expect))
        assert np.array_equal(np.sort(idx), expect)
        assert np.unique(idx).size == idx.size

    def test_needs_data_and_transport(self):
        mask = sc.TopKUnionMask(layout(), 0.1, 0)
        with pytest.raises(ConfigError):
            mask.select(1).index
        with pytest.raises(ConfigError):
            mask.select(1, np, np.zeros(layout().total, np.float32))


class TestMakeMask:
    @pytest.mark.parametrize("kind,cls", [("cyclic", sc.CyclicMask), ("bernoulli", sc.BernoulliMask), ("topk", sc.TopKUnionMask)])
    def test_known(self, kind, cls):
        m = make_mask(kind, layout(), 0.2, 5)
        assert type(m) is cls and m.ratio == 0.2 and m.seed == 5

    @pytest.mark.parametrize("kind", ["Cyclic", "random", "randomk", "top-k", "", None, "cyclic "])
    def test_unknown_name(self, kind):
        with pytest.raises(ConfigError):
            make_mask(kind, layout(), 0.1, 0)
        with pytest.raises(ConfigError):
            sc.Communicator(None, [np.zeros((100, 120), np.float32)], mask=kind)

    @pytest.mark.parametrize("ratio", [0, -0.5, 1.01, 10, float("nan"), float("inf")])
    @pytest.mark.parametrize("kind", ["cyclic", "bernoulli", "topk"])
    def test_bad_ratio(self, kind, ratio):
        with pytest.raises(ConfigError):
            make_mask(kind, layout(), ratio, 0)
        with pytest.raises(ConfigError):
            sc.Communicator(None, [np.zeros((100, 120), np.float32)], ratio=ratio, mask=kind)


class TestBlockMask:
    """The cyclic mask over runs of ``block`` contiguous elements (Communicator(block=...))."""

    @pytest.mark.parametrize("bad", [0, -1, 1.5, "64", None, True])
    def test_bad_block(self, bad):
        with pytest.raises(ConfigError):
            make_mask("cyclic", layout(), 0.1, 0, bad)
        with pytest.raises(ConfigError):
            sc.Communicator(None, [np.zeros((100, 120), np.float32)], block=bad)

    @pytest.mark.parametrize("kind", ["bernoulli", "topk"])
    def test_block_is_for_the_cyclic_mask_only(self, kind):
        with pytest.raises(ConfigError, match="cyclic mask only"):
            make_mask(kind, layout(), 0.1, 0, 64)
        with pytest.raises(ConfigError, match="cyclic mask only"):
            sc.Communicator(None, [np.zeros((100, 120), np.float32)], mask=kind, block=64)
        assert make_mask(kind, layout(), 0.1, 0, 1).kind == kind

    def test_block_one_is_the_element_mask(self):
        lay = layout()
        a, b = sc.CyclicMask(lay, 0.1, 9), sc.CyclicMask(lay, 0.1, 9, block=1)
        for t in range(1, 12):
            assert np.array_equal(a.select(t).index, b.select(t).index)
            assert b.select(t).blocks is None

    def test_runs_are_selected_whole(self):
        lay = sc.Layout([(100, 120), (7,), (50, 300), (3, 3), (200, 91)])
        B = 64
        mask = sc.CyclicMask(lay, 0.1, 3, block=B)
        comp = np.zeros(lay.total, bool)
        comp[lay.compressible_index] = True
        for t in range(1, mask.num_chunks + 1):
            sel = mask.select(t)
            assert np.all(np.diff(sel.index) > 0)  # payload order: tensor by tensor, increasing
            part = sel.index[comp[sel.index]]
            for run in np.unique(part // B):  # every run touched is taken with all its compressible elements
                members = np.arange(run * B, min((run + 1) * B, lay.total))
                assert np.array_equal(np.intersect1d(part, members), members[comp[members]])
            assert sel.blocks is not None and np.array_equal(sel.blocks, np.unique(part // B))

    def test_communicator_with_blocks_equals_mean_on_the_mask(self):
        arrs = [np.random.default_rng(1).standard_normal((100, 120)).astype(np.float32), np.ones(5, np.float32)]
        comm = sc.Communicator(None, arrs, ratio=0.1, block=256, seed=4)
        assert comm.mask.block == 256
        before = [a.copy() for a in arrs]
        _, idx = comm.masked_allreduce(arrs, 1)
        flat = np.concatenate([a.ravel() for a in before])
        assert np.array_equal(idx[-5:], np.arange(12000, 12005))  # tensor by tensor: the dense one is last
        assert (idx.size - 5) % 256 in (0, 224)  # whole runs (the last run of the tensor has 224)
        assert np.array_equal(np.concatenate([a.ravel() for a in arrs]), flat)  # P = 1: the mean is the value
        assert comm.state_dict()["mask"]["block"] == 256


@pytest.mark.parametrize("bad", ["bfloat16", "int8", "bf16", "int32", "float8"])
def test_communicator_rejects_value_dtype(bad):
    with pytest.raises(DTypeError):
        sc.Communicator(None, [np.zeros((100, 120), np.float32)], value_dtype=bad)


@pytest.mark.parametrize("ok,itemsize", [("float16", 2), ("fp16", 2), ("half", 2), ("float32", 4), ("fp32", 4), ("float64", 8), (np.float16, 2)])
def test_communicator_accepts_value_dtype(ok, itemsize):
    c = sc.Communicator(None, [np.zeros((100, 120), np.float32)], value_dtype=ok)
    assert c.value_dtype.itemsize == itemsize


# --------------------------------------------------------------------------- global RNGs
def _np_state_equal(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def _use_every_mask_and_exchange():
    lay = layout()
    flat = np.random.default_rng(11).standard_normal(lay.total).astype(np.float32)
    for kind in ("cyclic", "bernoulli", "topk"):
        m = make_mask(kind, lay, 0.1, 77)
        for t in (1, 2, 3):
            m.select(t, np, flat, sc.LocalTransport())
        for seed in (None, 5):  # None: a seed is drawn, still without the global RNG
            arrs = [np.ones((100, 120), np.float32), np.ones(50, np.float32)]
            comm = sc.Communicator(None, arrs, mask=kind, seed=seed)
            comm.masked_allreduce(arrs, 1)
            comm.masked_allreduce(arrs, 2)
            comm.sparse_allgather(arrs)
            comm.sync(arrs)


def test_masks_do_not_touch_numpy_global_rng():
    np.random.seed(1234)
    before = np.random.get_state()
    _use_every_mask_and_exchange()
    after = np.random.get_state()
    assert _np_state_equal(before, after)
    # and the next global draw is what it would have been
    np.random.set_state(before)
    expect = np.random.random(3)
    np.random.set_state(after)
    assert np.array_equal(np.random.random(3), expect)


def test_masks_do_not_touch_torch_global_rng():
    torch = pytest.importorskip("torch")
    torch.manual_seed(99)
    before = torch.get_rng_state().clone()
    _use_every_mask_and_exchange()
    assert torch.equal(torch.get_rng_state(), before)
