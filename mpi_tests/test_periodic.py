"""DiLoCo and DES-LOC over MPI and over a torch.distributed gloo group, every step against the
dense float64 reference of docs/algorithm.md section 12 written out here:

    bash scripts/mpirun.sh N 300 python3 -m pytest -q --with-mpi mpi_tests/test_periodic.py

for N = 1, 2 and 4. Every rank starts from its own parameters (the construction broadcasts rank
0's) and gets gradients of its own; the reference simulates all P ranks."""


import numpy as np
import pytest
from mpi4py import MPI

from slamb_comm import MPITransport
from slamb_comm.methods.periodic import DesLoc, DiLoCo
from slamb_comm.wire.stats import allreduce_wire

from tests.support.adamw_reference import Adam  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

SHAPES = [(20, 15), (15,), (4, 9)]
N = sum(int(np.prod(s)) for s in SHAPES)
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


class Reference:
    """All P ranks in float64: inner AdamW per rank, then DiLoCo's outer step or DES-LOC's means."""

    def __init__(self, H, lr=0.7, mu=0.9, round16=False, periods=None):
        self.x = [rank_params(0) for _ in range(P)]  # the construction broadcast rank 0's
        self.opt = [Adam(x) for x in self.x]
        self.anchor, self.b = flat(self.x[0]), np.zeros(N)
        self.H, self.lr, self.mu, self.round16, self.periods, self.t = H, lr, mu, round16, periods, 0

    def step(self):
        self.t += 1
        for r in range(P):
            self.opt[r].step(self.x[r], rank_grads(r, self.t, self.x[r]))
        if self.periods is not None:  # DES-LOC: each state's plain mean on its own period
            for name, h in zip("xmv", self.periods):
                if self.t % h == 0:
                    lists = {"x": self.x, "m": [o.m for o in self.opt], "v": [o.v for o in self.opt]}[name]
                    mean = np.mean([flat(a) for a in lists], axis=0)
                    for a in lists:
                        unflat(mean, a)
        elif self.t % self.H == 0:  # DiLoCo
            deltas = [self.anchor - flat(x) for x in self.x]
            if self.round16:
                deltas = [d.astype(np.float16).astype(np.float64) for d in deltas]
            d = np.mean(deltas, axis=0)
            self.b = self.mu * self.b + d
            self.anchor = self.anchor - self.lr * (d + self.mu * self.b)
            for x in self.x:
                unflat(self.anchor, x)


def same_everywhere(a):
    everyone = WORLD.allgather(np.asarray(a))
    return all(np.array_equal(e, everyone[0]) for e in everyone)


def close(got, want, tol):
    got, want = flat(got) if isinstance(got, list) else got, flat(want) if isinstance(want, list) else want
    err = float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))
    assert err < tol, err


# ----------------------------------------------------------------------------- core over MPI
@pytest.mark.parametrize("value_dtype,tol", [(None, 1e-12), ("float32", 1e-6), ("float16", 3e-3)])
def test_core_diloco_every_step(value_dtype, tol):
    H = 3
    x = rank_params(ME)
    d = DiLoCo(MPITransport(), x, sync_interval=H, outer_lr=0.7, outer_momentum=0.9, value_dtype=value_dtype)
    opt = Adam(x)
    ref = Reference(H, round16=value_dtype == "float16")
    assert all(np.array_equal(a, b) for a, b in zip(x, ref.x[0]))  # rank 0's parameters everywhere
    if P > 1:
        assert d.stats.total.calls == 1 and d.stats.by_kind["broadcast"].payload_bytes == N * 8
    item = {None: 8, "float32": 4, "float16": 2}[value_dtype]
    for t in range(1, 14):
        opt.step(x, rank_grads(ME, t, x))
        assert d.step(x) == (t % H == 0)
        ref.step()
        close(x, ref.x[ME], tol)
        tr = d.stats.new_step()
        if t % H == 0:
            close(d.anchor, ref.anchor, tol)
            close(d.momentum, ref.b, tol)
            assert same_everywhere(flat(x)) and same_everywhere(d.anchor) and same_everywhere(d.momentum)
            payload = (N + 1) * item
            assert (tr.calls, tr.payload_bytes, tr.wire_bytes) == (1, payload, allreduce_wire(payload, P))
        else:
            assert tr.calls == 0 and tr.payload_bytes == 0
    assert d.stats.by_kind["sync"].calls == 13 // H


