"""Communicator over MPI (pytest-mpi), against the dense references of docs/algorithm.md
sections 1, 2, 3 and 4.

Run:  bash scripts/mpirun.sh 4 600 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_communicator.py

Every rank builds EVERY rank's inputs from fixed seeds, so it can compute the dense,
single-process reference itself and compare its own result with it.

Failures are collected with :class:`Checks` and raised only at the end of a test, after
every collective of the test has run, and on every rank at once (the failures are
allgathered): a wrong value on one rank can never leave the others waiting in a
collective.
"""

import hashlib
import math

import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from tests.support.mpi_checks import Checks, call
from slamb_comm.wire.masks import make_mask
from slamb_comm.errors import (
    ConfigError,
    DTypeError,
    LayoutError,
    LayoutMismatchError,
    NonContiguousError,
    NonFiniteError,
    PeerError,
)

WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank
BAD = P - 1  # the rank that misbehaves in the failure tests

SHAPES = [(100, 120), (50,), (100, 120)]  # two compressible 2-D tensors, one always-dense 1-D
NAMES = ["w1", "b", "w2"]
TOTAL = 24050
B_AT = 12000  # offset of the dense tensor 'b'
U16 = 2.0**-11  # unit round-off of float16


# --------------------------------------------------------------------------- helpers
def rank_arrays(r, step, dtype=np.float32, base=1000):
    rng = np.random.default_rng([base + r, step])
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def flat_of(arrays):
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


def all_flats(step, dtype=np.float32, base=1000):
    """Every rank's fused input at this step, float64 copies for references."""
    return [flat_of(rank_arrays(r, step, dtype, base)) for r in range(P)]


def dense_mean(flats):
    acc = np.zeros(flats[0].size, np.float64)
    for f in flats:
        acc += f.astype(np.float64)
    return acc / P


def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def same_on_every_rank(a):
    return len(set(WORLD.allgather(digest(a)))) == 1


def ref_topk(c, layout, ratio, vdt):
    """One rank's decoded top-k payload (docs/algorithm.md section 2), per tensor, values rounded to vdt."""
    sent = np.zeros_like(c)
    for o, n in layout.segments():
        seg = c[o : o + n]
        k = sc.k_elems(ratio, n)
        sel = np.argsort(-np.abs(seg.astype(np.float64)), kind="stable")[:k]
        sent[o + sel] = seg[sel].astype(vdt).astype(c.dtype)
    return sent


def ref_topk_union(flats, layout, ratio):
    picks = [layout.dense_index.astype(np.int64)]
    for f in flats:
        for (o, n), d in zip(layout.segments(), layout.dense):
            if not d:
                picks.append(o + np.argsort(-np.abs(f[o : o + n]))[: sc.k_elems(ratio, n)])
    return np.unique(np.concatenate(picks))


@pytest.fixture(scope="module")
def transport():
    return sc.MPITransport()


def make_comm(transport, arrays=None, **kw):
    kw.setdefault("names", NAMES)
    kw.setdefault("seed", 77)
    return sc.Communicator(transport, arrays if arrays is not None else rank_arrays(ME, 0), **kw)


