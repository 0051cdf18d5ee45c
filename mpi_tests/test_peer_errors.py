"""docs/failures.md's errors under mpirun (issue 46), through the torch adapter on a gloo group over the MPI
ranks and through the Horovod adapter:

    bash scripts/mpirun.sh 2 300 python3 -m pytest -q --with-mpi mpi_tests/test_peer_errors.py

An invalid option on the last rank only (SLAMB's, or a TopK compression's) raises ConfigError there and PeerError naming that rank and the
option elsewhere; a valid option that differs raises ConfigError on every rank naming it; a NaN on the last
rank is logged on every rank with that rank; the construction's warning when compression cannot save comes
once, on rank 0 only; a dtype error on one rank names what it passed and the fix. tests/test_peer_errors.py
checks the same under torchrun. Each test asserts after its last collective (Checks), so no rank waits."""

import contextlib
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("horovod.torch")

import slamb_comm  # noqa: E402
from slamb_comm.adapters import horovod as sh  # noqa: E402
from slamb_comm.adapters import torch as st  # noqa: E402
from tests.support import strict_cupy  # noqa: E402
from tests.support.mpi_checks import ME, WORLD, Checks, call  # noqa: E402
from tests.support.torch_reference import THRESHOLD, loss_of, make_model  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

P = WORLD.size
BAD = P - 1
KW = dict(lr=0.02, ratio=0.25, beta3=0.9, dense_threshold=THRESHOLD)


@pytest.fixture(scope="module", autouse=True)
def both(gloo, horovod):
    """A gloo group over the MPI ranks (the torch adapter's) and Horovod, for the whole module."""
    yield


def wrapped(frontend, model, opt):
    adapter = st if frontend == "torch" else sh
    return adapter.DistributedOptimizer(opt, named_parameters=model.named_parameters())


def step(net, opt, t, nan=False, recipe=None):
    """One step; ``nan``: a NaN loss, or with ``recipe="nan after backward"`` NaN gradients written after
    ``backward()``; ``recipe="clip"``: clip_grad_norm_ between backward() and step()."""
    opt.zero_grad()
    (loss_of(net, ME, t) * (float("nan") if nan and recipe != "nan after backward" else 1.0)).backward()
    if recipe == "clip":
        torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
    elif nan and recipe == "nan after backward":  # after the exchange packed from DDP's hooks was agreed
        with torch.no_grad():
            for p in net.parameters():
                p.grad.fill_(float("nan"))
    opt.step()


@pytest.mark.parametrize("frontend", ["torch", "horovod"])
@pytest.mark.parametrize("option,value", [("lr", -1.0), ("ratio", 2.0)])
def test_an_invalid_option_on_one_rank_raises_on_every_rank(frontend, option, value):
    if P == 1:
        pytest.skip("needs two ranks")
    model = make_model(1)
    adapter = st if frontend == "torch" else sh
    kw = {**KW, **({option: value} if ME == BAD else {})}
    _, err = call(lambda: wrapped(frontend, model, adapter.SLAMB(model.parameters(), **kw)))
    chk = Checks()
    if ME == BAD:
        chk.raised(err, slamb_comm.ConfigError, f"{option}={value} here")
        chk(option in str(err), f"the ConfigError names no option: {err}")
    else:
        chk.raised(err, slamb_comm.PeerError, f"{option}={value} on rank {BAD}", ranks=(BAD,))
        chk(f"rank {BAD}: ConfigError: {option}" in str(err), f"the PeerError names no option: {err}")
    chk.done()


@pytest.mark.parametrize("frontend", ["torch", "horovod"])
def test_an_invalid_topk_ratio_on_one_rank_raises_on_every_rank(frontend):
    """slamb_comm.TopK(ratio=2.0) on one rank of a job keeps its error until the distributed optimizer's
    construction agreement: ConfigError there, PeerError naming it and the option on the others."""
    if P == 1:
        pytest.skip("needs two ranks")
    model = make_model(3)
    adapter = st if frontend == "torch" else sh
    comp = slamb_comm.TopK(2.0 if ME == BAD else 0.1)
    _, err = call(lambda: adapter.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                                       named_parameters=model.named_parameters(), compression=comp))
    chk = Checks()
    if ME == BAD:
        chk.raised(err, slamb_comm.ConfigError, "ratio=2.0 here")
    else:
        chk.raised(err, slamb_comm.PeerError, f"ratio=2.0 on rank {BAD}", ranks=(BAD,))
        chk(f"rank {BAD}: ConfigError: ratio must be in (0, 1], got 2.0" in str(err), f"no option named: {err}")
    chk.done()