@pytest.mark.parametrize("periods", [(2, 3, 5), (1, 1, 1), (3, 6, 12)])
def test_core_desloc_every_step(periods):
    x = rank_params(ME)
    s = DesLoc(MPITransport(), x, sync_interval=periods[0], moment1_interval=periods[1], moment2_interval=periods[2])
    opt = Adam(x)
    ref = Reference(None, periods=periods)
    for t in range(1, 14):
        opt.step(x, rank_grads(ME, t, x))
        due = s.step(x, opt.m, opt.v)
        assert due == tuple(n for n, h in zip("xmv", periods) if t % h == 0)
        ref.step()
        for got, want in ((x, ref.x[ME]), (opt.m, ref.opt[ME].m), (opt.v, ref.opt[ME].v)):
            close(got, want, 1e-12)
        for name, arrs in zip("xmv", (x, opt.m, opt.v)):
            if name in due:
                assert same_everywhere(flat(arrs)), (t, name)
        tr = s.stats.new_step()
        assert (tr.calls, tr.payload_bytes) == (len(due), len(due) * (N + 1) * 8)


def test_core_disagreeing_options_raise_everywhere():
    from slamb_comm import LayoutMismatchError

    if P == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(LayoutMismatchError, match="rank\\(s\\) \\[1"):
        DiLoCo(MPITransport(), rank_params(ME), sync_interval=3 + (ME == 1))


def test_core_bad_input_on_one_rank_raises_everywhere():
    from slamb_comm import LayoutError, NonContiguousError, PeerError

    if P == 1:
        pytest.skip("needs two ranks")
    x = rank_params(ME)
    d = DiLoCo(MPITransport(), x, sync_interval=1)
    before = d.anchor.copy()
    with pytest.raises(LayoutError if ME == 1 else PeerError):
        d.step(x[:2] if ME == 1 else x)
    assert np.array_equal(d.anchor, before) and not d.momentum.any()
    assert d.step(x) and same_everywhere(d.anchor) and same_everywhere(flat(x))  # usable afterwards
    y = rank_params(ME)
    if ME == 1:
        y[0] = np.asfortranarray(y[0])
    with pytest.raises(NonContiguousError if ME == 1 else PeerError):
        DesLoc(MPITransport(), y)


# ----------------------------------------------------------------------------- torch adapter over gloo
@pytest.fixture
def st(gloo):
    pytest.importorskip("torch")
    from slamb_comm.adapters import torch as st

    return st


def tparams(r):
    import torch

    return [torch.nn.Parameter(torch.from_numpy(a)) for a in rank_params(r)]


def set_grads(ps, t):
    import torch

    for p, g in zip(ps, rank_grads(ME, t, [p.detach().numpy() for p in ps])):
        p.grad = torch.from_numpy(g)


@pytest.mark.parametrize("value_dtype,tol", [(None, 1e-12), ("float16", 3e-3)])
def test_torch_diloco_every_step(st, value_dtype, tol):
    import torch

    H = 3
    ps = tparams(ME)
    opt = st.DiLoCo(torch.optim.AdamW(ps, lr=0.01), sync_interval=H, value_dtype=value_dtype)
    ref = Reference(H, round16=value_dtype == "float16")
    item = 2 if value_dtype == "float16" else 8
    for t in range(1, 11):
        set_grads(ps, t)
        opt.step()
        ref.step()
        close([p.detach().numpy() for p in ps], ref.x[ME], tol)
        tr = opt.step_traffic()
        assert tr.payload_bytes == ((N + 1) * item if t % H == 0 else 0)
        if t % H == 0:
            assert same_everywhere(flat([p.detach().numpy() for p in ps]))
            assert same_everywhere(opt.cores[0].anchor) and same_everywhere(opt.cores[0].momentum)


def test_torch_desloc_every_step(st):
    import torch

    periods = (2, 3, 5)
    ps = tparams(ME)
    opt = st.DesLoc(torch.optim.AdamW(ps, lr=0.01), sync_interval=2, moment1_interval=3, moment2_interval=5)
    ref = Reference(None, periods=periods)
    for t in range(1, 11):
        set_grads(ps, t)
        opt.step()
        ref.step()
        close([p.detach().numpy() for p in ps], ref.x[ME], 1e-12)
        close([opt.state[p]["exp_avg"].numpy() for p in ps], ref.opt[ME].m, 1e-12)
        close([opt.state[p]["exp_avg_sq"].numpy() for p in ps], ref.opt[ME].v, 1e-12)
        due = [n for n, h in zip("xmv", periods) if t % h == 0]
        assert opt.step_traffic().payload_bytes == len(due) * (N + 1) * 8
