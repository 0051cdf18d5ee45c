"""Single-process tests of Communicator(None, ...): semantics at P = 1, input validation,
non-finite handling, statistics (docs/algorithm.md section 4) and DLPack in-place updates."""

import copy
import math
import sys
import types

import numpy as np
import pytest

import slamb_comm as sc
from slamb_comm.errors import (
    ConfigError,
    DTypeError,
    LayoutError,
    NonContiguousError,
    NonFiniteError,
    SlambCommError,
)

SHAPES = [(100, 120), (50,), (100, 120)]
NAMES = ["w1", "b", "w2"]
TOTAL = 24050
MASKS = ["cyclic", "bernoulli", "topk"]


def make_arrays(seed, dtype=np.float32, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def flat_of(arrays):
    return np.concatenate([a.ravel() for a in arrays])


def comm_for(arrays=None, **kw):
    kw.setdefault("names", NAMES)
    kw.setdefault("seed", 2024)
    return sc.Communicator(None, arrays if arrays is not None else make_arrays(0), **kw)


def ref_topk(c, layout, ratio, vdt=np.float32):
    """Reference of docs/algorithm.md section 2, one rank: the decoded top-k of c, per tensor."""
    sent = np.zeros_like(c)
    for o, n in layout.segments():
        seg = c[o : o + n]
        k = sc.k_elems(ratio, n)
        sel = np.argsort(-np.abs(seg.astype(np.float64)), kind="stable")[:k]
        sent[o + sel] = seg[sel].astype(vdt).astype(c.dtype)
    return sent


def snapshot_stats(stats):
    return copy.deepcopy((stats.last, stats.step, stats.total, stats.by_kind))


def assert_failed_exchange_counted(stats, before, kind):
    """A failed exchange changes no state, but its collective ran: the statistics count one
    more call of ``kind`` with the bytes it sent (and nothing decoded)."""
    last, step, total, by_kind = before
    t = stats.last
    assert t.calls == 1 and t.payload_bytes > 0 and t.wire_bytes >= 0 and t.decode_s == 0.0
    assert stats.total.calls == total.calls + 1
    assert stats.total.payload_bytes == total.payload_bytes + t.payload_bytes
    assert stats.step.payload_bytes == step.payload_bytes + t.payload_bytes
    assert stats.by_kind[kind].calls == by_kind.get(kind, sc.Traffic()).calls + 1
    assert {k: v for k, v in stats.by_kind.items() if k != kind} == {k: v for k, v in by_kind.items() if k != kind}
    return t


# --------------------------------------------------------------------------- P = 1 semantics
class TestSingleRank:
    @pytest.mark.parametrize("mask", MASKS)
    @pytest.mark.parametrize("ratio", [0.1, 1.0])
    def test_masked_allreduce_leaves_values(self, mask, ratio):
        arrs = make_arrays(1)
        orig = [a.copy() for a in arrs]
        comm = comm_for(arrs, mask=mask, ratio=ratio)
        for step in (1, 2, 3):
            out, idx = comm.masked_allreduce(arrs, step)
            assert out is arrs
            for a, o in zip(arrs, orig):
                assert np.array_equal(a, o)
            assert np.unique(idx).size == idx.size
            assert np.all(np.isin(comm.layout.dense_index, idx))
            if ratio == 1.0:
                assert idx.size == TOTAL
        flat = flat_of(orig)
        f2 = flat.copy()
        out, _ = comm.masked_allreduce(f2, 4)
        assert out is f2 and np.array_equal(f2, flat)

    @pytest.mark.parametrize("mask", ["cyclic", "bernoulli"])
    def test_masked_allreduce_mask_is_the_codec_mask(self, mask):
        comm = comm_for(mask=mask, ratio=0.1)
        ref = sc.wire.masks.make_mask(mask, comm.layout, 0.1, comm.seed)
        assert comm.seed == 2024
        for step in (1, 2, 11):
            _, idx = comm.masked_allreduce(make_arrays(step), step)
            assert np.array_equal(idx, ref.select(step))

    def test_masked_allreduce_fp16_payload_rounds_only_the_mask(self):
        arrs = make_arrays(2)
        orig = [a.copy() for a in arrs]
        comm = comm_for(arrs, value_dtype="float16")
        _, idx = comm.masked_allreduce(arrs, 1)
        flat, ref = flat_of(arrs), flat_of(orig)
        inm = np.zeros(TOTAL, bool)
        inm[idx] = True
        assert np.array_equal(flat[~inm], ref[~inm])
        assert np.array_equal(flat[inm], ref[inm].astype(np.float16).astype(np.float32))

    @pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
    def test_sync_leaves_values(self, dtype):
        arrs = make_arrays(3, dtype)
        orig = [a.copy() for a in arrs]
        comm = comm_for(arrs)
        assert comm.sync(arrs) is arrs
        for a, o in zip(arrs, orig):
            assert np.array_equal(a, o)
        f = flat_of(orig)
        assert np.array_equal(comm.sync(f.copy()), f)

    @pytest.mark.parametrize("ratio", [0.1, 0.37])
    @pytest.mark.parametrize("vdt", ["float32", "float16"])
    def test_sparse_allgather_is_topk_with_error_feedback(self, ratio, vdt):
        comm = comm_for(ratio=ratio, value_dtype=vdt)
        lay = comm.layout
        e = np.zeros(TOTAL, np.float32)
        sent_total = np.zeros(TOTAL, np.float64)
        g_total = np.zeros(TOTAL, np.float64)
        for step in range(6):
            g = make_arrays(100 + step)
            gflat = flat_of(g)
            g_copy = [a.copy() for a in g]
            out = comm.sparse_allgather(g)
            c = gflat + e
            sent = ref_topk(c, lay, ratio, np.dtype(vdt))
            e = c - sent
            assert isinstance(out, list) and [o.shape for o in out] == lay.shapes
            assert np.array_equal(flat_of(out), sent)  # P = 1: the mean is what was sent
            assert np.array_equal(comm.residual, e)  # residual = c - sent
            for a, b in zip(g, g_copy):  # x itself is not modified
                assert np.array_equal(a, b)
            nk = sum(sc.k_elems(ratio, n) for n in lay.sizes)
            assert np.count_nonzero(sent) == nk
            sent_total += sent
            g_total += gflat
            # nothing is lost
            np.testing.assert_allclose(sent_total + comm.residual, g_total, rtol=1e-5, atol=1e-5)

    def test_sparse_allgather_follows_a_ratio_schedule(self):
        """set_ratio between steps: the next exchange sends the new ratio's top-k of the
        residual-corrected input; the residual carries over and nothing is lost."""
        comm = comm_for(ratio=0.5)
        lay = comm.layout
        e = np.zeros(TOTAL, np.float32)
        g_total = np.zeros(TOTAL, np.float64)
        sent_total = np.zeros(TOTAL, np.float64)
        for step, ratio in enumerate([0.5, 0.5, 0.2, 0.1, 0.1, 1.0, 0.1]):
            comm.set_ratio(ratio, step)
            g = flat_of(make_arrays(200 + step))
            out = comm.sparse_allgather(g)
            c = g + e
            sent = ref_topk(c, lay, ratio)
            e = c - sent
            assert np.array_equal(out, sent) and np.array_equal(comm.residual, e)
            assert np.count_nonzero(sent) == sum(sc.k_elems(ratio, n) for n in lay.sizes)
            sent_total += sent
            g_total += g
            np.testing.assert_allclose(sent_total + comm.residual, g_total, rtol=1e-5, atol=1e-5)
        with pytest.raises(sc.ConfigError, match="ratio"):
            comm.set_ratio(1.5, 9)
        assert comm.ratio == 0.1

    @pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5])
    def test_sparse_allgather_large_tensors(self, ratio):
        """Tensors above 16384 elements take top-k's fast path: still exactly the reference."""
        shapes = [(300, 200), (70,), (250, 401)]
        comm = sc.Communicator(None, [np.zeros(s, np.float32) for s in shapes], ratio=ratio, seed=1)
        lay = comm.layout
        e = np.zeros(lay.total, np.float32)
        for step in range(3):
            g = np.random.default_rng(step).standard_normal(lay.total).astype(np.float32)
            g[::7] *= 10  # some structure for the strided sample
            out = comm.sparse_allgather(g)
            c = g + e
            sent = ref_topk(c, lay, ratio)
            e = c - sent
            assert np.array_equal(out, sent)
            assert np.array_equal(comm.residual, e)

    def test_sparse_allgather_ratio_one_is_dense(self):
        comm = comm_for(ratio=1.0)
        for s in range(3):
            g = flat_of(make_arrays(s))
            out = comm.sparse_allgather(g)
            assert np.array_equal(out, g)
            assert not np.any(comm.residual)