# --------------------------------------------------------------------------- masked allreduce
@pytest.mark.mpi
@pytest.mark.parametrize("mask", ["cyclic", "bernoulli", "topk"])
def test_masked_allreduce_matches_dense_reference(transport, mask):
    ck = Checks()
    ratio = 0.1
    comm = make_comm(transport, mask=mask, ratio=ratio, seed=500 + ME)  # rank 0's seed wins
    ck.true(comm.seed == 500, f"seed {comm.seed} is not rank 0's (500)")
    lay = comm.layout
    steps = (1, 2, 3, 11) if mask == "cyclic" else (1, 2, 3)
    for step in steps:
        flats = all_flats(step)
        mine = rank_arrays(ME, step)
        fused = step % 2 == 0  # alternate list and fused inputs
        x = flat_of(mine) if fused else mine
        _, idx = comm.masked_allreduce(x, step)
        got = x if fused else flat_of(x)
        idx = np.asarray(idx, np.int64)
        # the mask: the shared one, identical on every rank
        if mask == "topk":
            want_idx = ref_topk_union(flats, lay, ratio)
        else:
            want_idx = np.asarray(make_mask(mask, lay, ratio, 500).select(step), np.int64)
        ck.equal(np.sort(idx), np.sort(want_idx), f"{mask} step {step}: M_t")
        ck.true(np.unique(idx).size == idx.size, f"{mask} step {step}: duplicate positions")
        ck.true(np.all(np.isin(np.arange(B_AT, B_AT + 50), idx)), f"{mask} step {step}: dense tensor not in M_t")
        ck.true(same_on_every_rank(idx), f"{mask} step {step}: mask differs across ranks")
        inm = np.zeros(TOTAL, bool)
        inm[idx] = True
        ref = dense_mean(flats)
        ck.close(got[inm], ref[inm], f"{mask} step {step}: values in M_t vs the mean", rtol=1e-5, atol=1e-6)
        ck.equal(got[~inm], flats[ME][~inm], f"{mask} step {step}: values outside M_t changed")
        ck.true(same_on_every_rank(got[idx]), f"{mask} step {step}: values in M_t differ across ranks (bitwise)")
    ck.done()


@pytest.mark.mpi
@pytest.mark.parametrize("mask", ["cyclic", "bernoulli", "topk"])
def test_masked_allreduce_ratio_one_is_dense_mean(transport, mask):
    ck = Checks()
    comm = make_comm(transport, mask=mask, ratio=1.0)
    for step in (1, 2):
        flats = all_flats(10 + step)
        x = rank_arrays(ME, 10 + step)
        _, idx = comm.masked_allreduce(x, step)
        got = flat_of(x)
        ck.equal(np.sort(np.asarray(idx, np.int64)), np.arange(TOTAL), f"{mask}: ratio 1 mask is everything")
        ck.close(got, dense_mean(flats), f"{mask}: ratio 1 vs dense mean", rtol=1e-5, atol=1e-6)
        ck.true(same_on_every_rank(got), f"{mask}: results differ across ranks")
    ck.done()


@pytest.mark.mpi
@pytest.mark.parametrize("mask", ["cyclic", "topk"])
def test_masked_allreduce_fp16_payload(transport, mask):
    ck = Checks()
    comm = make_comm(transport, mask=mask, ratio=0.1, value_dtype="float16")
    for step in (1, 2):
        flats = all_flats(20 + step)
        x = flat_of(rank_arrays(ME, 20 + step))
        _, idx = comm.masked_allreduce(x, step)
        idx = np.asarray(idx, np.int64)
        ref = dense_mean(flats)
        scale = np.max(np.abs(np.stack(flats)), axis=0)  # magnitude of the inputs, per element
        # fp16 rounding of P inputs and P - 1 partial sums, divided by P
        ck.within(x[idx], ref[idx], U16 * P * scale[idx] * 1.01 + 1e-7, f"{mask} step {step}: fp16 mean")
        ck.close(x[idx], ref[idx], f"{mask} step {step}: fp16 rtol", rtol=2e-3, atol=2e-3 * float(scale.max()))
        out = np.ones(TOTAL, bool)
        out[idx] = False
        ck.equal(x[out], flats[ME][out], f"{mask} step {step}: outside M_t changed")
        ck.true(same_on_every_rank(x[idx]), f"{mask} step {step}: fp16 values differ across ranks")
    ck.done()


@pytest.mark.mpi(min_size=2)
def test_masked_allreduce_float16_arrays_float32_payload_no_overflow(transport):
    """A float16 buffer with float32 payloads: the sum may exceed 65504, the mean does not."""
    ck = Checks()
    x = [a.astype(np.float16) for a in rank_arrays(ME, 30)]
    x[1][:] = 40000.0
    comm = make_comm(transport, x, value_dtype="float32")
    _, e = call(comm.masked_allreduce, x, 1)
    ck.true(e is None, f"raised {e!r}")
    ck.equal(x[1], np.full(50, 40000.0, np.float16), "mean of 40000 on every rank")
    ck.done()


