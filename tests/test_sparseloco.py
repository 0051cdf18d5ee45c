"""SparseLoCo, the shared-mask and the shared-top-k SparseLoCo in one process (docs/algorithm.md section 14): the
bit packing, the chunk-wise top-k and the quantizer against their definitions, exact decoding
where nothing is lost, the rules at P = 1 against the inner optimizer, state round trips, bytes,
errors, and the CuPy branch on the strict double. Every step against the dense float64 reference at 1, 2 and 4 ranks:
mpi_tests/test_sparseloco.py."""

import copy
import math

import numpy as np
import pytest

import slamb_comm as sc
from slamb_comm.wire.chunk_topk import ChunkTopK, pack_bits, unpack_bits
from slamb_comm.methods.sparseloco import SharedMaskSparseLoCo, SharedTopKSparseLoCo, SparseLoCo

from tests.support.adamw_reference import Adam  # noqa: E402

SHAPES = [(20, 15), (15,), (4, 9)]
N = sum(int(np.prod(s)) for s in SHAPES)


def params(seed=0, dtype=np.float64, positive=False):
    rng = np.random.default_rng(seed)
    out = [rng.standard_normal(s) for s in SHAPES]
    if positive:  # far from zero: x - (x - x') is x' exactly (Sterbenz), for the bitwise checks
        out = [1.0 + np.abs(a) for a in out]
    return [a.astype(dtype) for a in out]


def grads(t, xs):
    rng = np.random.default_rng([3, t])
    return [0.5 * x.astype(np.float64) + rng.standard_normal(x.shape) for x in xs]


