"""Tests of the OneBitLAMB torch optimizer (slamb_comm.adapters.torch) alone and wrapped by both
DistributedOptimizers (torch.distributed over gloo, and Horovod), run under MPI:

    bash scripts/mpirun.sh 4 600 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_onebit_torch.py

(also at 1 and 2 ranks). mpirun only starts the processes and hands rank 0's free port to the
others; the optimizer's exchanges go through a gloo process group or through Horovod (those
tests skip where Horovod is not installed). Every rank recomputes every rank's gradient from
seeded data and runs the float64 simulation of docs/onebit_lamb.md (tests/support/onebit_reference.py)
for all ranks. Failures are collected and raised on every rank at the end of a test, after its
last collective, so that no rank is left waiting. No test asserts a timing.
"""

import hashlib
import io

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import slamb_comm  # noqa: E402
from tests.support.mpi_checks import Checks as _Checks, call  # noqa: E402
from slamb_comm.adapters import torch as st  # noqa: E402

from tests.support import onebit_reference as ref  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank
BAD = P - 1  # the rank that misbehaves in the failure tests


# ----------------------------------------------------------------------------- process groups
@pytest.fixture(params=["torch", "horovod"])
def wrap(request):
    """``wrap(optimizer, model)``: the backend's DistributedOptimizer around ``optimizer``."""
    if request.param == "torch":
        request.getfixturevalue("gloo")
        factory = st.DistributedOptimizer
    else:
        request.getfixturevalue("horovod")
        from slamb_comm.adapters import horovod as sh

        factory = sh.DistributedOptimizer
    return lambda opt, model: factory(opt, named_parameters=model.named_parameters())


# ----------------------------------------------------------------------------- model, data, checks
def make_model(seed, dtype=torch.float64):
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12), torch.nn.Tanh(),
                                torch.nn.Linear(12, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)
    return model.to(dtype)


def loss_of(model, rank, step, scale=1.0):
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1009 * step + rank)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(16, 3, generator=g, dtype=torch.float64).to(dtype)
    return torch.nn.functional.mse_loss(model(x), y) * scale


def flat(model):
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])


def grads_at(flat_x, rank, step):
    """Rank ``rank``'s per-tensor gradients (float64 model) at parameters ``flat_x``."""
    model = make_model(0)
    with torch.no_grad():
        at = 0
        for p in model.parameters():
            p.copy_(torch.from_numpy(flat_x[at:at + p.numel()].reshape(p.shape)))
            at += p.numel()
    loss_of(model, rank, step).backward()
    return [p.grad.reshape(-1).numpy().copy() for p in model.parameters()]


def train_step(model, opt, t, scale=1.0):
    opt.zero_grad()
    loss_of(model, ME, t, scale).backward()
    opt.step()


def step_of(opt, model):
    return {int(opt.state[p]["step"]) for p in model.parameters()}


def digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


class Checks(_Checks):
    RTOL, ATOL = 1e-9, 1e-11

    def same_everywhere(self, model, msg):
        self.true(len(set(WORLD.allgather(digest(flat(model))))) == 1, f"{msg}: parameters differ between ranks")


# ----------------------------------------------------------------------------- the spec, every step
OPTIONS = [dict(), dict(weight_decay=0.01, bias_correction=True, factor_threshold=0.3, coeff_beta=0.5)]