# --------------------------------------------------------------------------- input validation
def _ops(comm):
    return {
        "masked_allreduce": lambda x: comm.masked_allreduce(x, 1),
        "sparse_allgather": comm.sparse_allgather,
        "sync": comm.sync,
    }


OPS = ["masked_allreduce", "sparse_allgather", "sync"]


def _bad_inputs():
    good = make_arrays(5)
    f = flat_of(good)
    fortran = [np.asfortranarray(good[0]), good[1], good[2]]
    assert not fortran[0].flags.c_contiguous
    return {
        "wrong shape": (LayoutError, [good[0].reshape(120, 100), good[1], good[2]]),
        "wrong shape 1-d": (LayoutError, [good[0], np.zeros(51, np.float32), good[2]]),
        "too few": (LayoutError, good[:2]),
        "too many": (LayoutError, good + [np.zeros(3, np.float32)]),
        "empty list": (LayoutError, []),
        "wrong dtype": (LayoutError, [good[0].astype(np.float64), good[1], good[2]]),
        "unsupported dtype": (DTypeError, [good[0].astype(np.int32), good[1], good[2]]),
        "non-contiguous": (NonContiguousError, fortran),
        "fused wrong size": (LayoutError, f[:-1].copy()),
        "fused 2-d": (LayoutError, f.reshape(2, -1)),
        "fused wrong dtype": (LayoutError, f.astype(np.float64)),
        "fused unsupported dtype": (DTypeError, f.astype(np.int64)),
        "fused non-contiguous": (NonContiguousError, np.repeat(f, 2)[::2]),
        "python list": (TypeError, [good[0].tolist(), good[1], good[2]]),
        "string": (TypeError, "abc"),
        "none": (TypeError, None),
        "float": (TypeError, 3.0),
        "none in list": (TypeError, [good[0], None, good[2]]),
    }


BAD = list(_bad_inputs())