# --------------------------------------------------------------------------- sparse allgather
def _sparse_run(transport, ratio, vdt, steps, ck, base=2000):
    comm = make_comm(transport, ratio=ratio, value_dtype=vdt)
    lay = comm.layout
    e = [np.zeros(TOTAL, np.float32) for _ in range(P)]
    sent_total = np.zeros(TOTAL, np.float64)
    g_total = np.zeros(TOTAL, np.float64)
    for step in range(1, steps + 1):
        g = all_flats(step, base=base)
        fused = step % 2 == 1
        mine = g[ME].copy() if fused else rank_arrays(ME, step, base=base)
        out = comm.sparse_allgather(mine)
        out = out if fused else flat_of(out)
        ck.equal(flat_of([mine]) if fused else flat_of(mine), g[ME], f"step {step}: input was modified")
        sents = []
        for r in range(P):
            c = g[r] + e[r]
            s = ref_topk(c, lay, ratio, np.dtype(vdt))
            e[r] = c - s
            sents.append(s)
        mean = np.zeros(TOTAL, np.float32)
        for s in sents:
            mean += s
        mean = mean / np.float32(P) if P > 1 else mean
        ck.close(out, mean, f"{vdt} step {step}: mean of decoded top-k", rtol=1e-6, atol=1e-7)
        ck.close(comm.residual, e[ME], f"{vdt} step {step}: residual", rtol=1e-6, atol=1e-7)
        ck.true(same_on_every_rank(out), f"{vdt} step {step}: result differs across ranks")
        sent_total += sents[ME]
        g_total += g[ME]
        # nothing is lost: everything sent + what is left == everything given
        ck.close(sent_total + comm.residual, g_total, f"{vdt} step {step}: sent + residual != sum of inputs",
                 rtol=1e-5, atol=1e-5)
    return comm


@pytest.mark.mpi
def test_sparse_allgather_error_feedback_matches_reference(transport):
    ck = Checks()
    comm = _sparse_run(transport, 0.1, "float32", 6, ck)
    ck.true(comm.stats.by_kind["sparse_allgather"].calls == 6, "six exchanges recorded")
    ck.done()


@pytest.mark.mpi
def test_sparse_allgather_fp16_payload_matches_fp16_reference(transport):
    ck = Checks()
    _sparse_run(transport, 0.1, "float16", 6, ck)
    ck.done()


@pytest.mark.mpi
def test_sparse_allgather_fp16_within_tolerance_of_fp32(transport):
    ck = Checks()
    c16 = make_comm(transport, ratio=0.1, value_dtype="float16")
    c32 = make_comm(transport, ratio=0.1, value_dtype="float32")
    g = all_flats(1, base=2100)
    o16 = c16.sparse_allgather(g[ME].copy())
    o32 = c32.sparse_allgather(g[ME].copy())
    ref = np.zeros(TOTAL, np.float64)
    scale = np.zeros(TOTAL, np.float64)
    for r in range(P):
        s = ref_topk(g[r], c32.layout, 0.1, np.float32)
        ref += s
        scale = np.maximum(scale, np.abs(s))
    ref /= P
    ck.close(o32, ref, "fp32 payload vs reference", rtol=1e-6, atol=1e-7)
    ck.within(o16, ref, U16 * scale * 1.01 + 1e-6, "fp16 payload vs fp32 reference")
    ck.close(o16, ref, "fp16 rtol", rtol=1e-3, atol=1e-3 * float(scale.max()))
    ck.done()


