"""SparseLoCo, the shared-mask and the shared-top-k SparseLoCo over MPI and over a torch.distributed gloo group,
every step against the dense float64 reference of docs/algorithm.md section 14 written out here:

    bash scripts/mpirun.sh N 300 python3 -m pytest -q --with-mpi mpi_tests/test_sparseloco.py

for N = 1, 2 and 4. Every rank starts from its own parameters (the construction broadcasts rank
0's) and gets gradients of its own; the reference simulates all P ranks, densely: each rank's
sparse update is a vector of N elements, zero where nothing is sent."""


import numpy as np
import pytest
from mpi4py import MPI

from slamb_comm import MPITransport
from slamb_comm.wire.layout import Layout
from slamb_comm.wire.masks import CyclicMask
from slamb_comm.methods.sparseloco import SharedMaskSparseLoCo, SharedTopKSparseLoCo, SparseLoCo
from slamb_comm.wire.stats import allgather_wire, allreduce_wire, broadcast_wire

from tests.support.adamw_reference import Adam  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

SHAPES = [(20, 15), (15,), (4, 9)]  # N = 351: with chunk 64, five full chunks and one of 31
N = sum(int(np.prod(s)) for s in SHAPES)
CHUNK, TOPK = 64, 4
WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank


def rank_params(r):
    rng = np.random.default_rng(100 + r)
    return [rng.standard_normal(s) for s in SHAPES]


def rank_grads(r, t, xs):
    """Rank r's gradient at step t: depends on its parameters and on (r, t)."""
    rng = np.random.default_rng([7, r, t])
    return [0.5 * x + (1 + r) * rng.standard_normal(x.shape) for x in xs]


def flat(xs):
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in xs])


def unflat(v, xs):
    o = 0
    for x in xs:
        x[...] = v[o : o + x.size].reshape(x.shape)
        o += x.size