class TestValidation:
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("case", BAD)
    def test_bad_input_raises_and_changes_nothing(self, op, case):
        comm = comm_for()
        comm.sparse_allgather(make_arrays(9))  # a non-zero residual to protect
        res = comm.residual.copy()
        stats = snapshot_stats(comm.stats)
        exc, x = _bad_inputs()[case]
        before = copy.deepcopy(x)
        with pytest.raises(exc):
            _ops(comm)[op](x)
        assert np.array_equal(comm.residual, res)
        assert_failed_exchange_counted(comm.stats, stats, op)
        if isinstance(x, list):
            for a, b in zip(x, before):
                assert np.array_equal(np.asarray(a), np.asarray(b))
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, before)
        # the communicator still works afterwards
        good = make_arrays(5)
        _ops(comm)[op](good)

    def test_exception_hierarchy(self):
        assert issubclass(NonContiguousError, LayoutError)
        assert issubclass(LayoutError, ValueError) and issubclass(LayoutError, SlambCommError)
        assert issubclass(DTypeError, TypeError)
        assert issubclass(ConfigError, ValueError)
        assert issubclass(NonFiniteError, FloatingPointError)

    @pytest.mark.parametrize("op", OPS)
    def test_mixed_numpy_cupy_raises_type_error(self, op, monkeypatch):
        # A stand-in for CuPy (is_cupy looks in sys.modules): mixing libraries is a TypeError.
        class FakeCupyArray:
            pass

        fake = types.ModuleType("cupy")
        fake.ndarray = FakeCupyArray
        monkeypatch.setitem(sys.modules, "cupy", fake)
        comm = comm_for()
        g = make_arrays(1)
        with pytest.raises(TypeError, match="mix"):
            _ops(comm)[op]([g[0], FakeCupyArray(), g[2]])
        with pytest.raises(TypeError, match="mix"):
            sc.arrays.namespace(g[0], FakeCupyArray())

    @pytest.mark.parametrize("step", [0, -1, 1.0, "1", True, None])
    def test_bad_step(self, step):
        with pytest.raises(ConfigError):
            comm_for().masked_allreduce(make_arrays(0), step)

    def test_constructor_validation(self):
        with pytest.raises(DTypeError):
            sc.Communicator(None, [np.zeros((3, 3), np.int32)])
        with pytest.raises(DTypeError):
            sc.Communicator(None, [np.zeros(3, np.float32), np.zeros(3, np.float64)])
        with pytest.raises(TypeError):
            sc.Communicator(None, [[1.0, 2.0]])
        with pytest.raises(ConfigError):
            sc.Communicator(None, make_arrays(0), names=["a"])
        with pytest.raises(ConfigError):
            sc.Communicator(None, make_arrays(0), dense_threshold=-5)
        c = sc.Communicator(None, sc.Layout(SHAPES, "float64"), ratio=0.5)
        assert c.layout.dtype == np.float64 and c.rank == 0 and c.size == 1


# --------------------------------------------------------------------------- non-finite
class TestNonFinite:
    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("fused", [False, True])
    def test_raises_and_changes_nothing(self, bad, op, fused):
        comm = comm_for()
        comm.sparse_allgather(make_arrays(9))
        comm.masked_allreduce(make_arrays(9), 1)
        res = comm.residual.copy()
        stats = snapshot_stats(comm.stats)
        arrs = make_arrays(10)
        arrs[1][7] = bad  # the 1-D tensor 'b' is always dense: in every M_t
        x = flat_of(arrs) if fused else arrs
        before = copy.deepcopy(x)
        with pytest.raises(NonFiniteError) as ei:
            _ops(comm)[op](x)
        assert ei.value.ranks == (0,)
        if op != "sparse_allgather":
            assert ei.value.tensors == ("b",)
        if fused:
            assert np.array_equal(x, before, equal_nan=True)
        else:
            for a, b in zip(x, before):
                assert np.array_equal(a, b, equal_nan=True)
        assert np.array_equal(comm.residual, res)
        t = assert_failed_exchange_counted(comm.stats, stats, op)
        ok = comm_for()
        _ops(ok)[op](make_arrays(10))
        if op == "sync":  # the sync's status word travels alone, first: only it was sent
            assert t.payload_bytes == np.dtype(np.float32).itemsize
        else:  # the bytes a successful call sends (the failure is found in its only collective)
            assert t.payload_bytes == ok.stats.last.payload_bytes

    def test_nan_in_compressible_tensor_in_mask(self):
        comm = comm_for()
        arrs = make_arrays(11)
        idx = comm.mask.select(3).index
        pos = int(idx[idx >= 12050][0])  # in 'w2', selected at step 3
        arrs[2].ravel()[pos - 12050] = np.nan
        before = copy.deepcopy(arrs)
        with pytest.raises(NonFiniteError) as ei:
            comm.masked_allreduce(arrs, 3)
        assert ei.value.tensors == ("w2",)
        for a, b in zip(arrs, before):
            assert np.array_equal(a, b, equal_nan=True)

    def test_first_call_nan_leaves_residual_unallocated(self):
        comm = comm_for()
        arrs = make_arrays(12)
        arrs[0][5, 5] = np.nan
        with pytest.raises(NonFiniteError):
            comm.sparse_allgather(arrs)
        assert comm.residual is None
        assert comm.stats.total.calls == 1 and comm.stats.by_kind["sparse_allgather"].calls == 1

    @pytest.mark.parametrize("op", OPS[:2])
    def test_fp16_overflow_is_non_finite(self, op):
        """value_dtype float16: a value beyond 65504 would become Inf on the wire; rejected."""
        comm = comm_for(value_dtype="float16")
        comm.sparse_allgather(make_arrays(9))
        res = comm.residual.copy()
        stats = snapshot_stats(comm.stats)
        arrs = make_arrays(13)
        arrs[1][3] = 1e5  # always in M_t, and the largest |c| of 'b'
        before = copy.deepcopy(arrs)
        with np.errstate(over="ignore"), pytest.raises(NonFiniteError) as ei:
            _ops(comm)[op](arrs)
        assert ei.value.ranks == (0,)
        for a, b in zip(arrs, before):
            assert np.array_equal(a, b)
        assert np.array_equal(comm.residual, res)
        assert_failed_exchange_counted(comm.stats, stats, op)


# --------------------------------------------------------------------------- list vs fused
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("vdt", ["float32", "float16"])
def test_list_and_fused_inputs_agree(mask, vdt):
    a = comm_for(mask=mask, value_dtype=vdt, ratio=0.2)
    b = comm_for(mask=mask, value_dtype=vdt, ratio=0.2)
    for step in (1, 2, 3, 4):
        arrs = make_arrays(20 + step)
        flat = flat_of(arrs)
        _, ia = a.masked_allreduce(arrs, step)
        _, ib = b.masked_allreduce(flat, step)
        assert np.array_equal(ia, ib)
        assert np.array_equal(flat_of(arrs), flat)
        g = make_arrays(40 + step)
        oa = a.sparse_allgather(g)
        ob = b.sparse_allgather(flat_of(g))
        assert np.array_equal(flat_of(oa), ob)
        assert np.array_equal(a.residual, b.residual)
        s = make_arrays(60 + step)
        fs = flat_of(s)
        a.sync(s)
        b.sync(fs)
        assert np.array_equal(flat_of(s), fs)
    assert a.stats.total.payload_bytes == b.stats.total.payload_bytes