@pytest.mark.mpi
def test_sparse_allgather_ratio_one_is_dense_mean(transport):
    ck = Checks()
    comm = make_comm(transport, ratio=1.0)
    for step in (1, 2, 3):
        g = all_flats(step, base=2200)
        out = comm.sparse_allgather(rank_arrays(ME, step, base=2200))
        ck.close(flat_of(out), dense_mean(g), f"step {step}: ratio 1 vs dense mean", rtol=1e-6, atol=1e-6)
        ck.true(not np.any(comm.residual), f"step {step}: residual not zero at ratio 1")
        ck.true(same_on_every_rank(flat_of(out)), f"step {step}: result differs across ranks")
    ck.done()


@pytest.mark.mpi(min_size=2)
def test_sparse_allgather_float16_arrays_no_overflow(transport):
    """A float16 buffer: the sum of the ranks' decoded values may exceed 65504, their mean does not."""
    ck = Checks()
    x = [a.astype(np.float16) for a in rank_arrays(ME, 31)]
    x[1][4] = 40000.0  # the largest |value| of 'b': sent by every rank
    comm = make_comm(transport, x, ratio=0.1)
    out, e = call(comm.sparse_allgather, x)
    ck.true(e is None, f"raised {e!r}")
    if e is None:
        ck.true(out[1][4] == 40000.0, f"mean of 40000 on every rank is {out[1][4]}")
        ck.true(np.all(np.isfinite(flat_of(out))), "non-finite result")
    ck.done()


# --------------------------------------------------------------------------- sync
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_sync_is_dense_mean_bitwise_identical(transport, dtype):
    ck = Checks()
    flats = all_flats(3, dtype=dtype, base=3000)
    x = rank_arrays(ME, 3, dtype, base=3000)
    comm = make_comm(transport, x)
    out, e = call(comm.sync, x)
    ck.true(e is None and out is x, f"sync raised {e!r} or returned another object")
    got = flat_of(x)
    ref = dense_mean(flats)
    if dtype == np.float16:
        scale = np.max(np.abs(np.stack(flats).astype(np.float64)), axis=0)
        ck.within(got, ref, U16 * P * scale * 1.01 + 1e-7, "fp16 sync vs mean")
    else:
        tol = 1e-6 if dtype == np.float32 else 1e-13
        ck.close(got, ref, "sync vs dense mean", rtol=tol, atol=tol)
    ck.true(same_on_every_rank(got), "sync result differs across ranks")
    f = flat_of(rank_arrays(ME, 4, dtype, base=3000))
    comm.sync(f)
    ck.true(same_on_every_rank(f), "fused sync differs across ranks")
    ck.done()


