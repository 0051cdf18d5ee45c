"""The recipes torch users run between ``backward()`` and ``step()``, on every path, under MPI:

    bash scripts/mpirun.sh 4 900 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_recipes.py

(also at 1 and 2 ranks). Paths: DDP with slamb_comm's hook (``slamb_hook``; ``topk_hook`` under a
plain SGD), the plain torch.distributed ``DistributedOptimizer`` (gloo), and Horovod's; and SLAMB's
GPU path on both torch paths (``ddp-device``: the device kernels, the exchange launched from DDP's
hooks; ``plain-device``: from ``step()``), run through the strict CuPy double. Optimizers:
SLAMB, top-k with error feedback, 1-bit LAMB. Recipes: AMP's ``GradScaler`` (with and without
``unscale_`` and ``clip_grad_norm_``, and Horovod's idiom), an inf on one rank, clipping after
``backward()``, ``step(closure)``, accumulation with ``no_sync()``, bf16 autocast.

Every recipe is checked against its reference: the same run without the recipe where the
arithmetic is the same (bitwise: a GradScaler's power-of-two scale is exact, a closure is the
same computation), and the float64 dense formulas of docs/algorithm.md (``torch_reference``) where
the recipe changes the arithmetic (clipping). Failures are collected and raised on every rank
after the test's last collective. No test asserts a timing.
"""

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import slamb_comm  # noqa: E402
from slamb_comm.adapters import torch as st  # noqa: E402
from tests.support.torch_reference import (  # noqa: E402
    SHAPES, STARTS, THRESHOLD, RefSlamb, RefTopK, close, flat_params, grads_at, loss_of, make_model, maxdiff,
    topk_close, topk_counts,
)

from tests.support import strict_cupy  # noqa: E402  (the device paths)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

WORLD = MPI.COMM_WORLD
P, ME = WORLD.size, WORLD.rank
BAD = P - 1  # the rank whose input holds an inf
INF = float("inf")
KINDS = ["slamb", "topk", "onebit"]
PATHS = ["ddp", "plain", "horovod"]
DEVICE = ["ddp-device", "plain-device"]  # SLAMB's GPU path, on the strict double
CASES = [(p, k) for p in PATHS for k in KINDS] + [(p, "slamb") for p in DEVICE]
RATIO = 0.25


# ----------------------------------------------------------------------------- process groups
def inner_optimizer(kind, model, fused=None):
    if kind == "slamb":
        return st.SLAMB(model.parameters(), lr=0.02, ratio=RATIO, beta3=0.9, weight_decay=0.01, sync_interval=3,
                        dense_threshold=THRESHOLD, seed=5, fused=fused)
    if kind == "onebit":
        return st.OneBitLAMB(model.parameters(), lr=0.01, freeze_step=2, eps=1e-4)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.fixture
def build(request):
    """``build(path, kind, seed, amp=None)`` -> (model, net, opt): ``net`` is what the loss is
    computed with (the DDP module, or the model), ``opt`` what the user steps; ``amp``: the
    GradScaler, handed to the top-k exchange (its error buffers stay in unscaled units)."""
    def make(path, kind, seed=1, amp=None):
        device = path in DEVICE
        if device:  # SLAMB on flat buffers, its arrays the double's device arrays
            request.getfixturevalue("device_arrays")
            path = path.split("-")[0]
        model = make_model(seed)
        inner = inner_optimizer(kind, model, fused=True if device else None)
        named = model.named_parameters()
        topk = slamb_comm.TopK(RATIO)
        if path == "horovod":
            request.getfixturevalue("horovod")
            from slamb_comm.adapters import horovod as sh

            extra = {"compression": topk, "grad_scaler": amp} if kind == "topk" else {}
            return model, model, sh.DistributedOptimizer(inner, named_parameters=named, **extra)
        request.getfixturevalue("gloo")
        if path == "plain":
            extra = {"compression": topk, "grad_scaler": amp} if kind == "topk" else {}
            return model, model, st.DistributedOptimizer(inner, named_parameters=named, **extra)
        if kind == "onebit":
            pytest.skip("1-bit LAMB has no DDP hook: it runs through DistributedOptimizer")
        net = torch.nn.parallel.DistributedDataParallel(model)
        if kind == "slamb":
            opt = st.DistributedOptimizer(inner, named_parameters=named)
            net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
            return model, net, opt
        net.register_comm_hook(st.TopKHookState(model.named_parameters(), topk, grad_scaler=amp), st.topk_hook)
        return model, net, inner
    return make