@pytest.mark.parametrize("kw", OPTIONS, ids=["deepspeed", "wd-bias-correction"])
def test_matches_the_float64_simulation_every_step(wrap, kw):
    """Warm-up (3 steps) and compression (5 steps): the wrapped OneBitLAMB is the float64
    simulation of docs/onebit_lamb.md for all P ranks, parameters after every step, and its
    per-parameter state (κ, φ, γ, the error buffers) at the end."""
    chk = Checks()
    kw = dict(lr=0.02, freeze_step=3, **kw)
    model = make_model(1)
    opt = wrap(st.OneBitLAMB(model.parameters(), **kw), model)
    chk.true(isinstance(opt, st.OneBitLAMB) and [c.size for c in opt.communicators] == [P], "one bucket over P ranks")
    params = list(model.parameters())
    sim = ref.OneBitLambReference([p.numel() for p in params], P, **kw)
    xr = [p.detach().reshape(-1).numpy().copy() for p in params]
    for t in range(1, 9):
        x = flat(model)  # the same on every rank (checked below): every rank's gradient, as that rank computes it
        grads = [grads_at(x, r, t) for r in range(P)]
        train_step(model, opt, t)
        sim.step(xr, grads)
        chk.close(flat(model), np.concatenate(xr), f"step {t}: parameters")
        chk.same_everywhere(model, f"step {t}")
        chk.true(step_of(opt, model) == {t}, f"step {t}: step count {step_of(opt, model)}")
    states = [opt.state[p] for p in params]
    chk.close([s["lamb_coeff_freeze"] for s in states], sim.kappa, "frozen LAMB coefficients", rtol=1e-12)
    chk.close([s["last_factor"] for s in states], sim.phi, "factors")
    chk.close([s["scaling_coeff"] for s in states], sim.gamma, "momentum scaling factors", rtol=1e-12)
    for s, m, v, f in zip(states, sim.m, sim.v, sim.f):
        chk.close(s["exp_avg"].reshape(-1), m, "exp_avg")
        chk.close(s["exp_avg_sq"].reshape(-1), v, "exp_avg_sq", rtol=1e-12, atol=0)
        chk.close(s["exp_avg_sq_fresh"].reshape(-1), f, "exp_avg_sq_fresh", atol=1e-14)
    if P > 1:
        chk.true(states[0]["exchange_rank"] == ME and states[0]["exchange_size"] == P, "exchange rank and size")
        chk.close(states[0]["worker_error"], sim.we[ME], "worker error", atol=1e-12)
        chk.close(states[0]["server_error"], sim.se[ME], "server error", atol=1e-12)
    else:
        chk.true("worker_error" not in states[0], "no error buffers at P = 1")
    kinds = opt.communicators[0].stats.by_kind
    chk.true(kinds["sync"].calls == 3 and (P == 1 or kinds["onebit_allreduce"].calls == 5), f"exchanges {kinds}")
    chk.done()


