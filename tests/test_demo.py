"""DeMo on the core and in the torch adapter, one process (docs/algorithm.md section 13).

The reference below writes the DCT-II out as its defining sum, chunk by chunk, in float64, and
the rule as the section's formulas, tensor by tensor; the library fuses everything.
"""

import pickle

import numpy as np
import pytest

import slamb_comm as sc
from slamb_comm.methods.demo import DCTChunks, DeMo, dct_matrix

SHAPES = [(20, 13), (7,), (3, 4, 5), (16, 16), (), (9, 1)]


from tests.support.demo_reference import RefDeMo, dct_table, ref_extract  # noqa: E402


def params(seed=0, shapes=SHAPES, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [np.asarray(rng.standard_normal(s), dtype) for s in shapes]


def grads(x, t, r=0):
    rng = np.random.default_rng([5, r, t])
    return [np.asarray(0.3 * np.asarray(a, np.float64) + rng.standard_normal(np.shape(a)), np.asarray(a).dtype)
            for a in x]


# ----------------------------------------------------------------------------- the codec
@pytest.mark.parametrize("s", [1, 2, 5, 8, 64])
def test_dct_matrices_are_orthonormal_and_the_dct_ii(s):
    d = dct_matrix(s)
    assert np.allclose(d @ d.T, np.eye(s), atol=1e-13) and np.allclose(d.T @ d, np.eye(s), atol=1e-13)
    assert np.allclose(d, dct_table(s), atol=1e-14)
    d32 = dct_matrix(s, np.float32)
    assert d32.dtype == np.float32 and np.allclose(d32 @ d32.T, np.eye(s), atol=1e-6)


@pytest.mark.parametrize("s", [4, 6, 8])
def test_all_coefficients_decode_exactly(s):
    x = params(1, SHAPES + [(0, 5), (0,)])
    flat = np.concatenate([a.ravel() for a in x])
    codec = DCTChunks(x, chunk=s, topk=s * s, value_dtype="float64")
    idx, val = codec.encode(flat)
    assert idx.dtype == np.int32 and val.dtype == np.float64 and idx.size == codec.K
    np.testing.assert_allclose(codec.decode(idx, val), flat, rtol=0, atol=1e-13)


@pytest.mark.parametrize("s,k,vd", [(8, 5, "float64"), (8, 64, "float64"), (6, 7, "float32"), (4, 3, "float16"),
                                    (64, 32, "float32")])
def test_codec_matches_the_dense_reference(s, k, vd):
    x = params(2, SHAPES + [(130, 70)])
    flat = np.concatenate([a.ravel() for a in x])
    codec = DCTChunks(x, chunk=s, topk=k, value_dtype=vd)
    idx, val = codec.encode(flat)
    assert val.dtype == np.dtype(vd)
    got = codec.decode(idx, val)
    want, sets = [], []
    for a in x:
        q, kept = ref_extract(a, s, k, vd)
        want.append(q.ravel())
        sets.append(kept)
    np.testing.assert_allclose(got, np.concatenate(want), rtol=0, atol=1e-12)
    blocks = [c for a, kept in zip(x, sets) if a.ndim >= 2 for c in kept]
    runs = [c for a, kept in zip(x, sets) if a.ndim < 2 for c in kept]
    assert (codec.n2, codec.n1) == (len(blocks), len(runs))
    at = 0
    for chunks, kk in ((blocks, codec.k2), (runs, codec.k1)):
        for want_set in chunks:
            assert want_set is None or set(idx[at : at + kk].tolist()) == want_set
            at += kk
    assert at == codec.K


# ----------------------------------------------------------------------------- the rule at P = 1
@pytest.mark.parametrize("vd", ["float64", "float32"])
@pytest.mark.parametrize("fused", [False, True])
def test_rule_alone_matches_the_reference(vd, fused):
    x = params(3)
    lr, beta, wd = 0.01, 0.9, 0.1
    opt = DeMo(None, x, lr=lr, beta=beta, weight_decay=wd, chunk=8, topk=5, value_dtype=vd)
    ref = RefDeMo(x, 1, lr, beta, wd, 8, 5, vd)
    flat = np.concatenate([a.ravel() for a in x])
    views = opt.layout.views(flat)
    for t in range(1, 13):
        g = grads(ref.x, t)
        if fused:
            assert opt.step(flat, np.concatenate([a.ravel() for a in g]))
        else:
            assert opt.step(x, g)
        ref.step([g])
        for mine, want in zip(views if fused else x, ref.x):
            np.testing.assert_allclose(mine, want, rtol=0, atol=1e-12)
        np.testing.assert_allclose(opt.m[:-1], np.concatenate([a.ravel() for a in ref.m[0]]), rtol=0, atol=1e-12)
        assert opt.m[-1] == 0 and opt.t == t


def test_defaults_and_float32_parameters():
    x = params(4, [(130, 70), (100,)], np.float32)
    opt = DeMo(None, x)
    assert (opt.lr, opt.beta, opt.weight_decay, opt.codec.s, opt.codec.k2, opt.codec.k1) == (4e-4, 0.999, 0.0, 64, 32, 32)
    assert opt.codec.value_dtype == np.float32
    ref = RefDeMo(x, 1, 4e-4, 0.999, 0.0, 64, 32, "float32")
    for t in range(1, 4):
        g = grads(x, t)
        opt.step(x, g)
        ref.step([g])
    for mine, want in zip(x, ref.x):
        assert mine.dtype == np.float32
        assert np.mean(np.abs(mine - want) > 1e-5) < 0.01  # float32 rounding may flip a sign near 0


# ----------------------------------------------------------------------------- state, bytes
def test_state_dict_round_trip_is_bitwise():
    x = params(5)
    a = DeMo(None, x, lr=0.01, chunk=8, topk=5)
    for t in range(1, 4):
        a.step(x, grads(x, t))
    state = pickle.loads(pickle.dumps(a.state_dict()))
    xb = [v.copy() for v in x]
    b = DeMo(None, xb, lr=0.01, chunk=8, topk=5)
    b.load_state_dict(state)
    assert b.t == 3
    for t in range(4, 8):
        a.step(x, grads(x, t))
        b.step(xb, grads(xb, t))
        for u, v in zip(x, xb):
            assert np.array_equal(u, v)
        assert np.array_equal(a.m, b.m)
    with pytest.raises(sc.ConfigError):
        DeMo(None, x, chunk=4, topk=5).load_state_dict(state)


@pytest.mark.parametrize("vd,itemsize", [("float32", 4), ("float16", 2)])
def test_bytes_recorded(vd, itemsize):
    x = params(6, dtype=np.float32)
    opt = DeMo(None, x, chunk=8, topk=5, value_dtype=vd)
    # blocks: (20,13) 3x2, (3,4,5) as (3,20) 1x3, (16,16) 2x2, (9,1) 2x1; runs: (7,) 1, () 1
    K = (6 + 3 + 4 + 2) * 5 + 2 * 5
    assert opt.codec.K == K
    opt.step(x, grads(x, 1))
    t = opt.stats.last
    pad8 = lambda n: -(-n // 8) * 8
    assert t.payload_bytes == 8 + pad8(4 * K) + pad8(itemsize * K)
    assert t.wire_bytes == 0.0 and t.elements_sent == K
    total = sum(a.size for a in x)
    assert (t.elements_total, t.dense_payload_bytes) == (total, 4 * total)
    assert opt.stats.by_kind["demo_allgather"].calls == 1


# ----------------------------------------------------------------------------- errors
def test_bad_options_raise():
    x = params(7)
    for kw in ({"chunk": 0}, {"topk": 0}, {"chunk": 4, "topk": 17}, {"chunk": 2.5}, {"topk": -1}, {"beta": 1.0},
               {"lr": -1.0}, {"on_nonfinite": "ignore"}):
        with pytest.raises(sc.ConfigError):
            DeMo(None, x, **kw)
    DeMo(None, x, chunk=4, topk=16)  # k = s^2 is allowed
    with pytest.raises(sc.DTypeError):
        DeMo(None, [a.astype(np.float16) for a in x])
    opt = DeMo(None, x, chunk=4, topk=3)
    with pytest.raises(sc.LayoutError):
        opt.step(x, grads(x, 1)[:-1])
    with pytest.raises(sc.LayoutError):
        opt.step(x, [a.astype(np.float32) for a in grads(x, 1)])
    assert opt.t == 0 and opt.m is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e6])