def chunk_topk_dense(e, s, k, bits):
    """Section 14's Q(TopK(e)) as a dense vector: per chunk of s consecutive elements of the fused
    buffer, its ceil(k L / s) entries of largest |e| (L: the chunk's length), each rounded to sign
    and magnitude a j / M (M = 2^(bits-1), a = float32(max |kept|), j = clip(rint(|v| / a M), 1, M));
    bits = 32: the values as float32."""
    out = np.zeros_like(e)
    for lo in range(0, e.size, s):
        seg = e[lo : lo + s]
        keep = np.argsort(-np.abs(seg), kind="stable")[: min(seg.size, -(-k * seg.size // s))]
        v = seg[keep]
        if bits == 32:
            q = v.astype(np.float32).astype(np.float64)
        else:
            M, a = 2 ** (bits - 1), float(np.float32(np.abs(v).max()))
            j = np.clip(np.rint(np.abs(v) / a * M), 1, M)
            q = np.where(v < 0, -1.0, 1.0) * (a * j) / M if a > 0 else np.zeros_like(v)
        out[lo + keep] = q
    return out


def mask_positions(j, ratio, seed=0, dense_threshold=9000):
    """M_j of the shared cyclic mask (docs/algorithm.md section 1 step 2, tested in its own right)."""
    return np.asarray(CyclicMask(Layout(SHAPES, np.float64, dense_threshold=dense_threshold), ratio, seed).select(j))


class Reference:
    """All P ranks in float64: inner AdamW per rank, then section 14's outer step every H steps,
    with per-rank chunk-wise top-k (``ratio`` None), the shared mask of density ``ratio``, or
    (``leader``) every rank on the positions of rank (j - 1) mod P's chunk-wise top-k (14.7)."""

    def __init__(self, H, lr=1.0, beta=0.95, bits=2, ratio=None, round_to=None, dense_threshold=0, leader=False):
        self.x = [rank_params(0) for _ in range(P)]  # the construction broadcast rank 0's
        self.opt = [Adam(x) for x in self.x]
        self.anchor, self.e = flat(self.x[0]), [np.zeros(N) for _ in range(P)]
        self.H, self.lr, self.beta, self.bits, self.t = H, lr, beta, bits, 0
        self.ratio, self.round_to, self.dense_threshold, self.leader = ratio, round_to, dense_threshold, leader

    def sparse(self, e, j, leader_e=None):
        """Rank r's update at outer step j, dense: its top-k per chunk, e on M_j, or e on the leader's
        top-k positions (these two rounded as sent)."""
        if self.leader:
            idx = np.flatnonzero(chunk_topk_dense(leader_e, CHUNK, TOPK, 32))  # no entry of e is 0 here
        elif self.ratio is None:
            return chunk_topk_dense(e, CHUNK, TOPK, self.bits)
        else:
            idx = mask_positions(j, self.ratio, dense_threshold=self.dense_threshold)
        out = np.zeros(N)
        out[idx] = e[idx] if self.round_to is None else e[idx].astype(self.round_to).astype(np.float64)
        return out

    def step(self):
        self.t += 1
        for r in range(P):
            self.opt[r].step(self.x[r], rank_grads(r, self.t, self.x[r]))
        if self.t % self.H:
            return
        j = self.t // self.H
        self.e = [self.beta * self.e[r] + (self.anchor - flat(self.x[r])) for r in range(P)]
        sent = [self.sparse(self.e[r], j, self.e[(j - 1) % P]) for r in range(P)]
        for r in range(P):
            self.e[r] = self.e[r] - sent[r]
        self.anchor = self.anchor - self.lr * np.mean(sent, axis=0)
        for x in self.x:
            unflat(self.anchor, x)


def same_everywhere(a):
    everyone = WORLD.allgather(np.asarray(a))
    return all(np.array_equal(e, everyone[0]) for e in everyone)


def close(got, want, tol):
    got, want = flat(got) if isinstance(got, list) else got, flat(want) if isinstance(want, list) else want
    err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
    assert err < tol, err


def every_step(d, x, ref, H, tol, outer_bytes):
    """13 steps of ``d`` on this rank's ``x`` (inner AdamW) beside ``ref``: x after every step;
    anchor and error after each outer step, equal on every rank, and ``outer_bytes(t, traffic)``;
    nothing sent between outer steps."""
    opt = Adam(x)
    for t in range(1, 14):
        opt.step(x, rank_grads(ME, t, x))
        assert d.step(x) == (t % H == 0)
        ref.step()
        close(x, ref.x[ME], tol)
        tr = d.stats.new_step()
        if t % H == 0:
            close(d.anchor, ref.anchor, tol)
            close(d.error, ref.e[ME], tol)
            assert same_everywhere(flat(x)) and same_everywhere(d.anchor)
            outer_bytes(t, tr)
        else:
            assert tr.calls == 0


def sparseloco_nbytes(bits):
    """Section 14's payload, from its definition: N = 351, s = 64: 6 chunks (the last of 31
    elements sends ceil(4 * 31 / 64) = 2), K = 5 * 4 + 2 = 22 entries of 6 + bits bits."""
    K, width = 22, 6 + bits
    scales = 0 if bits == 32 else -(-4 * 6 // 8) * 8
    return 8 + scales + -(-(-(-K * width // 8)) // 8) * 8


# ----------------------------------------------------------------------------- core over MPI
@pytest.mark.parametrize("bits", [2, 8, 32])
def test_core_sparseloco_every_step(bits):
    H = 3
    x = rank_params(ME)
    d = SparseLoCo(MPITransport(), x, sync_interval=H, outer_lr=0.9, beta=0.95, chunk=CHUNK, topk=TOPK, bits=bits)
    opt = Adam(x)
    ref = Reference(H, lr=0.9, bits=bits)
    assert all(np.array_equal(a, b) for a, b in zip(x, ref.x[0]))  # rank 0's parameters everywhere
    nbytes = sparseloco_nbytes(bits)
    assert d.codec.nbytes == nbytes
    for t in range(1, 14):
        opt.step(x, rank_grads(ME, t, x))
        assert d.step(x) == (t % H == 0)
        ref.step()
        close(x, ref.x[ME], 1e-12)
        close(d.error, ref.e[ME], 1e-12)
        tr = d.stats.new_step()
        if t % H == 0:
            close(d.anchor, ref.anchor, 1e-12)
            assert same_everywhere(flat(x)) and same_everywhere(d.anchor)
            assert (tr.calls, tr.payload_bytes, tr.wire_bytes) == (1, nbytes, allgather_wire(nbytes, P))
            assert (tr.elements_sent, tr.elements_total) == (22, N)
        else:
            assert tr.calls == 0 and tr.payload_bytes == 0
    assert d.stats.by_kind["sparseloco_allgather"].calls == 13 // H


@pytest.mark.parametrize("value_dtype,tol", [(None, 1e-12), ("float32", 1e-6), ("float16", 3e-3)])
def test_core_shared_mask_every_step(value_dtype, tol):
    """The shared-mask variant's own reference: M_j on every rank, one allreduce of |M_j| + 1 values.
    Alone (P = 1) the sum rounds nothing: exact in every value_dtype, rounding of what is sent included."""
    tol = 1e-12 if P == 1 else tol
    H, ratio = 2, 0.25  # C = 4; dense_threshold 0: the matrices follow the mask, the vector goes whole
    x = rank_params(ME)
    d = SharedMaskSparseLoCo(MPITransport(), x, sync_interval=H, outer_lr=0.8, beta=0.9, ratio=ratio,
                             value_dtype=value_dtype, dense_threshold=0)
    ref = Reference(H, lr=0.8, beta=0.9, ratio=ratio, round_to={None: None, "float32": np.float32,
                                                               "float16": np.float16}[value_dtype])
    item = {None: 8, "float32": 4, "float16": 2}[value_dtype]

    def outer_bytes(t, tr):
        m = mask_positions(t // H, ratio, dense_threshold=0).size
        assert 0 < m < N and (tr.payload_bytes, tr.elements_sent) == ((m + 1) * item, m)
        assert tr.wire_bytes == allreduce_wire((m + 1) * item, P)  # the same at any P: no index, no gather

    every_step(d, x, ref, H, tol, outer_bytes)


@pytest.mark.parametrize("value_dtype,tol", [(None, 1e-12), ("float32", 1e-6), ("float16", 3e-3)])
def test_core_shared_topk_every_step(value_dtype, tol):
    """The shared-top-k variant's own reference (section 14.7): every rank sends e on rank
    (j - 1) mod P's chunk-wise top-k positions: one broadcast of the offsets (6 bits each at
    chunk 64) and one allreduce of K + 1 values. Alone (P = 1) exact in every value_dtype."""
    tol = 1e-12 if P == 1 else tol
    H = 2
    x = rank_params(ME)
    d = SharedTopKSparseLoCo(MPITransport(), x, sync_interval=H, outer_lr=0.8, beta=0.9, chunk=CHUNK, topk=TOPK,
                             value_dtype=value_dtype)
    ref = Reference(H, lr=0.8, beta=0.9, leader=True,
                    round_to={None: None, "float32": np.float32, "float16": np.float16}[value_dtype])
    item = {None: 8, "float32": 4, "float16": 2}[value_dtype]
    index_bytes = 8 + 24  # K = 22 offsets of 6 bits = 132 bits = 17 bytes, padded to 24
    assert d.index_bytes == index_bytes and [d.leader(j) for j in (1, 2, 3)] == [0, 1 % P, 2 % P]

    def outer_bytes(t, tr):
        values = 23 * item
        assert (tr.payload_bytes, tr.elements_sent) == (index_bytes + values, 22)
        assert tr.wire_bytes == broadcast_wire(index_bytes, P) + allreduce_wire(values, P)  # flat in P

    every_step(d, x, ref, H, tol, outer_bytes)
    assert d.stats.by_kind["sparseloco_shared_topk"].calls == 13 // H


def make(variant, x, **kw):
    """One of the three variants over MPI, at this file's geometry unless ``kw`` says otherwise."""
    if variant == "mask":
        return SharedMaskSparseLoCo(MPITransport(), x, **{"ratio": 0.25, **kw})
    cls = SparseLoCo if variant == "topk" else SharedTopKSparseLoCo
    return cls(MPITransport(), x, **{"chunk": CHUNK, "topk": TOPK, **kw})


@pytest.mark.parametrize("variant", ["topk", "mask", "shared_topk"])
def test_core_nonfinite_on_one_rank_raises_everywhere_and_changes_nothing(variant):
    """Rank 1's NaN at outer steps 2 and 3: for the shared top-k, at step 2 rank 1 leads (its
    flag travels in the broadcast) and at step 3 it does not (its flag travels in the allreduce)."""
    from slamb_comm import NonFiniteError

    if P == 1:
        pytest.skip("needs two ranks")
    x = rank_params(ME)
    d = make(variant, x, sync_interval=1)
    x[2][0, 0] += 0.5
    assert d.step(x)
    for _ in range(2):
        anchor, error = d.anchor.copy(), d.error.copy()
        x[0][3, 3] = np.nan if ME == 1 else x[0][3, 3]
        with pytest.raises(NonFiniteError, match="rank\\(s\\) \\[1\\]"):
            d.step(x)
        assert np.array_equal(d.anchor, anchor) and np.array_equal(d.error, error)
        x[0][3, 3] = 0.0
    assert d.step(x) and same_everywhere(d.anchor) and same_everywhere(flat(x))  # usable afterwards
    kind = {"topk": "sparseloco_allgather", "mask": "sparseloco_allreduce", "shared_topk": "sparseloco_shared_topk"}
    assert d.stats.by_kind[kind[variant]].calls == 4, d.stats.by_kind  # failed steps' bytes crossed the network


@pytest.mark.parametrize("variant", ["topk", "mask", "shared_topk"])
def test_core_bad_input_on_one_rank_raises_everywhere(variant):
    """Rank 1 passes the wrong arrays: at step 1 (for the shared top-k rank 0 leads) and at step 2
    (rank 1 leads, so nobody has positions to send on)."""
    from slamb_comm import LayoutError, PeerError

    if P == 1:
        pytest.skip("needs two ranks")
    x = rank_params(ME)
    d = make(variant, x, sync_interval=1)
    for _ in range(2):
        with pytest.raises(LayoutError if ME == 1 else PeerError):
            d.step(x[:2] if ME == 1 else x)
        assert not d.error.any()
    assert d.step(x) and same_everywhere(d.anchor)


@pytest.mark.parametrize("variant,option", [("topk", {"topk": 4}), ("mask", {"seed": 0}),
                                            ("shared_topk", {"topk": 4})])
def test_core_disagreeing_options_raise_everywhere(variant, option):
    from slamb_comm import LayoutMismatchError

    if P == 1:
        pytest.skip("needs two ranks")
    (key, value), = option.items()
    with pytest.raises(LayoutMismatchError, match="rank\\(s\\) \\[1"):
        make(variant, rank_params(ME), **{key: value + (ME == 1)})


# ----------------------------------------------------------------------------- torch adapter over gloo
@pytest.fixture
def sl(gloo):
    pytest.importorskip("torch")
    from slamb_comm.adapters.torch.periodic import sparseloco

    return sparseloco


def tparams(r):
    import torch

    return [torch.nn.Parameter(torch.from_numpy(a)) for a in rank_params(r)]


def set_grads(ps, t):
    import torch

    for p, g in zip(ps, rank_grads(ME, t, [p.detach().numpy() for p in ps])):
        p.grad = torch.from_numpy(g)


@pytest.mark.parametrize("variant", ["topk", "mask", "shared_topk"])
def test_torch_every_step(sl, variant):
    import torch

    H = 3
    ps = tparams(ME)
    inner = torch.optim.AdamW(ps, lr=0.01)
    if variant == "mask":
        opt = sl.SharedMaskSparseLoCo(inner, sync_interval=H, ratio=0.25, value_dtype=None, dense_threshold=0)
        ref = Reference(H, ratio=0.25)
    elif variant == "shared_topk":
        opt = sl.SharedTopKSparseLoCo(inner, sync_interval=H, chunk=CHUNK, topk=TOPK, value_dtype="float32")
        ref = Reference(H, leader=True, round_to=np.float32)
    else:
        opt = sl.SparseLoCo(inner, sync_interval=H, chunk=CHUNK, topk=TOPK)
        ref = Reference(H)
    tol = 1e-6 if variant == "shared_topk" and P > 1 else 1e-12
    for t in range(1, 11):
        set_grads(ps, t)
        opt.step()
        ref.step()
        close([p.detach().numpy() for p in ps], ref.x[ME], tol)
        tr = opt.step_traffic()
        assert (tr.payload_bytes > 0) == (t % H == 0)
        if t % H == 0:
            assert same_everywhere(flat([p.detach().numpy() for p in ps])) and same_everywhere(opt.cores[0].anchor)
            close(opt.cores[0].error, ref.e[ME], tol)
            if variant == "topk":
                assert tr.payload_bytes == sparseloco_nbytes(2)
            elif variant == "shared_topk":
                assert tr.payload_bytes == 32 + 23 * 4