# --------------------------------------------------------------------------- stats
def _topk_wire_bytes(counts, itemsize):
    k = sum(counts)
    # header | int32 indices, padded to 8 | values, padded to 8 (so every rank's payload in an
    # allgather buffer starts 8-byte aligned)
    return math.ceil((8 + math.ceil(4 * k / 8) * 8 + itemsize * k) / 8) * 8


class TestStats:
    @pytest.mark.parametrize("vdt,itemsize", [("float32", 4), ("float16", 2), ("float64", 8)])
    def test_masked_allreduce_payload(self, vdt, itemsize):
        comm = comm_for(value_dtype=vdt, ratio=0.1)
        _, idx = comm.masked_allreduce(make_arrays(0), 1)
        m = 2400 + 50  # one of 10 chunks of the 24000 compressible elements + the dense 'b'
        assert idx.size == m
        t = comm.stats.last
        assert t.calls == 1
        assert t.payload_bytes == (m + 1) * itemsize  # |M_t| values + one status element
        assert t.payload_bytes == {4: 9804, 2: 4902, 8: 19608}[itemsize]
        assert t.dense_payload_bytes == 4 * TOTAL == 96200
        assert t.elements_sent == m and t.elements_total == TOTAL
        assert t.wire_bytes == 0 and t.dense_wire_bytes == 0  # one rank puts nothing on a link
        assert t.ratio == pytest.approx(t.payload_bytes / 96200)
        assert t.encode_s >= 0 and t.comm_s >= 0 and t.decode_s >= 0

    @pytest.mark.parametrize("vdt,itemsize", [("float32", 4), ("float16", 2), ("float64", 8)])
    def test_sparse_allgather_payload(self, vdt, itemsize):
        comm = comm_for(value_dtype=vdt, ratio=0.1)
        comm.sparse_allgather(make_arrays(0))
        t = comm.stats.last
        counts = [1200, 5, 1200]
        assert comm.wire.counts == counts
        assert t.payload_bytes == _topk_wire_bytes(counts, itemsize)
        assert t.payload_bytes == {4: 19256, 2: 14448, 8: 28872}[itemsize]
        assert t.elements_sent == 2405 and t.elements_total == TOTAL
        assert t.dense_payload_bytes == 96200

    def test_sparse_allgather_payload_odd_k(self):
        comm = sc.Communicator(None, [np.zeros((100, 120), np.float32), np.zeros(30, np.float32)], ratio=0.1)
        comm.sparse_allgather([np.ones((100, 120), np.float32), np.ones(30, np.float32)])
        # K = 1203: 4812 index bytes padded to 4816; 4812 value bytes padded to 4816
        assert comm.stats.last.payload_bytes == 8 + 4816 + 4816 == _topk_wire_bytes([1200, 3], 4)

    @pytest.mark.parametrize("dtype,itemsize", [(np.float32, 4), (np.float64, 8), (np.float16, 2)])
    def test_sync_payload(self, dtype, itemsize):
        arrs = make_arrays(0, dtype)
        comm = comm_for(arrs)
        comm.sync(arrs)
        t = comm.stats.last
        assert t.payload_bytes == (TOTAL + 1) * itemsize
        assert t.dense_payload_bytes == TOTAL * itemsize
        assert t.elements_sent == t.elements_total == TOTAL

    def test_per_step_reset_and_totals(self):
        comm = comm_for(ratio=0.1)
        arrs = make_arrays(0)
        comm.masked_allreduce(arrs, 1)
        comm.sparse_allgather(arrs)
        assert comm.stats.step.calls == 2
        assert comm.stats.step.payload_bytes == 9804 + 19256
        done = comm.stats.new_step()
        assert done.calls == 2 and done.payload_bytes == 9804 + 19256
        assert comm.stats.step.calls == 0 and comm.stats.step.payload_bytes == 0
        comm.sync(arrs)
        assert comm.stats.step.calls == 1 and comm.stats.step.payload_bytes == 4 * (TOTAL + 1)
        assert comm.stats.last.payload_bytes == 4 * (TOTAL + 1)
        assert comm.stats.total.calls == 3
        assert comm.stats.total.payload_bytes == 9804 + 19256 + 4 * (TOTAL + 1)
        assert comm.stats.total.dense_payload_bytes == 3 * 96200
        assert set(comm.stats.by_kind) == {"masked_allreduce", "sparse_allgather", "sync"}
        assert comm.stats.by_kind["sparse_allgather"].payload_bytes == 19256
        d = comm.stats.total.as_dict()
        assert d["calls"] == 3 and d["ratio"] == pytest.approx(d["payload_bytes"] / d["dense_payload_bytes"])
        assert "exchanges" in comm.stats.summary()

    def test_wire_formulas(self):
        from slamb_comm.wire.stats import allgather_wire, allreduce_wire

        assert allreduce_wire(1000, 1) == 0
        assert allreduce_wire(1000, 4) == pytest.approx(1500)
        assert allgather_wire(1000, 4) == 3000
        assert allgather_wire(1000, 1) == 0


# --------------------------------------------------------------------------- DLPack
class _Tripling(sc.LocalTransport):
    """One rank whose 'allreduce' triples the buffer, so in-place writes are visible."""

    def allreduce(self, buf):
        super().allreduce(buf)
        buf *= 3


