"""Single-process tests of Communicator(None, ...): semantics at P = 1, input validation,
non-finite handling, statistics (ALGORITHM.md section 4) and DLPack in-place updates."""

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
    """Reference of ALGORITHM.md section 2, one rank: the decoded top-k of c, per tensor."""
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
        ref = sc.masks.make_mask(mask, comm.layout, 0.1, comm.seed)
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
        assert t.payload_bytes == ok.stats.last.payload_bytes  # the bytes a successful call sends

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
        from slamb_comm.stats import allgather_wire, allreduce_wire

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
    comm.sync(lazy, written=lazy.written, finite=True)
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
    default every tensor sends its k_elems (ALGORITHM.md section 2)."""
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