# --------------------------------------------------------------------------- bytes
@pytest.mark.mpi
def test_bytes_at_ratio_tenth(transport, capsys):
    ck = Checks()
    c32 = make_comm(transport, ratio=0.1, mask="cyclic", value_dtype="float32")
    c16 = make_comm(transport, ratio=0.1, mask="cyclic", value_dtype="float16")
    dense_elems = 50  # the 1-D tensor 'b'
    comp = TOTAL - dense_elems
    chunks = 10
    ratios = {}
    for step in (1, 2, 10):
        c32.masked_allreduce(rank_arrays(ME, step), step)
        c16.masked_allreduce(rank_arrays(ME, step), step)
        t32, t16 = c32.stats.last, c16.stats.last
        dense = 4 * TOTAL
        ck.true(t32.dense_payload_bytes == dense, f"dense payload {t32.dense_payload_bytes} != {dense}")
        bound32 = 0.1 * dense + 4 * dense_elems + 4 + 4 * 1  # + status + rounding of one element per chunk
        ck.true(t32.payload_bytes <= bound32, f"fp32 payload {t32.payload_bytes} > {bound32}")
        ck.true(t32.payload_bytes == 4 * (math.ceil(comp / chunks) + dense_elems + 1) or
                t32.payload_bytes == 4 * (comp // chunks + dense_elems + 1), f"fp32 payload {t32.payload_bytes}")
        ck.true(t16.payload_bytes <= t32.payload_bytes / 2 + 2, f"fp16 payload {t16.payload_bytes} > half of fp32 + status")
        ck.true(t16.elements_sent == t32.elements_sent, "fp16 and fp32 send the same elements")
        ck.true(abs(t32.wire_bytes - 2 * (P - 1) / P * t32.payload_bytes) < 1e-6, "ring allreduce wire bytes")
        ratios[step] = (t32.ratio, t16.ratio)
    # the sparse allgather: K values and int32 indices, an 8-byte header, indices and values each
    # padded to 8 bytes (every rank's payload then starts aligned in the gathered buffer)
    ca = make_comm(transport, ratio=0.1, value_dtype="float32")
    ca.sparse_allgather(rank_arrays(ME, 1))
    ta = ca.stats.last
    k = 1200 + 5 + 1200
    ck.true(ta.payload_bytes == 8 + math.ceil(4 * k / 8) * 8 + math.ceil(4 * k / 8) * 8,
            f"top-k payload {ta.payload_bytes}")
    ck.true(ta.wire_bytes == (P - 1) * ta.payload_bytes, "allgather wire bytes")
    cs = make_comm(transport)
    cs.sync(rank_arrays(ME, 1))
    ck.true(cs.stats.last.payload_bytes == 4 * (TOTAL + 1), f"sync payload {cs.stats.last.payload_bytes}")
    if ME == 0:
        with capsys.disabled():
            r32, r16 = ratios[1]
            print(f"\n[bytes, P={P}] masked allreduce at ratio 0.1, cyclic: payload/dense = {r32:.4f} (fp32 values), "
                  f"{r16:.4f} (fp16 values); top-k allgather payload/dense = {ta.ratio:.4f} "
                  f"(wire {ta.wire_ratio:.4f} of a dense ring allreduce)")
    ck.done()


# --------------------------------------------------------------------------- failures on one rank
def _good_and_bad(kind, step):
    """This rank's input: good everywhere but on rank BAD, which gets a `kind` of bad input."""
    x = rank_arrays(ME, step, base=4000)
    if ME != BAD:
        return x
    if kind == "shape":
        x[0] = x[0].reshape(120, 100)
    elif kind == "count":
        x = x[:2]
    elif kind == "noncontig":
        x[2] = np.asfortranarray(x[2])
    elif kind == "dtype":
        x[1] = x[1].astype(np.float64)
    elif kind == "intdtype":
        x[1] = x[1].astype(np.int32)
    elif kind == "nan":
        x[1][3] = np.nan  # 'b' is always dense: in every M_t and (largest |c|) in every top-k
    elif kind == "inf":
        x[0][1, 2] = np.inf
    else:
        raise AssertionError(kind)
    return x


EXPECTED = {
    "shape": LayoutError,
    "count": LayoutError,
    "noncontig": NonContiguousError,
    "dtype": LayoutError,
    "intdtype": DTypeError,
}


def _op(comm, name, mask_step=5):
    if name == "masked_allreduce":
        return lambda x: comm.masked_allreduce(x, mask_step)
    return getattr(comm, name)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["masked_allreduce", "sparse_allgather", "sync"])
@pytest.mark.parametrize("kind", ["shape", "count", "noncontig", "dtype", "intdtype", "nan", "inf"])
def test_bad_input_on_one_rank_raises_everywhere(transport, op, kind):
    ck = Checks()
    mask = "topk" if (op == "masked_allreduce" and kind in ("shape", "nan")) else "cyclic"
    comm = make_comm(transport, mask=mask, ratio=1.0 if kind == "inf" else 0.1)
    comm.sparse_allgather(rank_arrays(ME, 1, base=4000))  # a non-zero residual to protect
    comm.masked_allreduce(rank_arrays(ME, 1, base=4000), 1)
    residual = comm.residual.copy()
    stats = (comm.stats.total.calls, comm.stats.total.payload_bytes, comm.stats.last.payload_bytes)
    x = _good_and_bad(kind, 2)
    before = [np.array(a, copy=True) for a in x]
    _, err = call(_op(comm, op), x)
    if kind in ("nan", "inf"):
        ck.raised(err, NonFiniteError, f"{op}/{kind}", ranks=(BAD,))
    elif ME == BAD:
        ck.raised(err, EXPECTED[kind], f"{op}/{kind} on the bad rank")
        ck.true(not isinstance(err, PeerError), f"{op}/{kind}: the bad rank raised PeerError")
    else:
        ck.raised(err, PeerError, f"{op}/{kind} on a good rank", ranks=(BAD,))
        ck.true(err is not None and str(BAD) in str(err), f"{op}/{kind}: message does not name rank {BAD}: {err}")
    # nothing changed
    ck.true(len(x) == len(before), "input list changed length")
    for a, b in zip(x, before):
        ck.equal(a, b, f"{op}/{kind}: input changed")
    ck.equal(comm.residual, residual, f"{op}/{kind}: residual changed")
    # ... but the collective ran: the statistics count it, with the bytes this rank sent
    calls, payload, _ = stats
    sent = comm.stats.last.payload_bytes
    ck.true(comm.stats.total.calls == calls + 1 and comm.stats.total.payload_bytes == payload + sent and sent > 0,
            f"{op}/{kind}: the failed exchange was not counted once ({comm.stats.total.calls} calls after {calls})")
    # and the ranks are still in lockstep: a good exchange works and agrees with the reference
    y = rank_arrays(ME, 3, base=4000)
    _, err2 = call(comm.sync, y)
    ck.true(err2 is None, f"{op}/{kind}: the next exchange raised {err2!r}")
    ck.close(flat_of(y), dense_mean(all_flats(3, base=4000)), f"{op}/{kind}: next sync", rtol=1e-5, atol=1e-6)
    ck.done()


@pytest.mark.mpi
def test_non_finite_message_names_tensor(transport):
    ck = Checks()
    comm = make_comm(transport)
    x = _good_and_bad("nan", 2)
    _, err = call(comm.masked_allreduce, x, 1)
    ck.raised(err, NonFiniteError, "nan in b", ranks=(BAD,))
    ck.true(isinstance(err, NonFiniteError) and err.tensors == ("b",), f"tensors: {getattr(err, 'tensors', None)}")
    ck.done()


@pytest.mark.mpi
def test_bad_step_is_local_config_error(transport):
    ck = Checks()
    comm = make_comm(transport)
    _, err = call(comm.masked_allreduce, rank_arrays(ME, 1), 0)  # every rank passes the same bad step
    ck.raised(err, ConfigError, "step 0")
    ck.done()


# --------------------------------------------------------------------------- construction
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "what",
    ["shape", "order", "count", "dtype", "value_dtype", "ratio", "mask", "dense_threshold", "block"],
)
def test_disagreement_at_construction_is_layout_mismatch_everywhere(transport, what):
    ck = Checks()
    arrs = rank_arrays(ME, 0)
    kw = dict(ratio=0.1, mask="cyclic", value_dtype="float32", dense_threshold=9000)
    if ME == BAD:
        if what == "shape":
            arrs[0] = arrs[0].reshape(120, 100)
        elif what == "order":
            arrs = [arrs[2], arrs[0], arrs[1]]
        elif what == "count":
            arrs = arrs[:2]
        elif what == "dtype":
            arrs = [a.astype(np.float64) for a in arrs]
        elif what == "value_dtype":
            kw["value_dtype"] = "float16"
        elif what == "ratio":
            kw["ratio"] = 0.2
        elif what == "mask":
            kw["mask"] = "bernoulli"
        elif what == "dense_threshold":
            kw["dense_threshold"] = 100
        elif what == "block":
            kw["block"] = 64
    comm, err = call(sc.Communicator, transport, arrs, **kw)
    ck.raised(err, LayoutMismatchError, f"rank {BAD} differs in {what}")
    ck.true(err is None or str(BAD) in str(err), f"message does not name rank {BAD}: {err}")
    ck.done()


