"""DiLoCo and DES-LOC in one process (docs/algorithm.md section 12): the core classes of
slamb_comm.methods.periodic and the torch adapter, against float64 references written out here.
The same rules over 1, 2 and 4 ranks: mpi_tests/test_periodic.py."""

import copy

import numpy as np
import pytest

import slamb_comm as sc
from slamb_comm.methods.periodic import DesLoc, DiLoCo

from tests.support.adamw_reference import Adam  # noqa: E402

SHAPES = [(6, 5), (7,), (3, 4)]
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


class RefDiLoCo:
    """The rule of section 12 at P = 1, in float64."""

    def __init__(self, xs, H, lr, mu, round16=False):
        self.anchor = np.concatenate([x.ravel() for x in xs]).astype(np.float64)
        self.b = np.zeros(N)
        self.H, self.lr, self.mu, self.round16, self.t = H, lr, mu, round16, 0

    def step(self, xs):
        self.t += 1
        if self.t % self.H:
            return
        d = self.anchor - np.concatenate([x.ravel() for x in xs])
        if self.round16:
            d = d.astype(np.float16).astype(np.float64)
        self.b = self.mu * self.b + d
        self.anchor = self.anchor - self.lr * (d + self.mu * self.b)
        o = 0
        for x in xs:
            x[...] = self.anchor[o : o + x.size].reshape(x.shape)
            o += x.size


# ----------------------------------------------------------------------------- core
def test_diloco_h1_lr1_mu0_is_the_inner_optimizer_bitwise():
    x, alone = params(positive=True), params(positive=True)
    opt, ref_opt = Adam(x, lr=1e-3), Adam(alone, lr=1e-3)
    d = DiLoCo(None, x, sync_interval=1, outer_lr=1.0, outer_momentum=0.0)
    for t in range(1, 8):
        opt.step(x, grads(t, x))
        assert d.step(x) is True
        ref_opt.step(alone, grads(t, alone))
        for a, b in zip(x, alone):
            assert np.array_equal(a, b), t
    assert np.array_equal(d.anchor, np.concatenate([a.ravel() for a in alone]))