def test_non_finite_steps_are_skipped_with_nothing_changed(bad, caplog):
    x = params(8)
    vd = "float16" if bad == 1e6 else "float32"  # 1e6 overflows a float16 payload value
    opt = DeMo(None, x, lr=0.01, chunk=4, topk=3, value_dtype=vd)
    opt.step(x, grads(x, 1))
    before = [a.copy() for a in x], opt.m.copy()
    g = grads(x, 2)
    g[0][3, 4] = bad
    assert opt.step(x, g) is False
    assert opt.skipped_steps == 1 and opt.t == 1
    assert all(np.array_equal(a, b) for a, b in zip(x, before[0])) and np.array_equal(opt.m, before[1])
    assert "skipped" in caplog.text
    assert opt.stats.total.calls == 2  # the failed exchange's bytes still count
    strict = DeMo(None, x, chunk=4, topk=3, value_dtype=vd, on_nonfinite="raise")
    with pytest.raises(sc.NonFiniteError):
        strict.step(x, g)
    assert strict.t == 0


# ----------------------------------------------------------------------------- the torch adapter, alone
def test_torch_adapter_alone_matches_the_reference():
    torch = pytest.importorskip("torch")
    from slamb_comm.adapters.torch import DeMo as TorchDeMo

    x = params(9)
    ps = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in x]
    opt = TorchDeMo([{"params": ps[:3], "lr": 0.02, "weight_decay": 0.1}, {"params": ps[3:]}], lr=0.01,
                    momentum=0.9, chunk=8, topk=5)
    refs = [RefDeMo(x[:3], 1, 0.02, 0.9, 0.1, 8, 5, "float32"), RefDeMo(x[3:], 1, 0.01, 0.9, 0.0, 8, 5, "float32")]
    for t in range(1, 9):
        g = grads([p.detach().numpy() for p in ps], t)
        for p, gi in zip(ps, g):
            p.grad = torch.from_numpy(gi)
        opt.step()
        refs[0].step([g[:3]])
        refs[1].step([g[3:]])
        for p, want in zip(ps, refs[0].x + refs[1].x):
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=0, atol=1e-12)
        tr = opt.step_traffic()
        assert tr.calls == 1 and tr.payload_bytes == opt._core.codec.nbytes


def test_torch_adapter_state_dict_round_trip_and_skip():
    torch = pytest.importorskip("torch")
    from slamb_comm.adapters.torch import DeMo as TorchDeMo

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))
    data = torch.randn(16, 30), torch.randn(16, 3)

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(data[0]), data[1]).backward()
            opt.step()

    opt = TorchDeMo(net.parameters(), lr=1e-2, chunk=8, topk=6, weight_decay=0.01)
    train(net, opt, 3)
    twin = pickle.loads(pickle.dumps(net))
    topt = TorchDeMo(twin.parameters(), lr=1e-2, chunk=8, topk=6, weight_decay=0.01)
    topt.load_state_dict(pickle.loads(pickle.dumps(opt.state_dict())))
    train(net, opt, 3)
    train(twin, topt, 3)
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    before = [p.detach().clone() for p in net.parameters()]
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(data[0]), data[1]).backward()
    next(net.parameters()).grad[0, 0] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    with pytest.raises(sc.ConfigError):
        TorchDeMo(net.parameters(), chunk=4, topk=17)