@pytest.mark.mpi
@pytest.mark.parametrize(
    "bad,exc",
    [
        (dict(ratio=0.0), ConfigError),
        (dict(ratio=1.5), ConfigError),
        (dict(mask="random"), ConfigError),
        (dict(value_dtype="bfloat16"), DTypeError),
        (dict(value_dtype="int8"), DTypeError),
        (dict(dense_threshold=-1), ConfigError),
        (dict(arrays="int32"), DTypeError),
    ],
)
def test_invalid_option_on_one_rank(transport, bad, exc):
    ck = Checks()
    arrs = rank_arrays(ME, 0)
    kw = dict(ratio=0.1)
    if ME == BAD:
        bad = dict(bad)
        if bad.pop("arrays", None):
            arrs = [a.astype(np.int32) for a in arrs]
        kw.update(bad)
    comm, err = call(sc.Communicator, transport, arrs, **kw)
    if ME == BAD:
        ck.raised(err, exc, f"{bad} on the bad rank")
    else:
        ck.raised(err, PeerError, f"{bad} on a good rank", ranks=(BAD,))
    # a good construction right after still works everywhere
    comm, err = call(sc.Communicator, transport, rank_arrays(ME, 0), ratio=0.1, seed=3)
    ck.true(err is None, f"good construction after a bad one raised {err!r}")
    ck.done()