# ----------------------------------------------------------------------------- NaN on one rank
@pytest.mark.parametrize("buckets", [1, 2])
@pytest.mark.parametrize("freeze", [100, 1], ids=["warm-up", "compression"])
def test_nan_on_one_rank_skips_the_step_on_every_rank(wrap, freeze, buckets):
    """A NaN gradient on the last rank: every rank skips (all buckets, nothing changes) or, with
    on_nonfinite='raise', raises NonFiniteError; training goes on in step afterwards."""
    chk = Checks()
    model = make_model(3, torch.float32)
    params = list(model.parameters())
    groups = [{"params": params}] if buckets == 1 else [{"params": params[:2], "weight_decay": 0.01},
                                                        {"params": params[2:]}]
    opt = wrap(st.OneBitLAMB(groups, lr=0.02, freeze_step=freeze), model)
    chk.true(len(opt.communicators) == buckets, f"{len(opt.communicators)} buckets")
    train_step(model, opt, 1)
    train_step(model, opt, 2)
    before = flat(model)
    m_before = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params]).clone()
    _, err = call(train_step, model, opt, 3, scale=float("nan") if ME == BAD else 1.0)
    chk.true(err is None, f"skip mode raised {err!r}")
    chk.equal(flat(model), before, "a skipped step moved the parameters")
    chk.true(torch.equal(torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params]), m_before),
             "a skipped step changed the momentum")
    chk.true(opt.skipped_steps == 1 and step_of(opt, model) == {2}, f"skipped {opt.skipped_steps}, "
                                                                    f"step {step_of(opt, model)}")
    for g in opt.param_groups:
        g["on_nonfinite"] = "raise"
    _, err = call(train_step, model, opt, 3, scale=float("nan") if ME == BAD else 1.0)
    chk.true(isinstance(err, slamb_comm.NonFiniteError), f"raise mode: {err!r}")
    chk.equal(flat(model), before, "a refused step moved the parameters")
    for g in opt.param_groups:
        g["on_nonfinite"] = "skip"
    train_step(model, opt, 4)
    chk.true(step_of(opt, model) == {3}, f"the step after the skipped ones: step {step_of(opt, model)}")
    chk.true(np.isfinite(flat(model)).all() and not np.array_equal(flat(model), before), "no progress after a skip")
    chk.same_everywhere(model, "after the skipped steps")
    chk.done()


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_checkpoint_round_trip_continues_bitwise(wrap, dtype):
    """Each rank saves its own state in the compression stage (torch.save), a new model and
    optimizer load it, and the resumed run is bitwise the uninterrupted one."""
    chk = Checks()
    kw = dict(lr=0.02, freeze_step=2, weight_decay=0.01)
    model = make_model(4, dtype)
    opt = wrap(st.OneBitLAMB(model.parameters(), **kw), model)
    for t in range(1, 4):
        train_step(model, opt, t)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for t in range(4, 7):
        train_step(model, opt, t)
    want = flat(model)
    model2 = make_model(99, dtype)
    opt2 = wrap(st.OneBitLAMB(model2.parameters(), **kw), model2)
    buf.seek(0)
    saved = torch.load(buf)
    first = saved["opt"]["state"][0]
    chk.true(P == 1 or (first["exchange_rank"] == ME and first["worker_error"].dtype == torch.float32
                        and float(first["worker_error"].abs().sum()) > 0), "this rank's error buffers are saved")
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    chk.true(step_of(opt2, model2) == {3}, f"loaded step {step_of(opt2, model2)}")
    for t in range(4, 7):
        train_step(model2, opt2, t)
    chk.equal(flat(model2), want, "the resumed run is not bitwise the same")
    chk.done()


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("stage", ["warm-up", "compression"])
def test_changed_parameter_raises_on_every_rank_and_changes_nothing(wrap, stage):
    chk = Checks()
    model = make_model(5, torch.float32)
    opt = wrap(st.OneBitLAMB(model.parameters(), lr=0.02, freeze_step=100 if stage == "warm-up" else 1), model)
    train_step(model, opt, 1)
    before = flat(model)
    bias = model[2].bias
    kept = bias.data
    opt.zero_grad()
    loss_of(model, ME, 2).backward()
    if ME == BAD:
        bias.data = torch.zeros(5)
        bias.grad = torch.zeros(5)
    _, err = call(opt.step)
    if ME == BAD:
        chk.true(isinstance(err, slamb_comm.LayoutError) and "changed shape" in str(err), f"here: {err!r}")
        bias.data = kept
    else:
        chk.true(isinstance(err, slamb_comm.PeerError) and err.ranks == (BAD,), f"elsewhere: {err!r}")
    chk.equal(flat(model), before, "the refused step moved the parameters")
    chk.true(step_of(opt, model) == {1}, f"step {step_of(opt, model)}")
    train_step(model, opt, 3)  # training goes on once the parameter is back
    chk.true(step_of(opt, model) == {2}, f"step after the refused one: {step_of(opt, model)}")
    chk.same_everywhere(model, "after the refused step")
    chk.done()


# ----------------------------------------------------------------------------- Horovod-style idioms
def test_synchronize_skip_synchronize_zero_grad_and_no_gradient(wrap):
    """``synchronize()`` + clipping + ``skip_synchronize()`` equals clipping before a plain
    ``step()`` (each rank clips its own gradient); ``zero_grad()`` between backward and step is
    refused; a step without any gradient changes nothing."""
    chk = Checks()
    a, b = make_model(7, torch.float32), make_model(7, torch.float32)
    oa = wrap(st.OneBitLAMB(a.parameters(), lr=0.02, freeze_step=2), a)
    ob = wrap(st.OneBitLAMB(b.parameters(), lr=0.02, freeze_step=2), b)
    for t in range(1, 5):
        oa.zero_grad()
        loss_of(a, ME, t).backward()
        torch.nn.utils.clip_grad_norm_(a.parameters(), 0.05)
        oa.step()
        ob.zero_grad()
        loss_of(b, ME, t).backward()
        if t == 1:
            _, err = call(ob.zero_grad)
            chk.true(isinstance(err, AssertionError), f"zero_grad before the step: {err!r}")
        ob.synchronize()
        torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
        with ob.skip_synchronize():
            ob.step()
    chk.equal(flat(b), flat(a), "synchronize/skip_synchronize differs from a plain step")
    before = flat(b)
    ob.zero_grad()
    ob.step()
    chk.equal(flat(b), before, "a step without gradients moved the parameters")
    chk.true(step_of(ob, b) == {4}, f"a step without gradients counted: {step_of(ob, b)}")
    chk.same_everywhere(b, "end")
    chk.done()