@pytest.fixture
def device_arrays():
    """The strict CuPy double stands for CuPy and torch's CPU tensors reach the core as its device
    arrays (sharing their memory): SLAMB's GPU path runs on the CPU, for the test's duration."""
    with strict_cupy.install(), strict_cupy.torch_bridge():
        strict_cupy.Device.current = 0
        yield


# ----------------------------------------------------------------------------- helpers
MEASURED = {}  # test id -> {what: the largest difference seen}; written where SLAMB_RECIPES_REPORT says


def note(what, a, b):
    """Record the largest absolute difference of ``a`` and ``b`` under this test and ``what``."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("::")[-1]
    row = MEASURED.setdefault(test, {})
    row[what] = max(row.get(what, 0.0), float(maxdiff(a, b)))


@pytest.fixture(scope="module", autouse=True)
def report():
    """``SLAMB_RECIPES_REPORT=file.json``: rank 0 writes every measured difference there."""
    yield
    path = os.environ.get("SLAMB_RECIPES_REPORT")
    if path and ME == 0:
        with open(path, "w") as f:
            json.dump({"ranks": P, "measured": MEASURED}, f, indent=1, sort_keys=True)


def everyone(values):
    """Every rank's ``values`` (a flat float64 array) as a (P, n) array."""
    return np.asarray(WORLD.allgather(np.asarray(values, np.float64)))


def check(failed):
    """Raise on every rank if any rank failed (after the test's last collective)."""
    everyones = WORLD.allgather(list(failed))
    bad = {r: f for r, f in enumerate(everyones) if f}
    assert not bad, "; ".join(f"rank {r}: {', '.join(f[:4])}" for r, f in bad.items())


def scaler():
    return torch.amp.GradScaler("cpu", init_scale=1024.0)


def loss_at(net, t, poison=False):
    loss = loss_of(net, ME, t)
    return loss * INF if poison else loss


def plain_step(net, opt, t, clip=None, model=None):
    opt.zero_grad()
    loss_at(net, t).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def amp_step(net, opt, amp, t, recipe, poison=False, clip=None, model=None):
    """One step of an AMP recipe: 'step' (scaler.step does the unscaling), 'unscale' (unscale_,
    optionally clip_grad_norm_, then scaler.step), 'idiom' (Horovod's: synchronize(), unscale_,
    clip, then scaler.step under skip_synchronize())."""
    opt.zero_grad()
    amp.scale(loss_at(net, t, poison)).backward()
    if recipe == "idiom":
        opt.synchronize()
    if recipe in ("unscale", "idiom"):
        amp.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if recipe == "idiom":
        with opt.skip_synchronize():
            amp.step(opt)
    else:
        amp.step(opt)
    amp.update()


def exchanges(opt):
    """SLAMB momentum exchanges so far (every bucket's)."""
    return sum(c.stats.by_kind.get("masked_allreduce", slamb_comm.Traffic()).calls for c in opt.communicators)


def clipped(grads, max_norm):
    """Each rank's own gradient clipped as ``clip_grad_norm_`` does (float64)."""
    out = []
    for g in grads:
        norm = np.sqrt(sum(float(np.sum(g[a:a + n].astype(np.float32).astype(np.float64) ** 2))
                           for a, n in zip(STARTS, [int(np.prod(s)) for s in SHAPES])))
        out.append(g * min(1.0, max_norm / (norm + 1e-6)))
    return np.stack(out)


# ============================================================================= GradScaler
@pytest.mark.parametrize("path,kind", CASES)
def test_grad_scaler_gives_the_unscaled_run(build, path, kind):
    """``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` with a power-of-two
    scale is bitwise the run without a scaler: every step uses the unscaled gradients."""
    amp = scaler()
    model_a, net_a, opt_a = build(path, kind)
    model_b, net_b, opt_b = build(path, kind, amp=amp)
    failed = []
    for t in range(1, 6):
        plain_step(net_a, opt_a, t)
        amp_step(net_b, opt_b, amp, t, "step")
        note("vs the run without a scaler", flat_params(model_a), flat_params(model_b))
        if not np.array_equal(flat_params(model_a), flat_params(model_b)):
            failed.append(f"step {t}: {maxdiff(flat_params(model_a), flat_params(model_b)):.3g} from the run "
                          "without a scaler")
    if amp.get_scale() != 1024.0:
        failed.append(f"scale {amp.get_scale()}")
    check(failed)