@pytest.mark.mpi
def test_seed_is_shared(transport):
    ck = Checks()
    a = make_comm(transport, seed=None)
    b = make_comm(transport, seed=10 + ME)
    ck.true(len(set(WORLD.allgather(a.seed))) == 1, "drawn seed differs across ranks")
    ck.true(b.seed == 10, f"seed {b.seed} is not rank 0's")
    for step in (1, 2, 3):
        ck.true(same_on_every_rank(np.asarray(a.mask.select(step))), f"mask of step {step} differs")
    ck.done()


# --------------------------------------------------------------------------- global RNG
@pytest.mark.mpi
def test_global_numpy_rng_untouched(transport):
    ck = Checks()
    np.random.seed(ME + 123)
    before = np.random.get_state()
    for mask in ("cyclic", "bernoulli", "topk"):
        comm = make_comm(transport, mask=mask, seed=None)
        comm.masked_allreduce(rank_arrays(ME, 1), 1)
        comm.masked_allreduce(rank_arrays(ME, 2), 2)
        comm.sparse_allgather(rank_arrays(ME, 1))
        comm.sync(rank_arrays(ME, 1))
    after = np.random.get_state()
    ck.true(before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:],
            "numpy's global RNG state changed")
    ck.done()


# --------------------------------------------------------------------------- the fused top-k exchange, bitwise
# sparse_allgather works on the whole fused buffer (on a device it also selects every tensor's
# top-k at once). Its results must be, bit for bit, those of the per-tensor exchange it
# replaced, at every P, on NumPy and through the strict CuPy double's device transports.

from tests.support import strict_cupy  # noqa: E402
from tests.support.mpi_checks import device_transport  # noqa: E402
from slamb_comm.wire.codecs import topk_indices_reference  # noqa: E402

FUSED_SHAPES = [(130, 150), (7,), (0,), (1,), (33, 5), (40, 40), (3,), (2, 3, 4)] + [(9, 11)] * 40