def test_horovod_resume_idiom_broadcast_optimizer_state(horovod):
    """Rank 0 loads a checkpoint, then ``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state``:
    every rank continues from rank 0's state (the other ranks' error buffers restart at zero),
    in step, without a hang."""
    hvd = horovod
    from slamb_comm.adapters import horovod as sh

    chk = Checks()
    kw = dict(lr=0.02, freeze_step=2)
    model = make_model(8, torch.float32)
    opt = sh.DistributedOptimizer(sh.OneBitLAMB(model.parameters(), **kw), named_parameters=model.named_parameters())
    for t in range(1, 4):
        train_step(model, opt, t)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    model2 = make_model(99, torch.float32)
    opt2 = sh.DistributedOptimizer(sh.OneBitLAMB(model2.parameters(), **kw), named_parameters=model2.named_parameters())
    if ME == 0:
        buf.seek(0)
        saved = torch.load(buf)
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt2, root_rank=0)
    chk.equal(flat(model2), flat(model), "broadcast parameters")
    for t in range(4, 6):
        train_step(model2, opt2, t)
    chk.true(step_of(opt2, model2) == {5}, f"step {step_of(opt2, model2)}")
    chk.true(np.isfinite(flat(model2)).all(), "finite")
    chk.same_everywhere(model2, "after the resume")
    chk.done()


# ----------------------------------------------------------------------------- alone (no collectives)
def test_alone_it_is_lamb_during_the_warm_up_and_the_rule_after():
    """Single process: with bias_correction and freeze_step beyond the run it is docs/algorithm.md's
    LAMB (= SLAMB at ratio 1 alone); through the compression stage it is the simulation at P = 1."""
    kw = dict(lr=0.02, eps=1e-6, weight_decay=0.01)
    a, b = make_model(6), make_model(6)
    oa = st.OneBitLAMB(a.parameters(), freeze_step=100, bias_correction=True, c_min=0.01, c_max=1000.0, **kw)
    ob = st.SLAMB(b.parameters(), ratio=1.0, c_min=0.01, c_max=1000.0, value_dtype="float64", **kw)
    for t in range(1, 7):
        train_step(a, oa, t)
        train_step(b, ob, t)
        np.testing.assert_allclose(flat(a), flat(b), rtol=1e-12, atol=1e-14, err_msg=f"step {t}")
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(oa.state[pa]["exp_avg"], ob.state[pb]["exp_avg"], rtol=1e-12, atol=1e-15)
    kw = dict(lr=0.02, freeze_step=2, factor_threshold=0.3)
    model = make_model(6)
    opt = st.OneBitLAMB(model.parameters(), **kw)
    sim = ref.OneBitLambReference([p.numel() for p in model.parameters()], 1, **kw)
    xr = [p.detach().reshape(-1).numpy().copy() for p in model.parameters()]
    for t in range(1, 7):
        grads = [grads_at(flat(model), ME, t)]
        train_step(model, opt, t)
        sim.step(xr, grads)
        np.testing.assert_allclose(flat(model), np.concatenate(xr), rtol=1e-10, atol=1e-12, err_msg=f"step {t}")
    assert opt.communicators[0].size == 1 and "onebit_allreduce" not in opt.communicators[0].stats.by_kind


@pytest.mark.parametrize("kind", ["onebit", "slamb"])
def test_add_param_group_after_wrapping_is_refused(wrap, kind):
    """Before wrapping a group may be added; after, the hooks and buckets are fixed: a named
    NotImplementedError on every rank, and the optimizer keeps its groups."""
    a, b = make_model(3, torch.float32), make_model(4, torch.float32)
    make = (lambda ps: st.OneBitLAMB(ps, lr=0.01, freeze_step=2)) if kind == "onebit" else \
        (lambda ps: st.SLAMB(ps, lr=0.01, ratio=0.5))
    opt = make(list(a.parameters())[:2])
    opt.add_param_group({"params": list(a.parameters())[2:]})  # allowed: not wrapped yet
    opt = wrap(opt, a)
    n = len(opt.param_groups)
    with pytest.raises(NotImplementedError, match=f"add parameter groups to the {type(opt).__name__} "
                                                  "optimizer before wrapping"):
        opt.add_param_group({"params": list(b.parameters())})
    assert len(opt.param_groups) == n
    train_step(a, opt, 1)  # and it still steps