@pytest.mark.parametrize("frontend", ["torch", "horovod"])
def test_a_valid_lr_that_differs_on_one_rank_raises_config_error_on_every_rank(frontend):
    if P == 1:
        pytest.skip("needs two ranks")
    model = make_model(2)
    opt = wrapped(frontend, model, st.SLAMB(model.parameters(), **{**KW, "lr": 0.03 if ME == BAD else 0.02}))
    _, err = call(step, model, opt, 1)
    chk = Checks()
    chk.raised(err, slamb_comm.ConfigError, "lr differs")
    chk(f"rank(s) [{BAD}] differ from rank 0 in lr" in str(err), f"the error names no rank or option: {err}")
    chk.done()


def _slamb(frontend, **kw):
    return lambda model: wrapped(frontend, model, st.SLAMB(model.parameters(), **{**KW, **kw}))


NAN_CASES = {  # (the optimizer, under DDP with slamb_hook, a recipe between backward() and step())
    "torch hooks": (_slamb("torch"), False, None),
    "torch DDP hooks": (_slamb("torch"), True, None),
    "torch deferred": (_slamb("torch"), False, "clip"),
    "torch device, DDP": (_slamb("torch", fused=True), True, None),
    "torch device, DDP, clipped": (_slamb("torch", fused=True), True, "clip"),
    "torch device, DDP, NaN after backward": (_slamb("torch", fused=True), True, "nan after backward"),
    "horovod SLAMB": (_slamb("horovod"), False, None),
    "horovod 1-bit LAMB": (lambda m: wrapped("horovod", m, st.OneBitLAMB(m.parameters(), lr=0.01)), False, None),
    "horovod top-k": (lambda m: sh.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01),
                                                        named_parameters=m.named_parameters(),
                                                        compression=slamb_comm.TopK(0.1)), False, None),
}


@pytest.mark.parametrize("case", list(NAN_CASES))
def test_a_nan_on_one_rank_is_logged_with_that_rank(case, caplog):
    """A NaN in the last rank's loss at step 4 (after DDP rebuilt its buckets, so that the device exchange is
    packed from DDP's hooks): every rank skips the step and its log names that rank."""
    make, use_ddp, recipe = NAN_CASES[case]
    with contextlib.ExitStack() as stack:
        if "device" in case:  # the core's kernels, on the strict double of CuPy
            stack.enter_context(strict_cupy.install())
            stack.enter_context(strict_cupy.torch_bridge())
            strict_cupy.Device.current = 0
        model = make_model(3)
        net = torch.nn.parallel.DistributedDataParallel(model) if use_ddp else model
        opt = make(model)
        if use_ddp:
            net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
        with caplog.at_level(logging.WARNING, logger="slamb_comm"):
            for t in range(1, 6):
                step(net, opt, t, nan=t == 4 and ME == BAD, recipe=recipe)
    skips = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    chk = Checks()
    chk(len(skips) == 1 and f"rank(s) [{BAD}]" in skips[0], f"{case}: the skip's log: {skips}")
    chk(opt.skipped_steps == 1, f"{case}: {opt.skipped_steps} steps skipped")
    chk.done()


def test_the_payload_warning_comes_once_on_rank_0(caplog):
    """A model of small tensors only (all under dense_threshold): one warning at construction, on rank 0 only,
    through each adapter; a model the mask compresses: none."""
    small = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with caplog.at_level(logging.WARNING, logger="slamb_comm"):
        for frontend in ("torch", "horovod"):
            wrapped(frontend, small, st.SLAMB(small.parameters(), lr=0.01))
        big = torch.nn.Sequential(torch.nn.Linear(100, 200))
        wrapped("torch", big, st.SLAMB(big.parameters(), lr=0.01, dense_threshold=1000))
    warned = [r.getMessage() for r in caplog.records if "of a dense allreduce's bytes" in r.getMessage()]
    chk = Checks()
    chk(len(warned) == (2 if ME == 0 else 0), f"warnings: {warned}")
    chk(all("Lower dense_threshold=" in w for w in warned), f"warnings: {warned}")
    chk.done()


def test_a_mixed_dtype_list_on_one_rank_names_what_it_passed_and_the_fix():
    if P == 1:
        pytest.skip("needs two ranks")
    arrays = [np.zeros((30, 30), np.float32), np.zeros(30, np.float32)]
    if ME == BAD:
        arrays[1] = arrays[1].astype(np.float16)
    _, err = call(slamb_comm.Communicator, slamb_comm.MPITransport(), arrays, ratio=0.1)
    chk = Checks()
    if ME == BAD:
        chk.raised(err, slamb_comm.DTypeError, "mixed dtypes here")
        chk("you passed 2 arrays" in str(err) and "array 1 is float16" in str(err) and "astype" in str(err),
            f"the DTypeError: {err}")
    else:
        chk.raised(err, slamb_comm.PeerError, f"mixed dtypes on rank {BAD}", ranks=(BAD,))
        chk(f"rank {BAD}: DTypeError: the arrays of one communicator must share one dtype" in str(err),
            f"the PeerError: {err}")
    chk.done()