def per_tensor_exchange(lay, ratio, vdt, xs, es, skip=()):
    """The exchange as it was computed tensor by tensor (tests/test_communicator_local.py has the
    same reference, documented): per rank and tensor c = x + e, the stable top-k, values in vdt;
    payloads added tensor by tensor, rank after rank, in promote(dtype, float32), times 1/P, cast
    back; e = (e or zeros) + x - sent, except the tensors in ``skip``."""
    dt, vdt = lay.dtype, np.dtype(vdt or lay.dtype)
    acc = np.promote_types(dt, np.float32)
    sent = []
    for r in range(P):
        mine = []
        for o, n in lay.segments():
            c = xs[r][o : o + n] if es[r] is None else xs[r][o : o + n] + es[r][o : o + n]
            loc = topk_indices_reference(c, sc.k_elems(ratio, n))
            mine.append((o + loc, c[loc].astype(vdt)))
        sent.append(mine)
    out = np.zeros(lay.total, acc)
    for r in range(P):
        for pos, v in sent[r]:
            out[pos] += v.astype(acc)
    if P > 1:
        out *= acc.type(1.0 / P)
    new = []
    for r in range(P):
        e = np.zeros(lay.total, dt) if es[r] is None else es[r].copy()
        for i, ((o, n), (pos, v)) in enumerate(zip(lay.segments(), sent[r])):
            if i not in skip:
                e[o : o + n] += xs[r][o : o + n]
                e[pos] -= v.astype(dt)
        new.append(e)
    return out.astype(dt), new


def _fused_inputs(lay, step):
    """Every rank's input at ``step``: ties (few distinct magnitudes) and signed zeros."""
    xs = []
    for r in range(P):
        rng = np.random.default_rng([7000 + r, step])
        x = rng.integers(-4, 5, lay.total) * 0.25
        x = np.where(rng.random(lay.total) < 0.2, -0.0, x)
        xs.append(x.astype(lay.dtype))
    return xs


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["numpy", "mpi-staged", "nccl"])
@pytest.mark.parametrize("dtype,vdt", [("float32", None), ("float32", "float16"), ("float16", None)])
def test_sparse_allgather_is_bitwise_the_per_tensor_exchange(where, dtype, vdt):
    """Five steps: commit; commit=False + commit_residual(); skip two tensors; NaN on the last
    rank (every rank raises, nothing changes); commit. List and fused inputs alternate."""
    ck = Checks()
    lay = sc.Layout(FUSED_SHAPES, dtype, dense_threshold=50)
    with strict_cupy.install() as cp:
        strict_cupy.Device.current = 0
        xp = np if where == "numpy" else cp
        comm = sc.Communicator(sc.MPITransport() if where == "numpy" else device_transport(where), lay,
                               ratio=0.1, value_dtype=vdt, seed=1)
        es = [None] * P
        for step, mode in enumerate(["commit", (), {1, 40}, "nan", "commit"]):
            xs = _fused_inputs(lay, step)
            x = xs[ME].copy()
            if mode == "nan" and ME == BAD:
                x[12345] = np.nan
            arg = xp.asarray(x) if step % 2 else [xp.asarray(v.reshape(s)) for v, s in
                                                    zip(lay.flat_views(x), lay.shapes)]
            before = None if comm.residual is None else sc.arrays.to_host(comm.residual).copy()
            if mode in ("commit", "nan"):
                out, err = call(comm.sparse_allgather, arg)
            else:
                out, err = call(comm.sparse_allgather, arg, commit=False)
                if err is None:
                    comm.commit_residual(skip=mode)
            res = sc.arrays.to_host(comm.residual)
            if mode == "nan":
                ck.raised(err, NonFiniteError, f"{where} step {step}: NaN on rank {BAD}", ranks=(BAD,))
                ck.equal(res, before, f"{where} step {step}: the failed exchange changed the error buffer")
                continue
            ck.true(err is None, f"{where} step {step}: raised {err!r}")
            if err is not None:
                continue
            want, es = per_tensor_exchange(lay, 0.1, vdt, xs, es, () if mode == "commit" else mode)
            got = sc.arrays.to_host(out) if step % 2 else np.concatenate(
                [np.asarray(sc.arrays.to_host(a)).reshape(-1) for a in out])
            ck.true(got.dtype == want.dtype and got.tobytes() == want.tobytes(),
                    f"{where} {dtype}/{vdt} step {step}: the mean is not the per-tensor exchange's, bitwise")
            ck.true(res.tobytes() == es[ME].tobytes(),
                    f"{where} {dtype}/{vdt} step {step}: the error buffer is not the per-tensor exchange's, bitwise")
    ck.done()