# ============================================================================= an inf on one rank
@pytest.mark.parametrize("recipe", ["step", "unscale", "idiom"])
@pytest.mark.parametrize("path,kind", CASES)
def test_inf_on_one_rank_every_rank_skips_alike(build, path, kind, recipe):
    """An inf in one rank's loss at step 2: every rank's scaler skips step 2 and halves its scale,
    nothing moves anywhere, and the run goes on to the end -- equal, bitwise, to the same recipe
    run without step 2."""
    if recipe == "idiom" and path == "ddp" and kind == "topk":
        pytest.skip("DDP with topk_hook steps a plain torch optimizer: there is no synchronize()")
    clip = 0.05 if recipe != "step" else None
    amp, ref_amp = scaler(), scaler()
    model, net, opt = build(path, kind, amp=amp)
    ref_model, ref_net, ref_opt = build(path, kind, amp=ref_amp)
    failed = []
    for t in range(1, 9):  # 7 steps taken: the last, step 7, is a periodic sync (H = 3)
        before = flat_params(model)
        amp_step(net, opt, amp, t, recipe, poison=(t == 2 and ME == BAD), clip=clip, model=model)
        if t != 2:
            amp_step(ref_net, ref_opt, ref_amp, t, recipe, clip=clip, model=ref_model)
        if t == 2 and not np.array_equal(flat_params(model), before):
            failed.append("step 2 moved the parameters")
        scales = WORLD.allgather(amp.get_scale())
        if len(set(scales)) != 1 or scales[0] != (1024.0 if t < 2 else 512.0):
            failed.append(f"step {t}: scales {scales}")
        if not np.all(np.isfinite(flat_params(model))):
            failed.append(f"step {t}: parameters not finite")
    note("vs the run without step 2", flat_params(model), flat_params(ref_model))
    if not np.array_equal(flat_params(model), flat_params(ref_model)):
        failed.append(f"{maxdiff(flat_params(model), flat_params(ref_model)):.3g} from the run without step 2")
    if kind != "topk" and len({int(s["step"]) for s in opt.state.values()}) != 1:
        failed.append("step counts differ between tensors")
    if kind != "topk" and int(opt.state[model[0].weight]["step"]) != 7:
        failed.append(f"step count {int(opt.state[model[0].weight]['step'])}, want 7")
    rows = everyone(flat_params(model))
    if kind == "slamb" and not all(np.array_equal(rows[0], r) for r in rows):
        failed.append("parameters differ between ranks after the periodic sync")
    check(failed)


# ============================================================================= clipping after backward()
@pytest.mark.parametrize("path", PATHS + DEVICE)
def test_slamb_clipping_after_backward_is_the_idiom_and_section_1(build, path):
    """``clip_grad_norm_`` between ``backward()`` and ``step()`` gives bitwise what Horovod's
    idiom (synchronize, clip, step under skip_synchronize) gives, and docs/algorithm.md section 1 on
    each rank's clipped gradient; the momentum is exchanged once per step (where exchanges start
    in hooks, the first such step twice: its hooks' exchange is redone, and later steps exchange
    from step(); flat buffers without DDP exchange from step() from the start)."""
    model_a, net_a, opt_a = build(path, "slamb")
    model_b, net_b, opt_b = build(path, "slamb")
    ref = RefSlamb(flat_params(model_a), SHAPES, P, lr=0.02, wd=0.01, beta3=0.9, H=3)
    (comm,) = opt_a.communicators
    failed = []
    steps = 6
    for t in range(1, steps + 1):
        xs = everyone(flat_params(model_a))
        grads = clipped(np.stack([grads_at(xs[r], r, t) for r in range(P)]), 0.01)
        mask = np.asarray(comm.mask.select(t))
        plain_step(net_a, opt_a, t, clip=0.01, model=model_a)
        opt_b.zero_grad()
        loss_at(net_b, t).backward()
        opt_b.synchronize()
        torch.nn.utils.clip_grad_norm_(model_b.parameters(), 0.01)
        with opt_b.skip_synchronize():
            opt_b.step()
        ref.step(grads, mask)
        note("vs the synchronize/clip/skip_synchronize idiom", flat_params(model_a), flat_params(model_b))
        note("vs the float64 reference (section 1)", flat_params(model_a), ref.x[ME])
        if not np.array_equal(flat_params(model_a), flat_params(model_b)):
            failed.append(f"step {t}: {maxdiff(flat_params(model_a), flat_params(model_b)):.3g} from the idiom")
        if not close(flat_params(model_a), ref.x[ME]):
            failed.append(f"step {t}: {maxdiff(flat_params(model_a), ref.x[ME]):.3g} from section 1")
    want = steps if path == "plain-device" else steps + 1  # flat buffers without DDP start none in hooks
    for name, opt in (("clip", opt_a), ("idiom", opt_b)):
        if exchanges(opt) != want:
            failed.append(f"{name}: {exchanges(opt)} exchanges in {steps} steps, want {want}")
    check(failed)