@pytest.mark.parametrize("value_dtype,fused", [(None, False), (None, True), ("float16", False)])
def test_diloco_matches_float64_reference(value_dtype, fused):
    x = params()
    H, lr, mu = 3, 0.7, 0.9
    if fused:
        flat = np.concatenate([a.ravel() for a in x])
        x = sc.Layout(SHAPES, np.float64).views(flat)
    ref_x = params()
    opt, ref_opt = Adam(x), Adam(ref_x)
    d = DiLoCo(None, flat if fused else x, sync_interval=H, outer_lr=lr, outer_momentum=mu, value_dtype=value_dtype)
    ref = RefDiLoCo(ref_x, H, lr, mu, round16=value_dtype == "float16")
    for t in range(1, 14):
        opt.step(x, grads(t, x))
        ref_opt.step(ref_x, grads(t, ref_x))
        assert d.due() == (t % H == 0)
        assert d.step(flat if fused else x) == (t % H == 0)
        ref.step(ref_x)
        for a, b in zip(x, ref_x):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(d.anchor, ref.anchor, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(d.momentum, ref.b, rtol=1e-13, atol=1e-13)
        tr = d.stats.new_step()
        item = 2 if value_dtype == "float16" else 8
        assert (tr.calls, tr.payload_bytes) == (((1, (N + 1) * item)) if t % H == 0 else (0, 0))


@pytest.mark.parametrize("H", [1, 2])
def test_desloc_alone_is_the_inner_optimizer_bitwise(H):
    x, alone = params(), params()
    opt, ref_opt = Adam(x), Adam(alone)
    s = DesLoc(None, x, sync_interval=H, moment1_interval=2 * H, moment2_interval=3)
    for t in range(1, 10):
        opt.step(x, grads(t, x))
        due = s.due()
        assert s.step(x, opt.m, opt.v) == due
        assert due == tuple(n for n, h in (("x", H), ("m", 2 * H), ("v", 3)) if t % h == 0)
        ref_opt.step(alone, grads(t, alone))
        for a, b in zip(x + opt.m + opt.v, alone + ref_opt.m + ref_opt.v):
            assert np.array_equal(a, b)
        tr = s.stats.new_step()
        assert (tr.calls, tr.payload_bytes) == (len(due), len(due) * (N + 1) * 8)


def test_desloc_defaults():
    s = DesLoc(None, params(), sync_interval=4)
    assert (s.sync_interval, s.moment1_interval, s.moment2_interval) == (4, 12, 24)
    s = DesLoc(None, params())
    assert (s.sync_interval, s.moment1_interval, s.moment2_interval) == (50, 150, 300)
    d = DiLoCo(None, params())
    assert (d.sync_interval, d.outer_lr, d.outer_momentum, d.value_dtype.name) == (50, 0.7, 0.9, "float64")


def test_core_state_dict_round_trip_is_bitwise():
    def run(d, x, opt, ts):
        for t in ts:
            opt.step(x, grads(t, x))
            d.step(x)

    x = params()
    opt = Adam(x)
    d = DiLoCo(None, x, sync_interval=3)
    run(d, x, opt, range(1, 8))
    saved, saved_x, saved_opt = d.state_dict(), copy.deepcopy(x), copy.deepcopy(opt)
    run(d, x, opt, range(8, 15))
    x2 = saved_x
    d2 = DiLoCo(None, x2, sync_interval=3)
    d2.load_state_dict(saved)
    assert d2.t == 7
    run(d2, x2, saved_opt, range(8, 15))
    for a, b in zip(x, x2):
        assert np.array_equal(a, b)
    assert np.array_equal(d.anchor, d2.anchor) and np.array_equal(d.momentum, d2.momentum)
    s = DesLoc(None, params(), sync_interval=2)
    s.step(params())
    s2 = DesLoc(None, params(), sync_interval=2)
    s2.load_state_dict(s.state_dict())
    assert s2.t == 1 and s2.due() == ("x",)


def test_core_errors_name_the_option_and_the_fix():
    x = params()
    with pytest.raises(ValueError, match=r"sync_interval must be an integer >= 1.*got 0.*500"):
        DiLoCo(None, x, sync_interval=0)
    with pytest.raises(ValueError, match=r"outer_lr must be a finite number > 0, got -1.*0\.7"):
        DiLoCo(None, x, outer_lr=-1)
    with pytest.raises(ValueError, match=r"outer_momentum must be a number in \[0, 1\), got 1.0.*0\.9"):
        DiLoCo(None, x, outer_momentum=1.0)
    with pytest.raises(ValueError, match=r"moment1_interval.*got 2\.5.*3 \* sync_interval"):
        DesLoc(None, x, moment1_interval=2.5)
    with pytest.raises(ValueError, match=r"sync_interval.*got True"):
        DesLoc(None, x, sync_interval=True)
    with pytest.raises(TypeError):
        DiLoCo(None, x, value_dtype="bfloat16")
    d = DiLoCo(None, x, sync_interval=1)
    with pytest.raises(sc.LayoutError, match="got 2 arrays, DiLoCo was built for 3"):
        d.step(x[:2])
    with pytest.raises(sc.LayoutError, match="expected float64"):
        d.step([a.astype(np.float32) for a in x])
    with pytest.raises(sc.ConfigError, match="pass it to step"):
        d.step(None)
    s = DesLoc(None, x, sync_interval=1, moment1_interval=1)
    with pytest.raises(sc.ConfigError, match="averages m: pass it"):
        s.step(x)
    bad = DiLoCo(None, params(), sync_interval=1).state_dict()
    bad["shapes"] = [[1]]
    with pytest.raises(sc.LayoutMismatchError):
        d.load_state_dict(bad)
    with pytest.raises(sc.ConfigError, match="saved by 'DES-LOC'"):
        d.load_state_dict(s.state_dict())


def test_diloco_nonfinite_changes_nothing():
    x = params()
    d = DiLoCo(None, x, sync_interval=1, value_dtype="float16")
    before = d.anchor.copy()
    x[0][0, 0] = 1e6  # beyond float16's range: the float16 delta is Inf
    with pytest.raises(sc.NonFiniteError):
        d.step(x)
    assert np.array_equal(d.anchor, before) and not d.momentum.any() and x[0][0, 0] == 1e6


# ----------------------------------------------------------------------------- torch adapter
torch = pytest.importorskip("torch")
from slamb_comm.adapters import torch as st  # noqa: E402


def tparams(dtype=torch.float64, positive=False):
    return [torch.nn.Parameter(torch.from_numpy(a).to(dtype)) for a in params(positive=positive)]


def set_grads(ps, t):
    for p, g in zip(ps, grads(t, [p.detach().double().numpy() for p in ps])):
        p.grad = torch.from_numpy(g).to(p.dtype)


def test_torch_names_are_exported():
    assert st.DiLoCo is st.periodic.DiLoCo and "DiLoCo" in st.__all__ and "DesLoc" in st.__all__


def test_torch_diloco_h1_lr1_mu0_is_adamw_bitwise():
    ps, alone = tparams(positive=True), tparams(positive=True)
    opt = st.DiLoCo(torch.optim.AdamW(ps, lr=1e-3), sync_interval=1, outer_lr=1.0, outer_momentum=0.0,
                    value_dtype=None)
    ref = torch.optim.AdamW(alone, lr=1e-3)
    for t in range(1, 6):
        set_grads(ps, t)
        set_grads(alone, t)
        opt.step()
        ref.step()
        for a, b in zip(ps, alone):
            assert torch.equal(a, b)


def test_torch_desloc_alone_is_adam_bitwise():
    ps, alone = tparams(), tparams()
    opt = st.DesLoc(torch.optim.Adam(ps, lr=1e-2), sync_interval=1, moment1_interval=2, moment2_interval=3)
    ref = torch.optim.Adam(alone, lr=1e-2)
    for t in range(1, 8):
        set_grads(ps, t)
        set_grads(alone, t)
        opt.step()
        ref.step()
        for a, b in zip(ps, alone):
            assert torch.equal(a, b)
            assert torch.equal(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"])
        assert opt.step_traffic().calls == sum(t % h == 0 for h in (1, 2, 3))


def test_torch_diloco_matches_reference():
    ps, ref_x = tparams(), params()
    opt = st.DiLoCo(torch.optim.AdamW(ps, lr=0.01), sync_interval=3, value_dtype=None)
    ref_opt, ref = Adam(ref_x, lr=0.01), RefDiLoCo(ref_x, 3, 0.7, 0.9)
    for t in range(1, 11):
        set_grads(ps, t)
        opt.step()
        ref_opt.step(ref_x, grads(t, ref_x))
        ref.step(ref_x)
        for p, want in zip(ps, ref_x):
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12, atol=1e-12)
        tr = opt.step_traffic()
        assert tr.payload_bytes == ((N + 1) * 8 if t % 3 == 0 else 0)
        assert tr.dense_payload_bytes == N * 8  # the dense reference of a step, also between averages


def test_outer_step_is_torch_sgd_nesterov_on_the_anchor():
    """Section 12's outer step is torch.optim.SGD(nesterov=True) with delta as the gradient."""
    x = params()
    d = DiLoCo(None, x, sync_interval=2, outer_lr=0.7, outer_momentum=0.9)
    anchor = torch.nn.Parameter(torch.from_numpy(d.anchor.copy()))
    sgd = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    for t in range(1, 9):
        for a, g in zip(x, grads(t, x)):
            a -= 0.05 * g
        if t % 2 == 0:
            anchor.grad = anchor.detach() - torch.from_numpy(np.concatenate([a.ravel() for a in x]))
            sgd.step()
        d.step(x)
        np.testing.assert_allclose(d.anchor, anchor.detach().numpy(), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(d.momentum, sgd.state[anchor]["momentum_buffer"].numpy(), rtol=1e-14, atol=1e-14)


def test_torch_diloco_16bit_and_float16_payload():
    ps = tparams(torch.bfloat16)
    opt = st.DiLoCo(torch.optim.SGD(ps, lr=0.01), sync_interval=2, value_dtype="float16")
    for t in range(1, 5):
        set_grads(ps, t)
        opt.step()
        tr = opt.step_traffic()
        assert tr.payload_bytes == ((N + 1) * 2 if t % 2 == 0 else 0)
        assert tr.dense_payload_bytes == N * 4  # float32: the compute dtype of bfloat16 parameters
    anchor = opt.cores[0].anchor
    assert anchor.dtype == np.float32 and all(p.dtype == torch.bfloat16 for p in ps)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in ps]), torch.from_numpy(anchor).bfloat16())


