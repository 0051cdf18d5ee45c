"""Single-process tests of the 1-bit LAMB rule (slamb_comm.methods.onebit_lamb, docs/onebit_lamb.md
section 2 with section 3's choices) against its float64 simulation (tests/support/onebit_reference.py),
against docs/algorithm.md's LAMB (the warm-up with bias correction), and for failures, state and the
CuPy branch (strict double)."""

import pickle

import numpy as np
import pytest

from tests.support import onebit_reference as ref
import slamb_comm as sc
from tests.support import strict_cupy
from slamb_comm.errors import ConfigError, NonFiniteError
from slamb_comm.methods.onebit_lamb import OneBitLambRule
from slamb_comm.methods.slamb import SlambRule

SHAPES = [(30, 40), (7,), (0,), (3, 5, 2), (65,)]
SIZES = [1200, 7, 0, 30, 65]


def make(seed, xp=np, scale=1.0):
    rng = np.random.default_rng(seed)
    return [xp.asarray(scale * rng.standard_normal(s)) for s in SHAPES]


def flat(arrays):
    return np.concatenate([np.asarray(sc.arrays.to_host(a)).ravel() for a in arrays])


def opt_for(xp=np, **kw):
    comm = sc.Communicator(None, make(0, xp), seed=1)
    return OneBitLambRule(comm, **kw)


OPTIONS = [dict(), dict(weight_decay=0.01), dict(bias_correction=True), dict(weight_decay=0.1, bias_correction=True,
                                                                              factor_threshold=0.3, coeff_beta=0.5)]


@pytest.mark.parametrize("kw", OPTIONS)
def test_matches_the_float64_simulation(kw):
    kw = dict(lr=0.01, freeze_step=4, **kw)
    opt, sim = opt_for(**kw), ref.OneBitLambReference(SIZES, 1, **kw)
    x, xr = make(1), [a.reshape(-1) for a in make(1)]
    for step in range(1, 10):
        g = make(100 + step, scale=0.1 * step)
        opt.step(x, g)
        sim.step(xr, [g])
        np.testing.assert_allclose(flat(x), flat(xr), rtol=1e-11, atol=1e-13, err_msg=f"step {step}")
        np.testing.assert_allclose(opt.kappa, sim.kappa, rtol=1e-12)
        np.testing.assert_allclose(opt.phi, sim.phi, rtol=1e-12)
        assert opt.compressing == (step >= 4)
    np.testing.assert_allclose(opt.gamma, sim.gamma, rtol=1e-12)
    assert opt.phi != [1.0] * 5 and all(0 < k for k, n in zip(opt.kappa, SIZES) if n)


def test_warm_up_with_bias_correction_is_algorithm_md_lamb():
    kw = dict(lr=0.01, eps=1e-6, weight_decay=0.01)
    opt = opt_for(freeze_step=100, bias_correction=True, c_min=0.01, c_max=1000.0, **kw)
    lamb = SlambRule(sc.Communicator(None, make(0), ratio=1.0, seed=1), c_min=0.01, c_max=1000.0, sync_interval=1, **kw)
    x, xl = make(1), make(1)
    for step in range(1, 6):
        g = make(200 + step)
        opt.step(x, g)
        lamb.step(xl, g)
        np.testing.assert_allclose(flat(x), flat(xl), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.m, lamb.m, rtol=1e-13)


def test_non_finite_gradient_skips_or_raises_and_changes_nothing():
    for freeze in (100, 1):  # in the warm-up, and in the compression stage
        opt = opt_for(lr=0.01, freeze_step=freeze)
        x = make(1)
        opt.step(x, make(2))
        opt.step(x, make(3))
        before = pickle.dumps(opt.state_dict())
        keep = flat(x)
        g = make(4)
        g[0][2, 2] = np.nan
        opt.step(x, g)
        assert opt.skipped_steps == 1 and np.array_equal(flat(x), keep)
        after = opt.state_dict()
        after["skipped_steps"] = 0
        assert pickle.dumps(after) == before
        opt.on_nonfinite = "raise"
        with pytest.raises(NonFiniteError):
            opt.step(x, g)


def test_state_round_trip_continues_bitwise():
    a = opt_for(lr=0.01, freeze_step=3, weight_decay=0.01)
    x = make(1)
    for step in range(1, 6):
        a.step(x, make(10 + step))
    b = opt_for(lr=0.01, freeze_step=3, weight_decay=0.01)
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    xb = [v.copy() for v in x]
    for step in range(6, 9):
        g = make(10 + step)
        a.step(x, g)
        b.step(xb, g)
        assert np.array_equal(flat(x), flat(xb))
    assert a.phi == b.phi and a.kappa == b.kappa and a.gamma == b.gamma


def test_config_errors():
    for kw in (dict(freeze_step=-1), dict(factor_min=2.0), dict(factor_threshold=1.0), dict(c_min=0),
               dict(on_nonfinite="ignore"), dict(betas=(1.0, 0.9)), dict(lr=float("nan"))):
        with pytest.raises(ConfigError):
            opt_for(**kw)
    with pytest.raises(ConfigError):
        OneBitLambRule(sc.Communicator(None, [np.zeros(4, np.float16)], seed=1))


@pytest.fixture
def cp():
    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        yield mod


def test_cupy_branch_matches_numpy(cp):
    kw = dict(lr=0.01, freeze_step=2, weight_decay=0.01)
    a, b = opt_for(**kw), opt_for(cp, **kw)
    x, xb = make(1), make(1, cp)
    for step in range(1, 6):
        a.step(x, make(30 + step))
        strict_cupy.reset_syncs()
        b.step(xb, make(30 + step, cp))
        # the allreduce's status (warm-up) or the exclusion check at P = 1, the norms, and once the scaling
        assert strict_cupy.total_syncs() <= 3, dict(strict_cupy.syncs)
        np.testing.assert_allclose(flat(x), flat(xb), rtol=1e-12, atol=1e-14)
    assert isinstance(b.m, cp.ndarray)