# ----------------------------------------------------------------------------- the wire format
@pytest.mark.parametrize("width", [1, 3, 8, 14, 20, 44, 52])
def test_pack_bits_writes_the_defined_little_endian_stream(width):
    rng = np.random.default_rng(width)
    n = 37
    fields = rng.integers(0, 2**width, n, dtype=np.uint64)
    out = np.zeros(-(-n * width // 8) + 3, np.uint8)
    pack_bits(fields, width, out)
    want = np.zeros_like(out)
    for j, f in enumerate(fields.tolist()):  # field j at stream bits [j w, (j+1) w), least significant first
        for b in range(width):
            if (f >> b) & 1:
                pos = j * width + b
                want[pos // 8] |= 1 << (pos % 8)
    assert np.array_equal(out, want)
    assert np.array_equal(unpack_bits(out, width, n), fields)
    rows = np.stack([out, out[::-1].copy()])  # several payloads at once: row by row
    assert np.array_equal(unpack_bits(rows, width, n)[0], fields)


@pytest.mark.parametrize("total,s,k,bits", [(351, 64, 4, 2), (4096 * 3, 4096, 64, 2), (470784, 4096, 64, 2),
                                            (10, 64, 64, 8), (1000, 100, 3, 32), (5, 2, 1, 4)])
def test_chunk_geometry_and_payload_size_follow_the_definition(total, s, k, bits):
    c = ChunkTopK(total, s, k, bits)
    n_chunks = math.ceil(total / s)
    last = total - (n_chunks - 1) * s
    k_last = min(last, math.ceil(k * last / s))
    K = (n_chunks - 1) * k + k_last
    width = math.ceil(math.log2(s)) + bits
    pad8 = lambda n: -(-n // 8) * 8  # noqa: E731
    nbytes = 8 + (0 if bits == 32 else pad8(4 * n_chunks)) + pad8(math.ceil(K * width / 8))
    assert (c.n_chunks, c.last, c.k_last, c.K, c.width, c.nbytes) == (n_chunks, last, k_last, K, width, nbytes)
    assert np.array_equal(np.bincount(c.entry_chunk, minlength=n_chunks), [k] * (n_chunks - 1) + [k_last])
    if (total, s, k, bits) == (470784, 4096, 64, 2):  # the example LM at the defaults (docs/algorithm.md s. 14)
        assert (K, width, nbytes) == (7356, 14, 13352)
        assert round(nbytes / (4 * total), 5) == 0.00709


@pytest.mark.parametrize("total,s,k", [(351, 64, 4), (500, 100, 100), (129, 64, 7), (64, 64, 1)])
def test_select_keeps_each_chunks_largest_magnitudes(total, s, k):
    e = np.random.default_rng(total).standard_normal(total)
    c = ChunkTopK(total, s, k, 2)
    offs, vals = c.select(e)
    pos = c.entry_chunk * s + offs
    assert np.array_equal(vals, e[pos])
    for ch, lo in enumerate(range(0, total, s)):
        seg = e[lo : lo + s]
        kc = min(seg.size, math.ceil(k * seg.size / s))
        want = set((lo + np.argsort(-np.abs(seg))[:kc]).tolist())
        assert set(pos[c.entry_chunk == ch].tolist()) == want
        assert np.all(offs[c.entry_chunk == ch] < s)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantizer_matches_its_definition_value_by_value(bits, dtype):
    c = ChunkTopK(64 * 5, 64, 16, bits)
    vals = (np.random.default_rng(bits).standard_normal(c.K) * 3).astype(dtype)
    vals[:16] = 0.0  # a chunk of zeros: scale 0, decodes to 0
    vals[20] = 0.0  # a zero among non-zeros: the smallest positive magnitude
    scales = c.scales(vals)
    codes = c.quantize(vals, scales)
    got = c.dequantize(codes, scales, np.dtype(dtype))
    M = 2 ** (bits - 1)
    for i, v in enumerate(vals.tolist()):
        ch = i // 16
        a = float(np.float32(max(abs(float(u)) for u in vals[ch * 16 : ch * 16 + 16])))
        assert scales[ch] == np.float32(a)
        if a == 0:
            assert got[i] == 0
            continue
        j = min(max(round(abs(v) / a * M), 1), M)  # Python's round: half to even, as rint
        assert int(codes[i]) == (int(v < 0) << (bits - 1)) | (j - 1)
        want = (-1.0 if v < 0 else 1.0) * (a * j) / M
        assert abs(float(got[i]) - want) <= 4 * np.finfo(dtype).eps * abs(want)
    a = scales[c.entry_chunk].astype(np.float64)
    err, v = np.abs(got.astype(np.float64) - vals), np.abs(vals.astype(np.float64))
    assert np.all(np.where(v >= a / M, err <= a / (2 * M) * (1 + 1e-6), err <= a / M))  # half a level; or below it


@pytest.mark.parametrize("bits", [2, 8, 32])
def test_exact_decoding_where_nothing_is_lost(bits):
    """Everything on the grid (or float32 values at bits = 32) and k = s: every rank decodes e exactly."""
    s, total = 16, 40
    c = ChunkTopK(total, s, s, bits)
    rng = np.random.default_rng(bits)
    if bits == 32:
        e = rng.standard_normal(total).astype(np.float32).astype(np.float64)
    else:
        M = 2 ** (bits - 1)
        e = rng.choice([-1.0, 1.0], total) * rng.integers(1, M + 1, total) * (2.0**-3 / M) * 3
        e[::s] = 3 * 2.0**-3  # every chunk holds its scale a = 3/8 (exact in float32)
    buf = np.zeros(c.nbytes, np.uint8)
    pos, sent, ok = c.encode(e, buf)
    assert ok and c.K == total and np.array_equal(np.sort(pos), np.arange(total))
    assert np.array_equal(sent, e[pos])  # nothing rounded: the error feedback keeps nothing
    mean = c.mean(np.stack([buf, buf]), np.float64)
    assert np.array_equal(mean, e)


def test_decode_of_the_payload_is_what_encode_kept():
    c = ChunkTopK(1000, 128, 5, 4)
    e = np.random.default_rng(1).standard_normal(1000)
    buf = np.zeros(c.nbytes, np.uint8)
    pos, sent, _ = c.encode(e, buf)
    assert c.parts(buf)[0][0] == 0 and not buf[4:8].any()  # status word 0, then four zero bytes
    p2, v2 = c.decode(buf, np.float64)
    assert np.array_equal(p2, pos) and np.array_equal(v2, sent)
    dense = np.zeros(1000)
    dense[pos] = sent
    assert np.array_equal(c.mean(buf[None], np.float64), dense)


# ----------------------------------------------------------------------------- the rules at P = 1
@pytest.mark.parametrize("fused", [False, True])
def test_sparseloco_sending_everything_is_the_inner_optimizer_bitwise(fused):
    """beta 0, outer_lr 1, k = s, float32 values of float32 arrays: the anchor becomes x exactly."""
    x, alone = params(dtype=np.float32, positive=True), params(dtype=np.float32, positive=True)
    if fused:
        flat = np.concatenate([a.ravel() for a in x])
        x = sc.Layout(SHAPES, np.float32).views(flat)
    d = SparseLoCo(None, flat if fused else x, sync_interval=1, outer_lr=1.0, beta=0.0, chunk=64, topk=64, bits=32)
    opt, ref = Adam(x, lr=1e-3), Adam(alone, lr=1e-3)
    for t in range(1, 6):
        opt.step(x, grads(t, x))
        ref.step(alone, grads(t, alone))
        assert d.step(flat if fused else x)
        for a, b in zip(x, alone):
            assert np.array_equal(a, b), t
        assert not d.error.any()


@pytest.mark.parametrize("variant", ["mask", "shared_topk"])
def test_shared_variants_sending_everything_are_the_inner_optimizer_bitwise(variant):
    """The cyclic mask at ratio 1 and the shared top-k with topk = chunk send every entry: alone,
    AdamW's steps bitwise. Payload: N + 1 float64 values (and the 6-bit offsets' 264 bytes)."""
    x, alone = params(positive=True), params(positive=True)
    d = SharedMaskSparseLoCo(None, x, sync_interval=1, beta=0.0, ratio=1.0, value_dtype=None) if variant == "mask" \
        else SharedTopKSparseLoCo(None, x, sync_interval=1, beta=0.0, chunk=64, topk=64, value_dtype=None)
    index_bytes = 0 if variant == "mask" else 8 + 264
    opt, ref = Adam(x, lr=1e-3), Adam(alone, lr=1e-3)
    for t in range(1, 6):
        opt.step(x, grads(t, x))
        ref.step(alone, grads(t, alone))
        assert d.step(x)
        for a, b in zip(x, alone):
            assert np.array_equal(a, b), t
        assert not d.error.any()
        assert d.stats.last.payload_bytes == index_bytes + (N + 1) * 8


def test_shared_topk_sends_the_chunks_largest_and_keeps_the_rest():
    """At P = 1 the leader is this rank: its own chunk-wise top-k of the accumulator, rounded to
    float16, leave e; the rounding stays in e."""
    x = params()
    d = SharedTopKSparseLoCo(None, x, sync_interval=1, beta=0.5, chunk=64, topk=3)
    a0 = d.anchor.copy()
    rng = np.random.default_rng(6)
    for a in x:
        a += rng.standard_normal(a.shape)
    drift = a0 - np.concatenate([a.ravel() for a in x])
    assert d.step(x) and d.leader(1) == 0
    sent = np.zeros(N)
    for lo in range(0, N, 64):
        seg = drift[lo : lo + 64]
        keep = lo + np.argsort(-np.abs(seg))[: -(-3 * seg.size // 64)]
        sent[keep] = drift[keep].astype(np.float16)
    assert np.count_nonzero(sent) == 5 * 3 + 2
    assert np.array_equal(d.error, drift - sent) and np.array_equal(d.anchor, a0 - sent)


def test_unsent_drift_stays_in_the_error_and_x_returns_to_the_anchor():
    x = params(dtype=np.float32)  # float32 arrays and values: nothing is rounded on the wire
    d = SparseLoCo(None, x, sync_interval=2, beta=0.5, outer_lr=1.0, chunk=64, topk=2, bits=32)
    a0 = d.anchor.copy()
    rng = np.random.default_rng(5)
    for a in x:
        a += rng.standard_normal(a.shape).astype(np.float32)
    drift = a0 - np.concatenate([a.ravel() for a in x])
    assert not d.step(x)  # an inner step: nothing moves, nothing is sent
    assert d.stats.step.calls == 0 and np.array_equal(d.anchor, a0)
    assert d.step(x)
    sent = np.zeros(N, np.float32)
    for lo in range(0, N, 64):  # each chunk's ceil(2 L / 64) largest |drift|
        seg = drift[lo : lo + 64]
        keep = lo + np.argsort(-np.abs(seg))[: -(-2 * seg.size // 64)]
        sent[keep] = drift[keep]
    assert np.count_nonzero(sent) == 5 * 2 + 1
    assert np.array_equal(d.error, drift - sent)
    assert np.array_equal(d.anchor, a0 - sent) and np.array_equal(np.concatenate([a.ravel() for a in x]), d.anchor)


# ----------------------------------------------------------------------------- state and bytes
@pytest.mark.parametrize("make", [lambda x: SparseLoCo(None, x, sync_interval=3, chunk=64, topk=4),
                                  lambda x: SharedMaskSparseLoCo(None, x, sync_interval=2, ratio=0.2,
                                                                 dense_threshold=0),
                                  lambda x: SharedTopKSparseLoCo(None, x, sync_interval=2, chunk=64, topk=4)])
def test_core_state_dict_round_trip_is_bitwise(make):
    def run(d, x, opt, ts):
        for t in ts:
            opt.step(x, grads(t, x))
            d.step(x)

    x = params()
    opt = Adam(x)
    d = make(x)
    run(d, x, opt, range(1, 8))
    saved, saved_x, saved_opt = copy.deepcopy(d.state_dict()), copy.deepcopy(x), copy.deepcopy(opt)
    assert saved["error"].any() and saved["kind"] == d.kind
    run(d, x, opt, range(8, 15))
    x2 = saved_x
    d2 = make(x2)
    d2.load_state_dict(saved)
    assert d2.t == 7
    run(d2, x2, saved_opt, range(8, 15))
    for a, b in zip(x, x2):
        assert np.array_equal(a, b)
    assert np.array_equal(d.anchor, d2.anchor) and np.array_equal(d.error, d2.error)


def test_bytes_per_outer_step():
    x = params()
    d = SparseLoCo(None, x, sync_interval=2, chunk=64, topk=4, bits=2)
    d.step(x)
    assert d.stats.step.calls == 0
    d.step(x)
    tr = d.stats.new_step()
    assert (tr.calls, tr.payload_bytes, tr.dense_payload_bytes, tr.elements_sent) == (1, 56, N * 8, 22)
    assert d.stats.by_kind["sparseloco_allgather"].payload_bytes == 56
    s = SharedMaskSparseLoCo(None, x, sync_interval=1, ratio=0.25)  # default 9000: every tensor here is dense
    s.step(x)
    assert (s.stats.last.payload_bytes, s.stats.last.elements_sent) == ((N + 1) * 2, N)
    s = SharedMaskSparseLoCo(None, x, sync_interval=1, ratio=0.25, dense_threshold=0)
    for _ in range(4):  # C = 4 steps cover every element of the matrices once, the vector every time
        s.step(x)
    counts = [s.stats.by_kind["sparseloco_allreduce"].elements_sent]
    assert counts == [4 * 15 + 300 + 36]


def test_defaults():
    d = SparseLoCo(None, params())
    assert (d.sync_interval, d.outer_lr, d.beta, d.codec.s, d.codec.k, d.codec.bits) == (50, 1.0, 0.95, 4096, 64, 2)
    s = SharedMaskSparseLoCo(None, params())
    assert (s.ratio, s.value_dtype.name, s.seed, s.dense_threshold, s.comm.mask.num_chunks) == (1 / 64, "float16", 0,
                                                                                                9000, 64)
    s = SharedTopKSparseLoCo(None, params())
    assert (s.sync_interval, s.beta, s.codec.s, s.codec.k, s.value_dtype.name) == (50, 0.95, 4096, 64, "float16")


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_option_and_the_fix():
    x = params()
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8, 32\).*got 3"):
        SparseLoCo(None, x, bits=3)
    with pytest.raises(ValueError, match=r"topk must be an integer in \[1, 64\], got 65.*1-3%"):
        SparseLoCo(None, x, chunk=64, topk=65)
    with pytest.raises(ValueError, match=r"chunk must be an integer in \[2, "):
        SparseLoCo(None, x, chunk=1, topk=1)
    with pytest.raises(ValueError, match=r"beta must be a number in \[0, 1\], got 1.5"):
        SparseLoCo(None, x, beta=1.5)
    with pytest.raises(ValueError, match=r"outer_lr must be a finite number > 0"):
        SharedMaskSparseLoCo(None, x, outer_lr=0)
    with pytest.raises(ValueError, match=r"sync_interval must be an integer >= 1.*15 to 250"):
        SparseLoCo(None, x, sync_interval=0)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        SharedMaskSparseLoCo(None, x, ratio=0)
    with pytest.raises(TypeError, match="bfloat16"):
        SharedMaskSparseLoCo(None, x, value_dtype="bfloat16")
    with pytest.raises(TypeError, match="bfloat16"):
        SharedTopKSparseLoCo(None, x, value_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"topk must be an integer in \[1, 64\], got 0"):
        SharedTopKSparseLoCo(None, x, chunk=64, topk=0)
    with pytest.raises(TypeError, match="float32 copy of 16-bit"):
        SparseLoCo(None, [a.astype(np.float16) for a in x])
    d = SparseLoCo(None, x, sync_interval=1, chunk=64, topk=4)
    with pytest.raises(sc.LayoutError, match="got 2 arrays, SparseLoCo was built for 3"):
        d.step(x[:2])
    with pytest.raises(sc.ConfigError, match="outer step: pass x to step"):
        d.step(None)
    s = SharedMaskSparseLoCo(None, x)
    with pytest.raises(sc.ConfigError, match="saved by 'SharedMaskSparseLoCo'"):
        d.load_state_dict(s.state_dict())
    bad = d.state_dict()
    bad["error"] = bad["error"][:-1]
    with pytest.raises(sc.LayoutMismatchError, match="saved error is float64\\[350\\]"):
        d.load_state_dict(bad)


@pytest.mark.parametrize("variant", ["topk", "mask", "shared_topk"])
def test_nonfinite_changes_nothing(variant):
    x = params()
    d = {"mask": lambda: SharedMaskSparseLoCo(None, x, sync_interval=1, ratio=0.5),
         "topk": lambda: SparseLoCo(None, x, sync_interval=1, chunk=64, topk=4),
         "shared_topk": lambda: SharedTopKSparseLoCo(None, x, sync_interval=1, chunk=64, topk=4)}[variant]()
    x[0][0, 0] += 1.0
    d.step(x)
    anchor, error = d.anchor.copy(), d.error.copy()
    x[2][1, 1] = np.inf
    with pytest.raises(sc.NonFiniteError):
        d.step(x)
    assert np.array_equal(d.anchor, anchor) and np.array_equal(d.error, error) and x[2][1, 1] == np.inf
    x[2][1, 1] = 1e300  # finite, but a float32 scale (or a float16 value) overflows
    with pytest.raises(sc.NonFiniteError):
        d.step(x)
    assert np.array_equal(d.anchor, anchor) and np.array_equal(d.error, error)


# ----------------------------------------------------------------------------- torch adapter
torch = pytest.importorskip("torch")
import slamb_comm.adapters.torch as tsl  # noqa: E402


def tparams(dtype=torch.float64, positive=False):
    return [torch.nn.Parameter(torch.from_numpy(a).to(dtype)) for a in params(positive=positive)]


def set_grads(ps, t):
    for p, g in zip(ps, grads(t, [p.detach().double().numpy() for p in ps])):
        p.grad = torch.from_numpy(g).to(p.dtype)


def test_torch_sending_everything_is_adamw_bitwise():
    ps, alone = tparams(torch.float32, positive=True), tparams(torch.float32, positive=True)
    opt = tsl.SparseLoCo(torch.optim.AdamW(ps, lr=1e-3), sync_interval=1, beta=0.0, chunk=64, topk=64, bits=32)
    ref = torch.optim.AdamW(alone, lr=1e-3)
    for t in range(1, 5):
        set_grads(ps, t)
        set_grads(alone, t)
        opt.step()
        ref.step()
        for a, b in zip(ps, alone):
            assert torch.equal(a, b)
        assert opt.step_traffic().payload_bytes == opt.cores[0].codec.nbytes


def test_torch_16bit_parameters_and_state_round_trip():
    def run(opt, ps, ts):
        for t in ts:
            set_grads(ps, t)
            opt.step()

    for make in (lambda ps: tsl.SparseLoCo(torch.optim.AdamW(ps, lr=0.01), sync_interval=2, chunk=64, topk=8),
                 lambda ps: tsl.SharedMaskSparseLoCo(torch.optim.AdamW(ps, lr=0.01), sync_interval=2, ratio=0.5,
                                                     dense_threshold=0),
                 lambda ps: tsl.SharedTopKSparseLoCo(torch.optim.AdamW(ps, lr=0.01), sync_interval=2, chunk=64,
                                                     topk=8)):
        ps = tparams(torch.bfloat16)
        opt = make(ps)
        run(opt, ps, range(1, 7))  # ends on an outer step: x is the anchor
        core = opt.cores[0]
        assert core.anchor.dtype == np.float32 and all(p.dtype == torch.bfloat16 for p in ps)
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in ps]), torch.from_numpy(core.anchor).bfloat16())
        saved, saved_ps = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in ps]
        assert saved["periodic"]["method"] == type(opt).__name__ and "error" in saved["periodic"]["buckets"][0]
        run(opt, ps, range(7, 12))
        ps2 = [torch.nn.Parameter(p) for p in saved_ps]
        opt2 = make(ps2)
        opt2.load_state_dict(saved)
        run(opt2, ps2, range(7, 12))
        for a, b in zip(ps, ps2):
            assert torch.equal(a, b)
        assert np.array_equal(opt.cores[0].error, opt2.cores[0].error)


def test_torch_errors():
    ps = tparams()
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        tsl.SparseLoCo(ps)
    with pytest.raises(ValueError, match="bits must be one of"):
        tsl.SparseLoCo(torch.optim.AdamW(ps), bits=1)
    opt = tsl.SharedMaskSparseLoCo(torch.optim.AdamW(ps))
    with pytest.raises(ValueError, match="one saved by SparseLoCo"):
        opt.load_state_dict(tsl.SparseLoCo(torch.optim.AdamW(ps)).state_dict())


# ----------------------------------------------------------------------------- the CuPy branch (strict double)
from tests.support import strict_cupy  # noqa: E402


@pytest.mark.parametrize("variant,reads", [("topk", 1), ("mask", 1), ("shared_topk", 2)])
def test_cupy_branch_equals_numpy_with_its_host_reads(variant, reads):
    """Every variant on device arrays (the strict CuPy double) gives NumPy's bits, with one host
    read per outer step (two for the shared top-k: the leader's status word, then the allreduce's)
    and none between outer steps."""
    def make(x):
        return {"topk": lambda: SparseLoCo(None, x, sync_interval=2, chunk=64, topk=4),
                "mask": lambda: SharedMaskSparseLoCo(None, x, sync_interval=2, ratio=0.25, dense_threshold=0),
                "shared_topk": lambda: SharedTopKSparseLoCo(None, x, sync_interval=2, chunk=64, topk=4)}[variant]()

    x = params(dtype=np.float32)
    d = make(x)
    with strict_cupy.install() as cp:
        strict_cupy.Device.current = 0
        xd = [cp.asarray(a) for a in params(dtype=np.float32)]
        dd = make(xd)
        for t in range(1, 7):
            g = grads(t, x)
            for a, b, gi in zip(x, xd, g):
                a -= np.float32(0.01) * gi.astype(np.float32)
                b -= cp.asarray(np.float32(0.01) * gi.astype(np.float32))
            d.step(x)
            strict_cupy.reset_syncs()
            dd.step(xd)
            assert strict_cupy.total_syncs() == (reads if t % 2 == 0 else 0), dict(strict_cupy.syncs)
            for a, b in zip(x, xd):
                assert np.array_equal(a, b.get()), t
        assert isinstance(dd.error, cp.ndarray) and np.array_equal(d.error, dd.error.get())