@pytest.mark.parametrize("path", ["plain", "horovod"])
def test_topk_clipping_after_backward_exchanges_the_clipped_gradient(build, path):
    """Without ``synchronize()``, clipping after ``backward()`` clips each rank's own gradient
    and the exchange (docs/algorithm.md section 2) starts from it."""
    model, net, opt = build(path, "topk")
    twin = make_model(1)
    ref = RefTopK(twin, torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9), topk_counts(RATIO), P)
    failed = []
    for t in range(1, 5):
        xs = everyone(flat_params(model))
        grads = clipped(np.stack([grads_at(xs[r], r, t) for r in range(P)]), 0.01)
        plain_step(net, opt, t, clip=0.01, model=model)
        ref.apply(ref.exchange(grads, P, range(P)))
        note("vs the float64 reference (section 2)", flat_params(model), ref.x())
        if not topk_close(flat_params(model), ref.x()):
            failed.append(f"step {t}: {maxdiff(flat_params(model), ref.x()):.3g} from section 2")
    check(failed)


# ============================================================================= step(closure)
@pytest.mark.parametrize("path,kind", CASES)
def test_step_with_a_closure_calls_it_first(build, path, kind):
    """``opt.step(closure)`` is ``closure(); opt.step()``, bitwise, and returns the closure's loss."""
    model_a, net_a, opt_a = build(path, kind)
    model_b, net_b, opt_b = build(path, kind)
    failed = []
    for t in range(1, 6):
        plain_step(net_a, opt_a, t)

        def closure():
            opt_b.zero_grad()
            loss = loss_at(net_b, t)
            loss.backward()
            return loss

        loss = opt_b.step(closure)
        if not isinstance(loss, torch.Tensor) or not torch.isfinite(loss):
            failed.append(f"step {t}: step(closure) returned {loss!r}")
        note("vs closure(); step()", flat_params(model_a), flat_params(model_b))
        if not np.array_equal(flat_params(model_a), flat_params(model_b)):
            failed.append(f"step {t}: {maxdiff(flat_params(model_a), flat_params(model_b)):.3g} from closure(); step()")
    check(failed)


# ============================================================================= accumulation, autocast
@pytest.mark.parametrize("path", ["ddp", "ddp-device"])
def test_slamb_accumulation_with_no_sync_is_the_whole_batch(build, path):
    """Two half batches, the first under ``ddp.no_sync()``, equal one step on the whole batch."""
    model_a, net_a, opt_a = build(path, "slamb")
    model_b, net_b, opt_b = build(path, "slamb")
    failed = []
    for t in range(1, 5):
        g = torch.Generator().manual_seed(1009 * t + ME)
        x, y = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
        opt_a.zero_grad()
        torch.nn.functional.mse_loss(net_a(x), y).backward()
        opt_a.step()
        opt_b.zero_grad()
        with net_b.no_sync():
            (torch.nn.functional.mse_loss(net_b(x[:16]), y[:16]) / 2).backward()
        (torch.nn.functional.mse_loss(net_b(x[16:]), y[16:]) / 2).backward()
        opt_b.step()
        note("vs one step on the whole batch", flat_params(model_a), flat_params(model_b))
        if not np.allclose(flat_params(model_a), flat_params(model_b), rtol=1e-5, atol=1e-6):
            failed.append(f"step {t}: {maxdiff(flat_params(model_a), flat_params(model_b)):.3g} from the whole batch")
    if exchanges(opt_b) != 4:
        failed.append(f"{exchanges(opt_b)} exchanges in 4 steps")
    check(failed)


@pytest.mark.parametrize("path", ["ddp", "horovod"])
def test_slamb_bf16_autocast_steps_as_the_plain_path(build, path):
    """Under ``torch.autocast('cpu', torch.bfloat16)`` the DDP hook and Horovod take the same
    steps as the plain DistributedOptimizer (the same gradients, the same exchange): bitwise for
    DDP (the same gloo sums), within float32 rounding for Horovod (its sums over more than two
    ranks run in another order)."""
    model_a, net_a, opt_a = build(path, "slamb")
    model_b, net_b, opt_b = build("plain", "slamb")
    failed = []
    for t in range(1, 5):
        for net, opt in ((net_a, opt_a), (net_b, opt_b)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_at(net, t)
            loss.backward()
            opt.step()
        note("vs the plain DistributedOptimizer", flat_params(model_a), flat_params(model_b))
        same = (np.array_equal if path == "ddp" else lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6))
        if not same(flat_params(model_a), flat_params(model_b)):
            failed.append(f"step {t}: {maxdiff(flat_params(model_a), flat_params(model_b)):.3g} from the plain path")
    if not np.all(np.isfinite(flat_params(model_a))):
        failed.append("not finite")
    check(failed)