class TestDLPack:
    def test_torch_cpu_tensors_updated_in_place(self):
        torch = pytest.importorskip("torch")
        g = torch.Generator().manual_seed(0)
        ts = [torch.randn(100, 120, generator=g), torch.randn(50, generator=g), torch.randn(100, 120, generator=g)]
        ptrs = [t.data_ptr() for t in ts]
        orig = [t.clone() for t in ts]
        comm = sc.Communicator(_Tripling(), ts, ratio=0.1, seed=1)
        out, idx = comm.masked_allreduce(ts, 1)
        assert out is ts and [t.data_ptr() for t in ts] == ptrs
        got, ref = flat_of([t.numpy() for t in ts]), flat_of([t.numpy() for t in orig])
        inm = np.zeros(TOTAL, bool)
        inm[idx.astype(np.int64)] = True
        assert np.array_equal(got[inm], 3 * ref[inm])
        assert np.array_equal(got[~inm], ref[~inm])
        comm.sync(ts)
        assert np.array_equal(flat_of([t.numpy() for t in ts]), 3 * got)
        # a fused torch buffer is a zero-copy view as well
        f = torch.randn(TOTAL, generator=g)
        f0 = f.clone()
        assert comm.sync(f) is f
        assert torch.equal(f, 3 * f0)
        # sparse_allgather reads torch input (and returns NumPy), leaving it alone
        before = f.clone()
        res = comm.sparse_allgather(f)
        assert isinstance(res, np.ndarray) and torch.equal(f, before)

    def test_as_array_of_torch_cpu_is_a_view(self):
        torch = pytest.importorskip("torch")
        t = torch.zeros(4, 5)
        a = sc.arrays.as_array(t)
        assert isinstance(a, np.ndarray) and a.ctypes.data == t.data_ptr()
        a[1, 2] = 7
        assert t[1, 2].item() == 7

    def test_non_contiguous_torch_tensor(self):
        torch = pytest.importorskip("torch")
        ts = [torch.zeros(120, 100).t(), torch.zeros(50), torch.zeros(100, 120)]
        comm = sc.Communicator(None, [np.zeros(s, np.float32) for s in SHAPES])
        with pytest.raises(NonContiguousError):
            comm.sync(ts)


# --------------------------------------------------------------------------- state
def test_state_dict_round_trip_resumes_exactly():
    import pickle

    a = comm_for(ratio=0.1, seed=5)
    for s in range(3):
        a.sparse_allgather(make_arrays(s))
    state = pickle.loads(pickle.dumps(a.state_dict()))
    b = comm_for(ratio=0.1, seed=6)
    b.load_state_dict(state)
    assert b.seed == 5 and np.array_equal(b.residual, a.residual)
    for s in range(3, 6):
        assert np.array_equal(flat_of(a.sparse_allgather(make_arrays(s))), flat_of(b.sparse_allgather(make_arrays(s))))
        assert np.array_equal(a.residual, b.residual)
        _, ia = a.masked_allreduce(make_arrays(s), s)
        _, ib = b.masked_allreduce(make_arrays(s), s)
        assert np.array_equal(ia, ib)
    with pytest.raises(sc.LayoutMismatchError):
        comm_for(ratio=0.1, value_dtype="float16").load_state_dict(state)
    c = comm_for(ratio=0.2)  # the ratio is part of the state (a schedule changes it): adopted
    c.load_state_dict(state)
    assert c.ratio == 0.1 and c.mask.num_chunks == 10 and c.wire.ratio == 0.1
    assert np.array_equal(c.masked_allreduce(make_arrays(7), 7)[1], a.masked_allreduce(make_arrays(7), 7)[1])


def test_sync_of_a_lazy_sequence_holds_one_bucket_of_copies():
    """The torch adapters hand 16-bit parameters as a lazily converted sequence: the bucketed
    sync reads a tensor when its bucket is filled and releases it (``written``) once written,
    so only a bucket's worth of converted copies is alive at a time."""

    class Lazy:
        def __init__(self, arrays):
            self.arrays, self.alive, self.most = arrays, set(), 0

        def __len__(self):
            return len(self.arrays)

        def __getitem__(self, i):
            self.alive.add(i)
            self.most = max(self.most, len(self.alive))
            return self.arrays[i]

        def written(self, i):
            self.alive.discard(i)

    arrs = [np.full(1000, float(i), np.float32) for i in range(10)]
    comm = sc.Communicator(None, arrs, ratio=0.1, bucket_bytes=8000)  # 2,000 elements per bucket
    lazy = Lazy(arrs)
    comm.sync(lazy, written=lazy.written, bad=False)
    assert lazy.most <= 3 and not lazy.alive
    assert comm.stats.last.calls == 1 and [float(a[0]) for a in arrs] == list(range(10))