def test_torch_state_dict_round_trip_is_bitwise():
    def run(opt, ps, ts):
        for t in ts:
            set_grads(ps, t)
            opt.step()

    for make in (lambda ps: st.DiLoCo(torch.optim.AdamW(ps, lr=0.01), sync_interval=3),
                 lambda ps: st.DesLoc(torch.optim.AdamW(ps, lr=0.01), sync_interval=2, moment1_interval=3)):
        ps = tparams()
        opt = make(ps)
        run(opt, ps, range(1, 6))
        saved, saved_ps = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in ps]
        run(opt, ps, range(6, 13))
        ps2 = [torch.nn.Parameter(p) for p in saved_ps]
        opt2 = make(ps2)
        opt2.load_state_dict(saved)
        assert opt2.param_groups is opt2.optimizer.param_groups and opt2.state is opt2.optimizer.state
        run(opt2, ps2, range(6, 13))
        for a, b in zip(ps, ps2):
            assert torch.equal(a, b)
        for c1, c2 in zip(opt.cores, opt2.cores):
            assert c1.t == c2.t == 12
            if isinstance(c1, DiLoCo):
                assert np.array_equal(c1.anchor, c2.anchor) and np.array_equal(c1.momentum, c2.momentum)


def test_torch_errors():
    ps = tparams()
    with pytest.raises(TypeError, match="SGD has none.*use DiLoCo"):
        st.DesLoc(torch.optim.SGD(ps, lr=0.1))
    opt = st.DesLoc(torch.optim.Adamax(ps, lr=0.1))
    set_grads(ps, 1)
    with pytest.raises(TypeError, match="'exp_avg_sq'.*Adamax"):
        opt.step()
    with pytest.raises(ValueError, match="outer_momentum must be a number in"):
        st.DiLoCo(torch.optim.SGD(ps, lr=0.1), outer_momentum=-0.1)
    with pytest.raises(ValueError, match="sync_interval must be an integer >= 1"):
        st.DesLoc(torch.optim.Adam(ps), sync_interval=0)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        st.DiLoCo(ps)
    opt = st.DiLoCo(torch.optim.AdamW(ps))
    with pytest.raises(ValueError, match="no 'periodic' entry"):
        opt.load_state_dict(torch.optim.AdamW(ps).state_dict())