# --------------------------------------------------------------------------- ranks that contribute zeros
class _OthersJoined(sc.LocalTransport):
    """This rank of ``size`` ranks, the others contributing zeros to every sum: what Horovod's
    ``join()`` does to the ranks still working (construction's agreement sees them agree)."""

    size = 4

    def allgather(self, sendbuf, recvbuf):
        recvbuf.reshape(self.size, -1)[:] = sendbuf


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sync_averages_over_the_ranks_that_took_part(dtype):
    """A sync where 3 of 4 ranks contribute zeros is the mean over the one that took part (its own
    values), not its values / 4: parameters must not shrink under Horovod's join()."""
    arrays = make_arrays(3, dtype)
    before = [a.copy() for a in arrays]
    comm = sc.Communicator(_OthersJoined(), arrays, bucket_bytes=4096)  # several buckets
    comm.sync(arrays)
    for a, b in zip(arrays, before):
        np.testing.assert_allclose(a, b, rtol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("topk_dense", [False, True])
def test_sparse_allgather_topk_dense_sends_always_dense_tensors_whole(topk_dense):
    """``topk_dense=True``: the layout's always-dense tensors (here the 1-D bias) go whole; by
    default every tensor sends its k_elems (docs/algorithm.md section 2)."""
    arrays = make_arrays(5)
    comm = comm_for(arrays, ratio=0.1, dense_threshold=9000, topk_dense=topk_dense)
    lay = comm.layout
    want = [n if (topk_dense and d) else sc.k_elems(0.1, n) for n, d in zip(lay.sizes, lay.dense)]
    assert comm.wire.counts == want and (want[1] == 50) == topk_dense
    g = make_arrays(6)
    out = comm.sparse_allgather(g)
    c = flat_of(g)
    ref = ref_topk(c, lay, 0.1)
    if topk_dense:
        o, n = lay.segments()[1]
        ref[o : o + n] = c[o : o + n]
    assert np.array_equal(flat_of(out), ref)
    assert np.array_equal(comm.residual, c - ref)


# --------------------------------------------------------------------------- the fused top-k exchange
# sparse_allgather works on the whole fused buffer (and, on a device, selects every tensor's
# top-k with the radix select of slamb_comm/device/topk_kernels.py). These tests fix its results bit for bit against
# the exchange as it was done tensor by tensor before (the reference below), at 1 to 4 ranks
# run as threads of this process, on NumPy and on the strict CuPy double, and count its device
# operations, host-to-device copies and host reads.
import threading  # noqa: E402

from tests.support import strict_cupy  # noqa: E402
from slamb_comm.wire.codecs import topk_indices_reference  # noqa: E402


def _raw(buf):
    return buf._a if isinstance(buf, strict_cupy.ndarray) else buf  # the double's host memory


class ThreadRanks:
    """``size`` ranks as threads of this process: each gets a transport whose collectives meet
    at a barrier (allgather, allreduce, alltoall, broadcast), on NumPy or strict-double buffers."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots = [None] * size

    def run(self, fn):
        """``fn(rank, transport)`` on every rank at once; the results, or the first error raised."""
        out, errs = [None] * self.size, [None] * self.size

        def go(r):
            try:
                out[r] = fn(r, _ThreadTransport(self, r))
            except BaseException as e:  # noqa: BLE001 -- re-raised below, in the test's thread
                errs[r] = e
                self.barrier.abort()

        threads = [threading.Thread(target=go, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errs:
            if e is not None:
                raise e
        return out


class _ThreadTransport:
    name = "threads"

    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, group.size

    def _everyone(self, buf):
        g = self.group
        g.slots[self.rank] = _raw(buf).reshape(-1).copy()
        g.barrier.wait()
        everyone = list(g.slots)
        g.barrier.wait()
        return everyone

    def allgather(self, sendbuf, recvbuf):
        _raw(recvbuf).reshape(-1)[...] = np.concatenate(self._everyone(sendbuf))

    def allreduce(self, buf):
        parts = self._everyone(buf)
        acc = parts[0].copy()
        for p in parts[1:]:
            acc += p
        _raw(buf).reshape(-1)[...] = acc

    def alltoall(self, sendbuf, recvbuf):
        parts = self._everyone(sendbuf)
        n = parts[0].size // self.size
        _raw(recvbuf).reshape(-1)[...] = np.concatenate([p[self.rank * n : (self.rank + 1) * n] for p in parts])

    def broadcast(self, buf, root=0):
        _raw(buf).reshape(-1)[...] = self._everyone(buf)[root]

    def barrier(self):
        self.group.barrier.wait()


def per_tensor_exchange(lay, ratio, vdt, xs, es, whole_dense=False, skip=()):
    """The top-k exchange of docs/algorithm.md section 2 as slamb_comm computed it tensor by tensor
    (before the fused path), operation for operation, so its bits are the reference: per rank
    and tensor ``c = x + e``, the stable top-k (:func:`topk_indices_reference`), the values cast
    to the payload dtype; every rank's payload added tensor by tensor, rank after rank, in
    ``promote(dtype, float32)``, times 1/P, cast back; ``e = (e or zeros) + x - sent`` (the
    tensors in ``skip`` keep theirs). ``xs``, ``es``: every rank's fused input and error
    buffer (None before the first exchange). Returns ``(mean, new error buffers)``."""
    P, dt = len(xs), lay.dtype
    vdt = np.dtype(vdt or dt)
    acc = np.promote_types(dt, np.float32)
    counts = [n if whole_dense and d else sc.k_elems(ratio, n) for n, d in zip(lay.sizes, lay.dense)]
    sent = []
    for r in range(P):
        mine = []
        for (o, n), k in zip(lay.segments(), counts):
            c = xs[r][o : o + n] if es[r] is None else xs[r][o : o + n] + es[r][o : o + n]
            loc = topk_indices_reference(c, k)
            mine.append((o + loc, c[loc].astype(vdt)))
        sent.append(mine)
    out = np.zeros(lay.total, acc)
    for r in range(P):
        for pos, v in sent[r]:
            out[pos] += v.astype(acc)
    if P > 1:
        out *= acc.type(1.0 / P)
    out = out.astype(dt)
    new = []
    for r in range(P):
        e = np.zeros(lay.total, dt) if es[r] is None else es[r].copy()
        for i, ((o, n), (pos, v)) in enumerate(zip(lay.segments(), sent[r])):
            if i not in skip:
                e[o : o + n] += xs[r][o : o + n]
                e[pos] -= v.astype(dt)
        new.append(e)
    return out, new


def _bits(a):
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


def _host_flat(a):
    if isinstance(a, (list, tuple)):
        return np.concatenate([np.array(sc.arrays.to_host(x)).reshape(-1) for x in a])
    return np.array(sc.arrays.to_host(a))


# Sizes that exercise every path: empty and 1-element tensors, k = n, ties, a tensor above the
# CPU's small-input bound (16,384 elements), one that is always dense (ndim 1).
FUSED_SHAPES = [(130, 150), (7,), (0,), (1,), (33, 5), (40, 40), (3,), (2, 3, 4), (1, 1)]


def _inputs(rng, lay, P, steps, kind):
    out = []
    for _ in range(steps):
        xs = []
        for _ in range(P):
            if kind == "ties":  # few distinct magnitudes: ties everywhere, broken by the lower index
                x = rng.integers(-3, 4, lay.total) * 0.25
            elif kind == "zeros":  # mostly +0.0 and -0.0: k exceeds the nonzeros, zeros are sent
                x = np.where(rng.random(lay.total) < 0.8, np.where(rng.random(lay.total) < 0.5, -0.0, 0.0),
                             rng.standard_normal(lay.total))
            else:
                x = rng.standard_normal(lay.total) * 3
            xs.append(x.astype(lay.dtype))
        out.append(xs)
    return out


def _exchange_ranks(P, lay, ratio, vdt, steps_inputs, xp, fused, whole_dense=False, modes=None, bad=None):
    """Run the exchanges on P thread ranks; per step and rank (result or error, residual)."""
    modes = modes or ["commit"] * len(steps_inputs)

    def rank(r, transport):
        dev = (lambda a: a) if xp is np else xp.asarray
        comm = sc.Communicator(transport, lay, ratio=ratio, value_dtype=vdt, seed=1, topk_dense=whole_dense)
        got = []
        for t, (xs, mode) in enumerate(zip(steps_inputs, modes)):
            x = xs[r].copy()
            if bad is not None and bad[0] == t and bad[1] == r:
                x[bad[2]] = bad[3]
            arg = dev(x) if fused else [dev(v.reshape(s)) for v, s in zip(lay.flat_views(x), lay.shapes)]
            try:
                if mode == "commit":
                    out = comm.sparse_allgather(arg)
                else:
                    out = comm.sparse_allgather(arg, commit=False)
                    comm.commit_residual(skip=mode[1])
                res = (_host_flat(out), None)
            except sc.SlambCommError as e:
                res = (None, e)
            got.append((res, None if comm.residual is None else _host_flat(comm.residual)))
        return got

    return ThreadRanks(P).run(rank)


def _check_against_reference(got, lay, ratio, vdt, steps_inputs, whole_dense=False, modes=None):
    P = len(steps_inputs[0])
    modes = modes or ["commit"] * len(steps_inputs)
    es = [None] * P
    for t, (xs, mode) in enumerate(zip(steps_inputs, modes)):
        skip = () if mode == "commit" else mode[1]
        want, es = per_tensor_exchange(lay, ratio, vdt, xs, es, whole_dense, skip)
        for r in range(P):
            (out, err), res = got[r][t]
            assert err is None, err
            assert _bits(out) == _bits(want), f"step {t} rank {r}: the mean differs"
            assert _bits(res) == _bits(es[r]), f"step {t} rank {r}: the error buffer differs"


@pytest.fixture(params=["numpy", "strict"])
def lib(request):
    if request.param == "numpy":
        yield np
        return
    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        yield mod


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros"])
def test_sparse_allgather_is_bitwise_the_per_tensor_exchange(lib, P, kind):
    """Four steps: commit, commit=False + commit_residual(), skip one tensor, skip the big one;
    list and fused inputs alternate; float32 data and payload."""
    lay = sc.Layout(FUSED_SHAPES, "float32", dense_threshold=50)
    rng = np.random.default_rng([P, len(kind)])
    steps = _inputs(rng, lay, P, 4, kind)
    modes = ["commit", ("later", ()), ("later", {1, 4}), ("later", {0})]
    for fused in (False, True):
        got = _exchange_ranks(P, lay, 0.1, None, steps, lib, fused, modes=modes)
        _check_against_reference(got, lay, 0.1, None, steps, modes=modes)


@pytest.mark.parametrize("dtype,vdt", [("float16", None), ("float16", "float32"), ("float32", "float16"),
                                       ("float64", "float16"), ("float64", None), ("float32", "float64")])
@pytest.mark.parametrize("P", [1, 3])
def test_sparse_allgather_dtypes_are_bitwise_the_per_tensor_exchange(lib, dtype, vdt, P):
    """Every data dtype with float16 payloads (and wider ones): the sums in float32, the casts."""
    lay = sc.Layout(FUSED_SHAPES, dtype, dense_threshold=50)
    steps = _inputs(np.random.default_rng(len(dtype) + P), lay, P, 3, "ties" if P == 3 else "normal")
    got = _exchange_ranks(P, lay, 0.05, vdt, steps, lib, fused=P == 1)
    _check_against_reference(got, lay, 0.05, vdt, steps)


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_sparse_allgather_whole_dense_and_ratio_one_are_bitwise(lib, ratio):
    """topk_dense (the always-dense tensors sent whole) and ratio 1 (every element sent: the
    device skips the sorts)."""
    lay = sc.Layout(FUSED_SHAPES, "float32", dense_threshold=50)
    steps = _inputs(np.random.default_rng(7), lay, 2, 3, "zeros")
    got = _exchange_ranks(2, lay, ratio, None, steps, lib, fused=False, whole_dense=True)
    _check_against_reference(got, lay, ratio, None, steps, whole_dense=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("bad", [np.nan, np.inf, 7e4])
def test_sparse_allgather_non_finite_on_one_rank_changes_nothing_anywhere(lib, bad):
    """NaN/Inf in one rank's input at step 1 (7e4: finite, but Inf in the float16 payload): every
    rank raises NonFiniteError naming that rank, no error buffer changes, and the next exchange
    is bitwise the reference's (which never saw the failed step)."""
    P, R = 3, 1
    lay = sc.Layout(FUSED_SHAPES, "float32", dense_threshold=50)
    steps = _inputs(np.random.default_rng(11), lay, P, 3, "normal")
    with np.errstate(over="ignore"):
        got = _exchange_ranks(P, lay, 0.1, "float16", steps, lib, fused=False, bad=(1, R, 20000, bad))
    for r in range(P):
        (_, err), res = got[r][1]
        assert isinstance(err, sc.NonFiniteError) and err.ranks == (R,), err
        assert _bits(res) == _bits(got[r][0][1]), f"rank {r}: the failed exchange changed the error buffer"
    ok = [steps[0], steps[2]]
    _check_against_reference([[g[0], g[2]] for g in got], lay, 0.1, "float16", ok)


def test_sparse_allgather_nan_before_the_first_exchange_leaves_no_residual(lib):
    lay = sc.Layout(FUSED_SHAPES, "float32", dense_threshold=50)
    steps = _inputs(np.random.default_rng(12), lay, 2, 2, "normal")
    got = _exchange_ranks(2, lay, 0.1, None, steps, lib, fused=True, bad=(0, 0, 3, np.nan))
    for r in range(2):
        (_, err), res = got[r][0]
        assert isinstance(err, sc.NonFiniteError) and err.ranks == (0,) and res is None
    _check_against_reference([[g[1]] for g in got], lay, 0.1, None, [steps[1]])


class _Twin:
    """Rank 0 of 2 in one process: the other rank sends exactly what this one does (a gathered
    buffer holds this rank's block twice); as an NCCL call, every collective counts one launch."""

    rank, size, name = 0, 2, "twin"

    def allgather(self, sendbuf, recvbuf):
        strict_cupy.launches["collective.allgather"] += 1
        s, r = _raw(sendbuf).reshape(-1), _raw(recvbuf).reshape(-1)
        r[: s.size] = s
        r[s.size :] = s

    def alltoall(self, sendbuf, recvbuf):
        strict_cupy.launches["collective.alltoall"] += 1
        s, r = _raw(sendbuf).reshape(-1), _raw(recvbuf).reshape(-1)
        n = s.size // 2
        r[:n] = s[:n]
        r[n:] = s[:n]

    def allreduce(self, buf):
        strict_cupy.launches["collective.allreduce"] += 1
        _raw(buf)[...] *= 2

    def broadcast(self, buf, root=0):
        pass

    def barrier(self):
        pass


def _count_calls(cp, tensors, what, vdt, P, fused, n=40):
    """Device operations, host-to-device copies and host reads of the 3rd call (two before it)."""
    lay = sc.Layout([(1, n)] * tensors, "float32", dense_threshold=0)
    rng = np.random.default_rng(tensors)
    comm = sc.Communicator(sc.LocalTransport() if P == 1 else _Twin(), lay, ratio=0.1, value_dtype=vdt, seed=1)
    op = comm.sparse_allgather if what == "topk" else comm.onebit_allreduce

    def arg():
        x = (rng.standard_normal(lay.total) * 0.1).astype(np.float32)
        return cp.asarray(x) if fused else [cp.asarray(v.reshape(1, n)) for v in lay.flat_views(x)]

    first = arg()
    with strict_cupy.counting() as c1:
        op(first)
    op(arg())
    x = arg()
    with strict_cupy.counting() as c:
        op(x)
    return c1, c


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("vdt", ["float32", "float16"])
@pytest.mark.parametrize("fused", [False, True])
def test_sparse_allgather_device_operations_do_not_grow_with_the_tensors(P, vdt, fused):
    """On the strict double: the same 8 device operations at 10, 100 and 1,000 tensors (the
    payload's zeros, the selection's 4 kernels, the allgather, the status words' copy, the
    decode); no host-to-device copy (one at the first call: the tables, a list's addresses with
    them) for a fused buffer or a list at the same addresses, and at most one, of the addresses,
    for a list of new arrays; one host read. (Issue 21: 212 / 2,012 before, for 10 / 100 tensors;
    issue 33: 62 to 67, with two sorts of the whole buffer.)"""

    def stable_list(cp, tensors, n=40):  # the 3rd call on arrays the first two used, new values in place
        lay = sc.Layout([(1, n)] * tensors, "float32", dense_threshold=0)
        rng = np.random.default_rng(tensors)
        comm = sc.Communicator(sc.LocalTransport() if P == 1 else _Twin(), lay, ratio=0.1, value_dtype=vdt, seed=1)
        arrays = [cp.zeros((1, n), np.float32) for _ in range(tensors)]
        counted = []
        for _ in range(3):
            for a, v in zip(arrays, lay.flat_views((rng.standard_normal(lay.total) * 0.1).astype(np.float32))):
                a[...] = cp.asarray(v.reshape(1, n))
            with strict_cupy.counting() as c:
                comm.sparse_allgather(arrays)
            counted.append(c)
        return counted[0], counted[-1]

    with strict_cupy.install() as cp:
        strict_cupy.Device.current = 0
        counted = {t: _count_calls(cp, t, "topk", vdt, P, fused) for t in (10, 100, 1000)}
        stable = {t: stable_list(cp, t) for t in (10, 100, 1000)} if not fused else counted
    launches = [c.launches for _, c in [*counted.values(), *stable.values()]]
    assert set(launches) == {8}, (launches, counted[1000][1].by_op)
    assert all(c.h2d == 0 and c.syncs == 1 for _, c in stable.values()), stable
    assert all(c.h2d <= (0 if fused else 1) and c.syncs == 1 for _, c in counted.values()), counted
    assert all(c1.h2d == 1 and c1.syncs == 1 for c1, _ in [*counted.values(), *stable.values()]), counted


def test_a_layout_refuses_names_and_dense_threshold_beside_it():
    """With a Layout, the names and the dense threshold are the Layout's: given again beside it,
    they would be ignored, so the communicator refuses them and says where they go."""
    lay = sc.Layout([(10, 10), (5,)], names=["w", "b"], dense_threshold=50)
    for kw in ({"names": ["a", "b"]}, {"dense_threshold": 10}):
        with pytest.raises(sc.ConfigError, match="belong to the Layout"):
            sc.Communicator(None, lay, **kw)
    comm = sc.Communicator(None, lay)
    assert comm.layout.names == ["w", "b"] and comm.layout.dense_threshold == 50
