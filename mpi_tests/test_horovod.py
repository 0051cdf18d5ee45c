"""Tests of the Horovod/PyTorch adapter (slamb_comm.adapters.horovod), run under MPI:

    bash scripts/mpirun.sh 4 900 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_horovod.py

(also at 1 and 2 ranks; horovodrun works too). Every rank can recompute every rank's
gradient from seeded per-rank data, so each test compares the library against a dense
single-process reference of docs/algorithm.md that it computes itself: section 1 (SLAMB) in
float64 NumPy, section 2 (top-k with error feedback) in float32 with the wrapped torch
optimizer. No test asserts a timing.
"""

import io
import math
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("horovod.torch")

import slamb_comm  # noqa: E402
from slamb_comm.adapters import horovod as sh  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield hvd


# ----------------------------------------------------------------------------- model and data
D_IN, D_OUT, BATCH = 6, 3, 16
# weights 6x32=192 and 24x3=72 stay dense (below the threshold), 32x32 and 32x24 are
# compressible, the biases are 1-D (always dense).
THRESHOLD = 300


def make_model(seed=0, dtype=torch.float32, extra=False):
    layers = [torch.nn.Linear(D_IN, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
              torch.nn.Linear(32, 24), torch.nn.Tanh(), torch.nn.Linear(24, D_OUT)]
    model = torch.nn.Sequential(*layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)
    return model.to(dtype)


def batch(rank, step, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(100003 * salt + 1009 * step + rank)
    x = torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, D_OUT, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def loss_of(model, rank, step, salt=0):
    dtype = next(model.parameters()).dtype
    x, y = batch(rank, step, dtype, salt)
    return torch.nn.functional.mse_loss(model(x), y)


def flat_params(model):
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])


def grads_at(flat_x, shapes, rank, step, dtype=torch.float32, salt=0):
    """This rank's gradient at parameters ``flat_x`` (any rank can compute any rank's), as
    float64, computed in ``dtype``. float32 by default, as the ranks compute it: SLAMB divides
    the rank-averaged momentum by the *local* sqrt(v), so an element whose local gradient
    nearly cancels is ill-conditioned, and a float64 gradient there would differ from the
    ranks' float32 one by more than any fixed tolerance."""
    model = make_model(0, dtype)
    with torch.no_grad():
        at = 0
        for p, s in zip(model.parameters(), shapes):
            n = int(np.prod(s))
            p.copy_(torch.from_numpy(np.asarray(flat_x[at:at + n]).reshape(s)).to(dtype))
            at += n
    loss_of(model, rank, step, salt).backward()
    return np.concatenate([p.grad.reshape(-1).double().numpy() for p in model.parameters()])


def everyone(t, name):
    """This tensor from every rank, stacked (rank-major)."""
    return hvd.allgather(t.detach().reshape(1, -1), name=name)


def same_on_all_ranks(model, name):
    x = torch.from_numpy(flat_params(model))
    allx = everyone(x, name)
    return all(torch.equal(allx[0], allx[r]) for r in range(allx.shape[0]))


def train(model, opt, steps, start=1, salt=0, after_step=None):
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, hvd.rank(), t, salt).backward()
        opt.step()
        if after_step is not None:
            after_step(t)


def slamb_dist(model, **kw):
    kw.setdefault("dense_threshold", THRESHOLD)
    return sh.DistributedOptimizer(sh.SLAMB(model.parameters(), **kw), named_parameters=model.named_parameters())


# ----------------------------------------------------------------------------- references
class RefSlamb:
    """docs/algorithm.md section 1, densely, for all P ranks at once, in float64."""

    def __init__(self, x0, shapes, P, lr, betas=(0.9, 0.999), eps=1e-6, wd=0.0, beta3=0.99, H=100,
                 c_min=0.01, c_max=1000.0):
        self.shapes, self.P = shapes, P
        self.sizes = [int(np.prod(s)) for s in shapes]
        self.starts = np.cumsum([0] + self.sizes[:-1])
        n = sum(self.sizes)
        self.x = np.tile(np.asarray(x0, np.float64), (P, 1))
        self.m, self.v = np.zeros((P, n)), np.zeros((P, n))
        self.f = np.ones(n)
        self.lr, self.b1, self.b2, self.eps, self.b3, self.H = lr, betas[0], betas[1], eps, beta3, H
        self.wd = np.repeat(np.broadcast_to(np.asarray(wd, np.float64), (len(shapes),)), self.sizes)
        self.c_min, self.c_max = c_min, c_max
        self.t = 0

    def _per_layer(self, a):
        return np.sqrt(np.add.reduceat(a, self.starts))

    def _phi(self, xn, un):
        ok = (xn > 0) & (un > 0)
        return np.where(ok, np.clip(xn / np.where(ok, un, 1.0), self.c_min, self.c_max), 1.0)

    def step(self, grads, mask, lr=None):
        lr = self.lr if lr is None else lr
        self.t = t = self.t + 1
        b1, b2 = self.b1, self.b2
        self.m = b1 * self.m + (1 - b1) * grads                      # 1. local moments
        self.v = b2 * self.v + (1 - b2) * grads * grads
        self.m[:, mask] = self.m[:, mask].mean(axis=0)               # 3. masked momentum mean
        self.f = self.b3 * self.f                                    # 4. freshness
        self.f[mask] = 1.0
        fresh = self.f == 1.0
        for r in range(self.P):
            mhat, vhat = self.m[r] / (1 - b1 ** t), self.v[r] / (1 - b2 ** t)
            u = mhat / (np.sqrt(vhat) + self.eps) + self.wd * self.x[r]   # 5. Adam direction
            x2, u2 = self.x[r] ** 2, u ** 2                          # 6. trust ratios on S and A
            phi_s = self._phi(self._per_layer(x2 * fresh), self._per_layer(u2 * fresh))
            phi_a = self._phi(self._per_layer(x2 * ~fresh), self._per_layer(u2 * ~fresh))
            phi_s, phi_a = np.repeat(phi_s, self.sizes), np.repeat(phi_a, self.sizes)
            rate = lr * phi_s * self.f + lr / math.sqrt(self.P) * phi_a * (1 - self.f)
            self.x[r] = self.x[r] - rate * u                         # 7. element-wise update
        if (t - 1) % self.H == 0:                                    # 8. periodic sync
            self.x[:] = self.x.mean(axis=0)


def lamb_reference(x0, shapes, grads_fn, steps, lr_at, wds, betas=(0.9, 0.999), eps=1e-6, c_min=0.01, c_max=1000.0):
    """Plain LAMB, per tensor, from its formulas (float64)."""
    sizes = [int(np.prod(s)) for s in shapes]
    xs = np.split(np.asarray(x0, np.float64).copy(), np.cumsum(sizes)[:-1])
    ms = [np.zeros_like(x) for x in xs]
    vs = [np.zeros_like(x) for x in xs]
    out = []
    for t in range(1, steps + 1):
        gs = np.split(grads_fn(np.concatenate(xs), t), np.cumsum(sizes)[:-1])
        for i, (x, g) in enumerate(zip(xs, gs)):
            ms[i] = betas[0] * ms[i] + (1 - betas[0]) * g
            vs[i] = betas[1] * vs[i] + (1 - betas[1]) * g * g
            u = (ms[i] / (1 - betas[0] ** t)) / (np.sqrt(vs[i] / (1 - betas[1] ** t)) + eps) + wds[i] * x
            xn, un = np.linalg.norm(x), np.linalg.norm(u)
            phi = 1.0 if xn == 0 or un == 0 else min(max(xn / un, c_min), c_max)
            xs[i] = x - lr_at(t) * phi * u
        out.append(np.concatenate(xs))
    return out


def close(a, b, rtol=2e-4, atol=2e-5):
    return np.allclose(a, b, rtol=rtol, atol=atol)


# ============================================================================= SLAMB vs section 1
# fused=True: flat buffers (the default on CUDA), the core's whole-buffer step from step()
@pytest.mark.parametrize("ratio,value_dtype,block,fused", [
    (0.1, "float32", 1, False), (1.0, "float32", 1, False), (0.1, "float16", 1, False), (0.1, "float32", 64, False),
    (0.1, "float32", 1, True), (0.1, "float16", 1, True), (1.0, "float32", 1, True)])
def test_slamb_matches_dense_reference_every_step(ratio, value_dtype, block, fused):
    P, rank, steps, H = hvd.size(), hvd.rank(), 22, 8
    model = make_model(1)
    shapes = [tuple(p.shape) for p in model.parameters()]
    opt = slamb_dist(model, lr=0.02, ratio=ratio, beta3=0.9, sync_interval=H, weight_decay=0.01,
                     value_dtype=value_dtype, seed=7, block=block, fused=fused)
    ref = RefSlamb(flat_params(model), shapes, P, lr=0.02, wd=0.01, beta3=0.9, H=H)
    (comm,) = opt.communicators
    assert comm.size == P and comm.mask.block == block
    lay = comm.layout
    assert lay.dense == [False if (len(s) == 2 and np.prod(s) >= THRESHOLD) else True for s in shapes]
    assert sum(not d for d in lay.dense) == 2
    tol = dict(rtol=2e-4, atol=2e-5) if value_dtype == "float32" else dict(rtol=2e-2, atol=2e-3)
    for t in range(1, steps + 1):
        grads = np.stack([grads_at(ref.x[r], shapes, r, t) for r in range(P)])
        mask = np.asarray(comm.mask.select(t))
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        opt.step()
        ref.step(grads, mask)
        mine = flat_params(model)
        assert np.allclose(mine, ref.x[rank], **tol), (t, np.abs(mine - ref.x[rank]).max())
        assert int(opt.state[next(iter(model.parameters()))]["step"]) == t
    if ratio == 1.0:
        assert np.all(ref.f == 1.0)


def test_cyclic_mask_is_shared_bounded_and_covering():
    model = make_model(2)
    opt = slamb_dist(model, ratio=0.25, seed=11)
    (comm,) = opt.communicators
    lay = comm.layout
    C = math.ceil(1 / 0.25)
    dense = np.asarray(lay.dense_index)
    seen = []
    for t in range(1, C + 1):
        sel = np.sort(np.asarray(comm.mask.select(t)))
        assert np.isin(dense, sel).all()
        seen.append(np.setdiff1d(sel, dense))
        mine = torch.from_numpy(sel.astype(np.int64))
        allsel = everyone(mine, f"mask.{t}")
        assert all(torch.equal(allsel[0], allsel[r]) for r in range(hvd.size()))
    comp = np.concatenate(seen)
    assert np.array_equal(np.sort(comp), np.sort(np.asarray(lay.compressible_index)))  # each exactly once
    assert np.array_equal(np.sort(np.asarray(comm.mask.select(C + 1))), np.sort(np.asarray(comm.mask.select(1))))


def test_ratio1_single_process_is_lamb_with_schedule_and_group_weight_decay():
    """SLAMB alone (no DistributedOptimizer: P = 1), ratio 1 == LAMB from its formulas,
    with an lr scheduler and per-group weight decay; at hvd.size() == 1 also wrapped."""
    steps = 20
    variants = ["alone"] + (["wrapped"] if hvd.size() == 1 else [])
    for variant in variants:
        model = make_model(3)
        shapes = [tuple(p.shape) for p in model.parameters()]
        params = list(model.parameters())
        groups = [{"params": params[0::2], "weight_decay": 0.05}, {"params": params[1::2], "weight_decay": 0.0}]
        opt = sh.SLAMB(groups, lr=0.01, ratio=1.0, dense_threshold=THRESHOLD)
        if variant == "wrapped":
            opt = sh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        wds = [0.05 if i % 2 == 0 else 0.0 for i in range(len(params))]
        # the optimizer orders tensors group by group; the reference works in model order
        x0 = flat_params(model)
        ref = lamb_reference(x0, shapes, lambda x, t: grads_at(x, shapes, hvd.rank(), t), steps,
                             lambda t: 0.01 / (1.0 + 0.1 * (t - 1)), wds)
        for t in range(1, steps + 1):
            opt.zero_grad()
            loss_of(model, hvd.rank(), t).backward()
            opt.step()
            sched.step()
            assert close(flat_params(model), ref[t - 1]), (variant, t)


@pytest.mark.parametrize("fused", [False, True])
def test_params_bitwise_equal_right_after_periodic_sync(fused):
    H = 4
    model = make_model(4)
    opt = slamb_dist(model, lr=0.02, ratio=0.1, sync_interval=H, fused=fused)
    checks = []

    def after(t):
        if (t - 1) % H == 0:
            checks.append((t, same_on_all_ranks(model, f"sync.{t}")))

    train(model, opt, 10, after_step=after)
    assert [t for t, _ in checks] == [1, 5, 9]
    assert all(ok for _, ok in checks), checks


# ============================================================================= top-k vs section 2
def _topk_reference_step(errors, grads32, ratio):
    """One exchange of section 2 for all ranks, in float32 like the wire; returns the mean."""
    P = len(grads32)
    mean = np.zeros_like(grads32[0])
    for r in range(P):
        c = grads32[r] + errors[r]
        dec = np.zeros_like(c)
        at = 0
        for n in SIZES:
            k = slamb_comm.k_elems(ratio, n)
            seg = c[at:at + n]
            idx = np.argpartition(np.abs(seg), n - k)[n - k:]
            dec[at + idx] = seg[idx]
            at += n
        errors[r] = c - dec
        mean[dec != 0] += dec[dec != 0]
    return mean * np.float32(1.0 / P)


SIZES = [int(np.prod(tuple(p.shape))) for p in make_model(0).parameters()]


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("ratio", [0.1, 1.0])
def test_topk_exchange_matches_section2(opt_name, ratio):
    P, rank, steps = hvd.size(), hvd.rank(), 12
    make_opt = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}[opt_name]
    model = make_model(5)
    ref_model = make_model(5)
    opt = sh.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                  compression=sh.TopK(ratio))
    assert isinstance(opt, {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[opt_name])
    ref_opt = make_opt(ref_model.parameters())
    shapes = [tuple(p.shape) for p in model.parameters()]
    errors = [np.zeros(sum(SIZES), np.float32) for _ in range(P)]
    sent_total = [np.zeros(sum(SIZES), np.float64) for _ in range(P)]
    grad_total = [np.zeros(sum(SIZES), np.float64) for _ in range(P)]
    for t in range(1, steps + 1):
        x = flat_params(ref_model)
        grads32 = [grads_at(x, shapes, r, t).astype(np.float32) for r in range(P)]
        before = [e.copy() for e in errors]
        mean = _topk_reference_step(errors, grads32, ratio)
        for r in range(P):  # nothing is lost: everything sent plus the error is everything computed
            grad_total[r] += grads32[r]
            sent_total[r] += (grads32[r] + before[r]) - errors[r]
            assert np.allclose(sent_total[r] + errors[r], grad_total[r], atol=1e-5)
        if ratio == 1.0:
            assert np.allclose(mean, np.mean(grads32, axis=0), rtol=1e-6, atol=1e-7)
        at = 0
        for p in ref_model.parameters():
            n = p.numel()
            p.grad = torch.from_numpy(mean[at:at + n].reshape(p.shape).copy())
            at += n
        ref_opt.step()
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        opt.step()
        assert np.allclose(flat_params(model), flat_params(ref_model), rtol=1e-6, atol=1e-7), t
        assert np.allclose(opt.communicators[0].residual, errors[rank], rtol=1e-6, atol=1e-7)
        assert same_on_all_ranks(model, f"topk.{opt_name}.{ratio}.{t}")


def test_topk_fp16_values_within_tolerance():
    model, dense = make_model(6), make_model(6)
    opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(),
                                  compression=sh.TopK(1.0, value_dtype="float16"))
    dopt = sh.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=0.05),
                                   named_parameters=dense.named_parameters())
    train(model, opt, 5)
    train(dense, dopt, 5)
    assert np.allclose(flat_params(model), flat_params(dense), rtol=1e-2, atol=1e-3)
    assert opt.communicators[0].wire.value_dtype == np.float16


# ============================================================================= resume
def _checkpoint(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["slamb", "topk"])
def test_resume_is_bitwise(kind, tmp_path):
    N, M = 4, 5

    def build():
        model = make_model(7)
        if kind == "slamb":
            opt = slamb_dist(model, lr=0.02, ratio=0.25, sync_interval=3, beta3=0.9, weight_decay=0.01, seed=None)
        else:
            opt = sh.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                          named_parameters=model.named_parameters(), compression=sh.TopK(0.1))
        return model, opt

    model, opt = build()
    train(model, opt, N)
    path = tmp_path / f"ckpt.{hvd.rank()}.pt"
    path.write_bytes(_checkpoint(model, opt))
    train(model, opt, M, start=N + 1)
    uninterrupted = flat_params(model)
    state_a = opt.state_dict()

    model2, opt2 = build()  # fresh objects, restored from the serialised bytes
    ck = torch.load(path)  # weights_only=True: the state holds only tensors and plain values
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    train(model2, opt2, M, start=N + 1)
    assert np.array_equal(flat_params(model2), uninterrupted)
    state_b = opt2.state_dict()
    for i, st in state_a["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(v, state_b["state"][i][k]), (i, k)
            else:
                assert v == state_b["state"][i][k]


# ============================================================================= Horovod contract
@pytest.mark.parametrize("kind", ["slamb", "topk"])
def test_bad_named_parameters_raise_value_error(kind):
    model = make_model(8)

    def opt():
        if kind == "slamb":
            return sh.SLAMB(model.parameters())
        return torch.optim.SGD(model.parameters(), lr=0.1)

    comp = sh.TopK(0.1) if kind == "topk" else hvd.Compression.none
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="not named"):
        sh.DistributedOptimizer(opt(), named_parameters=named[:-1], compression=comp)
    with pytest.raises(ValueError, match="unique"):
        sh.DistributedOptimizer(opt(), named_parameters=named + [(named[0][0], named[1][1])], compression=comp)
    with pytest.raises(ValueError, match="tuples"):
        sh.DistributedOptimizer(opt(), named_parameters=[list(x) for x in named], compression=comp)
    with pytest.raises(ValueError):
        sh.DistributedOptimizer(sh.SLAMB(model.parameters()), named_parameters=named, op=hvd.Sum)
    with pytest.raises(ValueError):
        sh.DistributedOptimizer(sh.SLAMB(model.parameters()), named_parameters=named, compression=sh.TopK(0.1))
    with pytest.raises(ValueError):
        sh.DistributedOptimizer(opt(), named_parameters=named, compression=comp, backward_passes_per_step=0)


class TwoBranch(torch.nn.Module):
    """Rank 0 alone uses the side branch: the others never compute its gradient."""

    def __init__(self):
        super().__init__()
        self.body = make_model(9)
        self.side = torch.nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        out = self.body(x)
        return out + self.side(x) if hvd.rank() == 0 else out


@pytest.mark.parametrize("kind", ["slamb", "topk"])
def test_parameter_without_gradient_on_some_ranks_does_not_hang(kind):
    model = TwoBranch()
    hvd.broadcast_parameters(model.state_dict(), 0)
    if kind == "slamb":
        opt = sh.DistributedOptimizer(sh.SLAMB(model.parameters(), lr=0.01, sync_interval=1, dense_threshold=THRESHOLD),
                                      named_parameters=model.named_parameters())
    else:
        opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), compression=sh.TopK(1.0))
    for t in range(1, 4):
        opt.zero_grad()
        x, y = batch(hvd.rank(), t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if hvd.rank() != 0:
            assert model.side.weight.grad is None
        opt.step()
        assert same_on_all_ranks(model, f"nograd.{kind}.{t}")  # H = 1 / dense mean: replicas agree
    if kind == "topk" and hvd.size() > 1:
        assert model.side.weight.grad is not None and model.side.weight.grad.abs().sum() > 0


def _clip_run(kind, mode, max_norm=0.05, fused=False):
    """mode: 'sync-clip' (synchronize, clip, step under skip_synchronize), 'preclipped'
    (gradients clipped before the optimizer ever sees them), 'plain' (no clipping)."""
    model = make_model(10)
    if kind == "slamb":
        opt = slamb_dist(model, lr=0.02, ratio=0.25, sync_interval=50, fused=fused)
    else:
        opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), compression=sh.TopK(0.25))
    for t in range(1, 4):
        opt.zero_grad()
        if mode == "preclipped":
            twin = make_model(10)
            with torch.no_grad():
                for a, b in zip(twin.parameters(), model.parameters()):
                    a.copy_(b)
            loss_of(twin, hvd.rank(), t).backward()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
            for a, b in zip(twin.parameters(), model.parameters()):
                b.grad = a.grad.clone()
            opt.step()  # no hook ran: step() submits these gradients
            continue
        loss_of(model, hvd.rank(), t).backward()
        if mode == "sync-clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with opt.skip_synchronize():
                    opt.step()
        else:
            opt.step()
    return flat_params(model), opt


@pytest.mark.parametrize("fused", [False, True])
def test_synchronize_skip_synchronize_with_clipping_slamb(fused):
    clipped, opt = _clip_run("slamb", "sync-clip", fused=fused)
    pre, _ = _clip_run("slamb", "preclipped", fused=fused)
    plain, _ = _clip_run("slamb", "plain", fused=fused)
    if fused:  # Horovod's clipping idiom costs one exchange per step on flat buffers
        assert opt.communicators[0].stats.by_kind["masked_allreduce"].calls == 3
    assert close(clipped, pre, rtol=1e-5, atol=1e-6)  # clipping took effect, as if before the hooks
    assert not close(clipped, plain)


def test_synchronize_skip_synchronize_with_clipping_topk():
    model = make_model(10)
    opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), compression=sh.TopK(0.25))
    loss_of(model, hvd.rank(), 1).backward()
    opt.synchronize()
    means = [p.grad.clone() for p in model.parameters()]
    for name, g in zip(range(len(means)), means):  # the gradient is already the mean: same everywhere
        allg = everyone(g, f"clipmean.{name}")
        assert all(torch.equal(allg[0], allg[r]) for r in range(hvd.size()))
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    clipped = [p.grad.clone() for p in model.parameters()]
    assert sum(float(c.norm() ** 2) for c in clipped) ** 0.5 <= 0.05 * 1.0001
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    for p, b, c in zip(model.parameters(), before, clipped):
        assert torch.allclose(p.detach(), b - 0.1 * c, rtol=0, atol=1e-7)
    # step() after synchronize() without skip_synchronize() warns, like Horovod
    opt.zero_grad()
    loss_of(model, hvd.rank(), 2).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


@pytest.mark.parametrize("kind", ["slamb", "topk"])
def test_zero_grad(kind):
    model = make_model(11)
    if kind == "slamb":
        opt = slamb_dist(model)
    else:
        opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), compression=sh.TopK(0.1))
    loss_of(model, hvd.rank(), 1).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()  # between backward and step: a race in Horovod, refused here too
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    loss_of(model, hvd.rank(), 2).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("kind", ["slamb", "topk"])
def test_backward_passes_per_step_accumulates(kind):
    def build(bpps):
        model = make_model(12)
        if kind == "slamb":
            opt = sh.DistributedOptimizer(sh.SLAMB(model.parameters(), lr=0.02, ratio=0.25, dense_threshold=THRESHOLD),
                                          named_parameters=model.named_parameters(), backward_passes_per_step=bpps)
        else:
            opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), compression=sh.TopK(0.25),
                                          backward_passes_per_step=bpps)
        return model, opt

    m2, o2 = build(2)
    m1, o1 = build(1)
    for t in range(1, 4):
        o2.zero_grad()
        loss_of(m2, hvd.rank(), t, salt=1).backward()
        loss_of(m2, hvd.rank(), t, salt=2).backward()
        o2.step()
        o1.zero_grad()
        (loss_of(m1, hvd.rank(), t, salt=1) + loss_of(m1, hvd.rank(), t, salt=2)).backward()
        o1.step()
        assert close(flat_params(m2), flat_params(m1), rtol=1e-5, atol=1e-6), t
    o2.zero_grad()
    for s in (1, 2):
        loss_of(m2, hvd.rank(), 9, salt=s).backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        loss_of(m2, hvd.rank(), 9, salt=3).backward()
    o2.step()  # the two counted passes are exchanged; every rank takes part


@pytest.mark.parametrize("fused", [False, True])
def test_broadcast_parameters_and_optimizer_state_at_startup_slamb(fused):
    model = make_model(100 + hvd.rank())  # different on every rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert same_on_all_ranks(model, "bcast.params")
    opt = slamb_dist(model, lr=0.02, ratio=0.25, weight_decay=0.1, sync_interval=2,
                     seed=1000 + hvd.rank(), fused=fused)  # rank 0's mask seed wins
    before = flat_params(model)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert np.array_equal(flat_params(model), before)  # no step was taken (weight decay would move x)
    p0 = next(iter(model.parameters()))
    assert int(opt.state[p0]["step"]) == 0
    assert float(opt.state[p0]["exp_avg"].abs().sum()) == 0.0
    assert opt.communicators[0].seed == 1000
    # now the run is the reference run
    shapes = [tuple(p.shape) for p in model.parameters()]
    ref = RefSlamb(before, shapes, hvd.size(), lr=0.02, wd=0.1, H=2)
    for t in range(1, 5):
        grads = np.stack([grads_at(ref.x[r], shapes, r, t) for r in range(hvd.size())])
        mask = np.asarray(opt.communicators[0].mask.select(t))
        train(model, opt, 1, start=t)
        ref.step(grads, mask)
        assert close(flat_params(model), ref.x[hvd.rank()]), t
        assert int(opt.state[p0]["step"]) == t
    # a mid-run broadcast makes every rank's state rank 0's and keeps the step count
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "freshness"):
            allv = everyone(st[k], f"bcast.state.{i}.{k}")
            assert all(torch.equal(allv[0], allv[r]) for r in range(hvd.size()))
        assert int(st["step"]) == 4
    train(model, opt, 1, start=5)
    assert int(opt.state[p0]["step"]) == 5


def test_broadcast_optimizer_state_topk_adam_creates_state_without_desync():
    model = make_model(200 + hvd.rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = sh.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), compression=sh.TopK(0.1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # calls step() with zero gradients on every rank
    assert same_on_all_ranks(model, "bcast.topk.0")
    train(model, opt, 3)
    assert same_on_all_ranks(model, "bcast.topk.1")


def test_bf16_parameters_travel_as_fp32():
    # SLAMB: bf16 parameters, float32 state and wire
    model = make_model(13, dtype=torch.bfloat16)
    opt = slamb_dist(model, lr=0.02, ratio=0.25, sync_interval=2)
    train(model, opt, 3)
    p0 = next(iter(model.parameters()))
    assert p0.dtype == torch.bfloat16 and opt.state[p0]["exp_avg"].dtype == torch.float32
    assert opt.communicators[0].layout.dtype == np.float32
    train(model, opt, 1, start=4)  # step 4 is not a sync step, step 5 is
    train(model, opt, 1, start=5)
    assert same_on_all_ranks(model, "bf16.slamb")
    # the result tracks a float32 run of the same data
    ref = make_model(13)
    with torch.no_grad():
        for a, b in zip(ref.parameters(), make_model(13, dtype=torch.bfloat16).parameters()):
            a.copy_(b.float())
    ropt = slamb_dist(ref, lr=0.02, ratio=0.25, sync_interval=2)
    train(ref, ropt, 5)
    assert np.abs(flat_params(model) - flat_params(ref)).mean() < 0.01
    # top-k under SGD
    model = make_model(14, dtype=torch.bfloat16)
    opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  compression=sh.TopK(0.5))
    train(model, opt, 3)
    assert next(iter(model.parameters())).dtype == torch.bfloat16
    assert same_on_all_ranks(model, "bf16.topk")
    # Horovod's own path: bf16 gradients sent as fp32 and cast back
    model = make_model(15, dtype=torch.bfloat16)
    opt = sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
    train(model, opt, 3)
    assert same_on_all_ranks(model, "bf16.hvd")


def test_horovod_compressions_delegate_to_horovod():
    for comp in (hvd.Compression.none, hvd.Compression.fp16):
        a, b = make_model(16), make_model(16)
        oa = sh.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=a.named_parameters(), compression=comp)
        ob = hvd.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=b.named_parameters(), compression=comp)
        assert type(oa).__module__ == type(ob).__module__ and isinstance(oa, torch.optim.SGD)
        train(a, oa, 4)
        train(b, ob, 4)
        # the same computation; only Horovod's fusion (timing-dependent) could reorder a sum
        tol = dict(rtol=1e-6, atol=1e-7) if comp is hvd.Compression.none else dict(rtol=1e-3, atol=1e-4)
        assert np.allclose(flat_params(a), flat_params(b), **tol)
        assert same_on_all_ranks(a, f"delegate.{comp.__name__}")


def test_slamb_fp16_compression_means_fp16_payload():
    model = make_model(17)
    opt = sh.DistributedOptimizer(sh.SLAMB(model.parameters(), dense_threshold=THRESHOLD),
                                  named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
    train(model, opt, 2)
    tr = opt.step_traffic()
    assert opt.param_groups[0]["value_dtype"] == "float16"
    assert 0 < tr.payload_bytes < tr.dense_payload_bytes


@pytest.mark.parametrize("distributed", [True, False])
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_non_finite_gradient_on_one_rank_is_handled_everywhere_and_changes_nothing(mode, distributed):
    model = make_model(18)
    if distributed:
        opt = slamb_dist(model, lr=0.02, ratio=0.25, on_nonfinite=mode)
    else:
        opt = sh.SLAMB(model.parameters(), lr=0.02, ratio=0.25, dense_threshold=THRESHOLD, on_nonfinite=mode)
    train(model, opt, 2)
    before = flat_params(model)
    p0 = next(iter(model.parameters()))
    m_before = opt.state[p0]["exp_avg"].clone()
    opt.zero_grad()
    loss = loss_of(model, hvd.rank(), 3)
    if hvd.rank() == hvd.size() - 1 or not distributed:
        loss = loss * float("nan")
    loss.backward()
    if mode == "raise":
        with pytest.raises(slamb_comm.NonFiniteError):
            opt.step()
    else:
        opt.step()
        assert opt.skipped_steps == 1
    assert np.array_equal(flat_params(model), before)
    assert int(opt.state[p0]["step"]) == 2 and torch.equal(opt.state[p0]["exp_avg"], m_before)
    train(model, opt, 1, start=3)  # and training goes on
    assert int(opt.state[p0]["step"]) == 3


def test_slamb_alone_uses_no_collectives_and_state_dict_roundtrip():
    model = make_model(19)
    opt = sh.SLAMB(model.parameters(), lr=0.01, ratio=0.1, dense_threshold=THRESHOLD)
    assert opt.communicators[0].size == 1
    train(model, opt, 3)
    sd = opt.state_dict()
    model2 = make_model(19)
    model2.load_state_dict(model.state_dict())
    opt2 = sh.SLAMB(model2.parameters(), lr=0.01, ratio=0.1, dense_threshold=THRESHOLD)
    opt2.load_state_dict(sd)
    train(model, opt, 2, start=4)
    train(model2, opt2, 2, start=4)
    assert np.array_equal(flat_params(model), flat_params(model2))
    # an invalid option: at construction in one process; in a job of several ranks at the first use of
    # an optimizer that was not wrapped (a wrapped one raises at construction, on every rank)
    with pytest.raises(slamb_comm.ConfigError):
        sh.SLAMB(model.parameters(), ratio=0).step()
    with pytest.raises(slamb_comm.ConfigError):
        sh.SLAMB(model.parameters(), mask="random").step()
    for bad in (dict(block=0), dict(block=2.5), dict(mask="bernoulli", block=64)):
        with pytest.raises(slamb_comm.ConfigError):
            sh.SLAMB(model.parameters(), **bad).step()


@pytest.mark.parametrize("mask", ["bernoulli", "topk"])
def test_other_masks(mask):
    """bernoulli: the library's M_t against the dense reference; topk (data-dependent, union of
    the ranks' picks): the exchange agrees on every rank and the periodic sync makes replicas equal."""
    P, rank = hvd.size(), hvd.rank()
    model = make_model(20)
    shapes = [tuple(p.shape) for p in model.parameters()]
    opt = slamb_dist(model, lr=0.02, ratio=0.2, mask=mask, sync_interval=3, seed=5)
    ref = RefSlamb(flat_params(model), shapes, P, lr=0.02, H=3)
    (comm,) = opt.communicators
    for t in range(1, 6):
        if mask == "bernoulli":
            grads = np.stack([grads_at(ref.x[r], shapes, r, t) for r in range(P)])
            ref.step(grads, np.asarray(comm.mask.select(t)))
        train(model, opt, 1, start=t)
        if mask == "bernoulli":
            assert close(flat_params(model), ref.x[rank]), t
        if (t - 1) % 3 == 0:
            assert same_on_all_ranks(model, f"mask.{mask}.{t}")
    assert comm.stats.by_kind["masked_allreduce"].calls == 5


def test_exchange_is_launched_from_the_gradient_hooks():
    model = make_model(21)
    opt = slamb_dist(model, ratio=0.1)
    exchange = opt._exchange  # the step's exchange (SlambExchange), whose launch the hooks call
    in_hooks, launch = [], exchange.launch

    def spy(p, redo=False):  # launched while the backward pass still runs (from the gradient hooks)?
        in_hooks.append(opt.contract.in_backward)
        return launch(p, redo)

    exchange.launch = spy
    loss_of(model, hvd.rank(), 1).backward()
    (e,) = opt.buckets
    assert in_hooks == [True] * len(list(model.parameters()))
    assert opt.communicators[0].stats.by_kind["masked_allreduce"].calls == 1  # finished inside backward()
    opt.step()
    assert not exchange.hooks.is_open(e) and opt.communicators[0].stats.by_kind["masked_allreduce"].calls == 1


def test_public_api_has_docstrings():
    import inspect

    assert sh.__doc__ and "bfloat16" in sh.__doc__
    for name in sh.__all__:
        obj = getattr(sh, name)
        assert obj.__doc__ and obj.__doc__.strip(), name
        if inspect.isclass(obj):
            for mname, member in vars(obj).items():
                if not mname.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                    doc = member.fget.__doc__ if isinstance(member, property) else member.__doc__
                    assert doc and doc.strip(), f"{name}.{mname}"
    assert "bfloat16" in sh.DistributedOptimizer.__doc__ and "bfloat16" in sh.SLAMB.__doc__


def test_amp_gradscaler_with_synchronize_skips_inf_steps_on_every_rank():
    """The AMP recipe (synchronize, unscale_, clip, step under skip_synchronize): an inf on one
    rank makes every rank's GradScaler skip that step, and the run equals one without it."""
    model, ref = make_model(22), make_model(22)
    opt = slamb_dist(model, lr=0.02, ratio=0.25, sync_interval=2)
    ropt = slamb_dist(ref, lr=0.02, ratio=0.25, sync_interval=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for t in range(1, 5):
        opt.zero_grad()
        loss = loss_of(model, hvd.rank(), t)
        if t == 2 and hvd.rank() == hvd.size() - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        if t != 2:
            ropt.zero_grad()
            loss_of(ref, hvd.rank(), t).backward()
            ropt.synchronize()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 10.0)
            with ropt.skip_synchronize():
                ropt.step()
    p0 = next(iter(model.parameters()))
    assert int(opt.state[p0]["step"]) == 3
    scales = everyone(torch.tensor([scaler.get_scale()]), "amp.scale")
    assert torch.all(scales == 128.0)
    assert close(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6)


def test_one_communicator_per_dtype_and_add_param_group():
    a, b = make_model(23), make_model(24).double()
    params = list(a.parameters()) + list(b.parameters())
    named = [("a." + n, p) for n, p in a.named_parameters()] + [("b." + n, p) for n, p in b.named_parameters()]
    opt = sh.DistributedOptimizer(sh.SLAMB(params, lr=0.01, sync_interval=1, dense_threshold=THRESHOLD),
                                  named_parameters=named)
    assert sorted(c.layout.dtype.name for c in opt.communicators) == ["float32", "float64"]
    for t in range(1, 3):
        opt.zero_grad()
        (loss_of(a, hvd.rank(), t) + loss_of(b, hvd.rank(), t)).backward()
        opt.step()
        assert same_on_all_ranks(a, f"dt.a.{t}") and same_on_all_ranks(b, f"dt.b.{t}")
    assert next(b.parameters()).dtype == torch.float64
    # alone: a group added later joins at the next step; the existing state is kept
    m1, m2 = make_model(25), make_model(26)
    alone = sh.SLAMB(m1.parameters(), lr=0.01, dense_threshold=THRESHOLD)
    train(m1, alone, 2)
    p0 = next(iter(m1.parameters()))
    m_before = alone.state[p0]["exp_avg"].clone()
    alone.add_param_group({"params": list(m2.parameters()), "weight_decay": 0.1})
    alone.zero_grad()
    (loss_of(m1, hvd.rank(), 3) + loss_of(m2, hvd.rank(), 3)).backward()
    alone.step()
    q0 = next(iter(m2.parameters()))
    assert int(alone.state[p0]["step"]) == 3 and int(alone.state[q0]["step"]) == 1
    assert not torch.equal(alone.state[p0]["exp_avg"], m_before)


def test_horovod_transport_matches_mpi_transport():
    """The transport protocol on Horovod's collectives gives what mpi4py's gives."""
    ht, mt = sh.HorovodTransport(), slamb_comm.MPITransport()
    assert isinstance(ht, slamb_comm.Transport)
    assert (ht.rank, ht.size, ht.name) == (mt.rank, mt.size, "horovod")
    P, r = ht.size, ht.rank
    for dt in (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8):
        a = (np.arange(10) + r).astype(dt)
        b = a.copy()
        ht.allreduce(a)
        mt.allreduce(b)
        assert np.array_equal(a, b), dt
        recv_h, recv_m = np.zeros(10 * P, dt), np.zeros(10 * P, dt)
        ht.allgather((np.arange(10) * (r + 1)).astype(dt), recv_h)
        mt.allgather((np.arange(10) * (r + 1)).astype(dt), recv_m)
        assert np.array_equal(recv_h, recv_m), dt
        c = np.full(5, r, dt)
        ht.broadcast(c, root=P - 1)
        assert np.all(c == P - 1)
    ht.barrier()
    rng = np.random.default_rng(100 + r)
    arrays = [rng.standard_normal((40, 300)).astype(np.float32), rng.standard_normal(7).astype(np.float32)]
    c1 = slamb_comm.Communicator(ht, arrays, ratio=0.1, seed=3)
    c2 = slamb_comm.Communicator(mt, arrays, ratio=0.1, seed=3)
    x1, x2 = [a.copy() for a in arrays], [a.copy() for a in arrays]
    for t in (1, 2):
        c1.masked_allreduce(x1, t)
        c2.masked_allreduce(x2, t)
    assert all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(x1, x2))
    for _ in range(2):
        g1, g2 = c1.sparse_allgather(arrays), c2.sparse_allgather(arrays)
        assert all(np.array_equal(a, b) for a, b in zip(g1, g2))
    c1.sync(x1)
    c2.sync(x2)
    assert all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(x1, x2))


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_topk_non_finite_gradient_on_one_rank_is_skipped_or_raised_everywhere(mode):
    model = make_model(21)
    opt = sh.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(),
                                  compression=slamb_comm.TopK(0.25, on_nonfinite=mode))
    train(model, opt, 2)
    before = flat_params(model)
    residuals = [c.residual.copy() for c in opt.communicators]
    opt.zero_grad()
    loss = loss_of(model, hvd.rank(), 3)
    if hvd.rank() == hvd.size() - 1:
        loss = loss * float("nan")
    loss.backward()
    if mode == "raise":
        with pytest.raises(slamb_comm.NonFiniteError):
            opt.step()
    else:
        opt.step()
        assert opt.skipped_steps == 1
    assert np.array_equal(flat_params(model), before)
    for c, r in zip(opt.communicators, residuals):
        assert np.array_equal(c.residual, r)
    train(model, opt, 1, start=3)  # and training goes on, replicas still identical
    assert same_on_all_ranks(model, f"topk.nonfinite.{mode}")


def test_checkpoint_module_resumes_the_adapter_bitwise():
    """slamb_comm.methods.checkpoint.save/load of every rank's model + SLAMB state through Horovod."""
    import tempfile

    from slamb_comm.methods import checkpoint

    transport = sh.HorovodTransport()
    path = np.zeros(256, np.uint8)  # rank 0's temporary directory, shared through the transport
    if hvd.rank() == 0:
        name = tempfile.mkdtemp().encode()
        path[: len(name)] = np.frombuffer(name, np.uint8)
    transport.broadcast(path, root=0)
    base = bytes(path[path != 0]).decode()
    model = make_model(31)
    opt = slamb_dist(model, lr=0.02, ratio=0.25, sync_interval=3)
    train(model, opt, 4)
    checkpoint.save(f"{base}/ckpt", {"model": model.state_dict(), "opt": opt.state_dict()}, transport)
    train(model, opt, 3, start=5)
    model2 = make_model(99)  # different start: everything must come from the checkpoint
    opt2 = slamb_dist(model2, lr=0.02, ratio=0.25, sync_interval=3)
    state = checkpoint.load(f"{base}/ckpt", transport)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    train(model2, opt2, 3, start=5)
    assert np.array_equal(flat_params(model), flat_params(model2))


# ============================================================================= changed parameters
def _changed_opt(kind, model):
    if kind == "topk":
        return sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), compression=slamb_comm.TopK(0.25))
    return slamb_dist(model, lr=0.02, ratio=0.25, mask="topk" if kind == "slamb-topk-mask" else "cyclic")


def _change(model, opt, how):
    """Change parameter '2.weight' (32x32, compressible) or the optimizer's parameter set."""
    p = model[2].weight
    if how == "shape":
        p.data = torch.zeros(32, 31)
    elif how == "dtype":
        p.data = p.data.double()
    else:
        opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))


def _changed_msg(how, name="2.weight"):
    """What the LayoutError of ``_change(..., how)`` says (a regex)."""
    return {"shape": rf"'{re.escape(name)}'.*\(32, 32\).*\(32, 31\)", "dtype": rf"'{re.escape(name)}'.*float64",
            "set": "set of parameters changed"}[how]


def _backward_any_shape(model):
    """A backward pass that works whatever the parameters' shapes and dtypes now are."""
    sum((p * p).sum() for p in model.parameters()).backward()


def _nobody_waits(tag):
    """A collective after the failed step succeeds on every rank: no rank is stuck in it."""
    out = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name=f"changed.after.{tag}")
    assert float(out[0]) == hvd.size()


@pytest.mark.parametrize("how", ["shape", "dtype", "set"])
@pytest.mark.parametrize("kind", ["slamb", "slamb-topk-mask", "topk"])
def test_parameter_changed_on_one_rank_raises_on_every_rank(kind, how):
    model = make_model(41)
    opt = _changed_opt(kind, model)
    train(model, opt, 2)
    culprit = 1 if hvd.size() > 1 else 0
    before = flat_params(model)
    if hvd.rank() == culprit:
        _change(model, opt, how)
    opt.zero_grad()
    _backward_any_shape(model)
    if hvd.rank() == culprit:
        with pytest.raises(slamb_comm.LayoutError, match=_changed_msg(how)):
            opt.step()
    else:
        with pytest.raises(slamb_comm.PeerError) as info:
            opt.step()
        assert info.value.ranks == (culprit,) and f"[{culprit}]" in str(info.value)
        assert np.array_equal(flat_params(model), before)  # nothing changed
        if kind != "topk":
            assert int(opt.state[model[0].weight]["step"]) == 2
    _nobody_waits(f"{kind}.{how}")


@pytest.mark.parametrize("kind", ["slamb", "slamb-topk-mask"])
@pytest.mark.parametrize("option,value", [("value_dtype", "float16"), ("block", 16)])
def test_fixed_option_changed_on_one_rank_raises_on_every_rank(kind, option, value):
    """mask, value_dtype, dense_threshold and block are fixed at construction: changing one
    in a param group on one rank raises ConfigError there and PeerError elsewhere, at that step."""
    model = make_model(46)
    opt = _changed_opt(kind, model)
    train(model, opt, 2)
    culprit = hvd.size() - 1
    before = flat_params(model)
    if hvd.rank() == culprit:
        opt.param_groups[0][option] = value
    opt.zero_grad()
    loss_of(model, hvd.rank(), 3).backward()
    if hvd.rank() == culprit:
        with pytest.raises(slamb_comm.ConfigError, match="fixed at construction"):
            opt.step()
    else:
        with pytest.raises(slamb_comm.PeerError) as info:
            opt.step()
        assert info.value.ranks == (culprit,)
    assert np.array_equal(flat_params(model), before)
    assert int(opt.state[model[0].weight]["step"]) == 2
    _nobody_waits(f"option.{kind}.{option}")


@pytest.mark.parametrize("kind", ["slamb", "slamb-topk-mask", "topk"])
def test_parameter_changed_identically_on_every_rank_still_raises(kind):
    model = make_model(42)
    opt = _changed_opt(kind, model)
    train(model, opt, 2)
    _change(model, opt, "shape")  # the same on every rank: the optimizer's state still does not fit
    opt.zero_grad()
    _backward_any_shape(model)
    with pytest.raises(slamb_comm.LayoutError, match=_changed_msg("shape")):
        opt.step()
    _nobody_waits(f"identical.{kind}")


@pytest.mark.parametrize("how", ["shape", "dtype"])
def test_slamb_alone_parameter_changed_raises_and_changes_nothing(how):
    model = make_model(43)
    opt = sh.SLAMB(model.parameters(), lr=0.02, ratio=0.25, dense_threshold=THRESHOLD)
    train(model, opt, 2)
    p0 = model[0].weight
    x0, m0 = p0.detach().clone(), opt.state[p0]["exp_avg"].clone()
    _change(model, opt, how)
    opt.zero_grad()
    _backward_any_shape(model)
    with pytest.raises(slamb_comm.LayoutError, match=_changed_msg(how, "group0.2")):
        opt.step()
    assert torch.equal(p0, x0) and torch.equal(opt.state[p0]["exp_avg"], m0)
    assert int(opt.state[p0]["step"]) == 2


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_topk_two_buckets_non_finite_in_the_second_changes_neither(mode):
    """float32 and float64 parameters: two fused buckets. A NaN in the second bucket on one rank
    skips (or raises) on every rank and leaves both error buffers, the parameters and (raise)
    the gradients as they were; the next clean step is docs/algorithm.md section 2."""
    P, rank, ratio, lr = hvd.size(), hvd.rank(), 0.25, 0.05

    def models():
        return make_model(44), make_model(45).double()

    a, b = models()
    ref_a, ref_b = models()
    named = [("a." + n, p) for n, p in a.named_parameters()] + [("b." + n, p) for n, p in b.named_parameters()]
    opt = sh.DistributedOptimizer(torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=lr),
                                  named_parameters=named, compression=slamb_comm.TopK(ratio, on_nonfinite=mode))
    ref_opt = torch.optim.SGD(list(ref_a.parameters()) + list(ref_b.parameters()), lr=lr)
    assert [c.layout.dtype.name for c in opt.communicators] == ["float32", "float64"]
    shapes = [tuple(p.shape) for p in a.parameters()]
    errors = {np.float32: [np.zeros(sum(SIZES), np.float32) for _ in range(P)],
              np.float64: [np.zeros(sum(SIZES), np.float64) for _ in range(P)]}

    def loss(t, poison=False):
        lb = loss_of(b, rank, t, salt=1)
        return loss_of(a, rank, t) + (lb * float("nan") if poison else lb)

    def clean_step(t):
        for ref, dt, tdt, salt in ((ref_a, np.float32, torch.float32, 0), (ref_b, np.float64, torch.float64, 1)):
            x = flat_params(ref)
            grads = [grads_at(x, shapes, r, t, tdt, salt).astype(dt) for r in range(P)]
            mean = _topk_reference_step(errors[dt], grads, ratio)
            at = 0
            for p in ref.parameters():
                p.grad = torch.from_numpy(mean[at:at + p.numel()].reshape(p.shape).copy())
                at += p.numel()
        ref_opt.step()
        opt.zero_grad()
        loss(t).backward()
        opt.step()

    for t in (1, 2):
        clean_step(t)
    x_before = [flat_params(a), flat_params(b)]
    residuals = [c.residual.copy() for c in opt.communicators]
    opt.zero_grad()
    loss(3, poison=rank == P - 1).backward()
    grads_a = [p.grad.clone() for p in a.parameters()]
    if mode == "raise":
        with pytest.raises(slamb_comm.NonFiniteError):
            opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(a.parameters(), grads_a))  # still the local ones
    else:
        opt.step()
        assert opt.skipped_steps == 1
    assert np.array_equal(flat_params(a), x_before[0]) and np.array_equal(flat_params(b), x_before[1])
    for c, r in zip(opt.communicators, residuals):
        assert c.residual.dtype == r.dtype and np.array_equal(c.residual, r)
    clean_step(4)
    for model, ref in ((a, ref_a), (b, ref_b)):
        assert np.allclose(flat_params(model), flat_params(ref), rtol=1e-6, atol=1e-7)
    for c, dt in zip(opt.communicators, (np.float32, np.float64)):
        assert np.allclose(c.residual, errors[dt][rank], rtol=1e-6, atol=1e-7)
    assert same_on_all_ranks(a, f"topk.2buckets.a.{mode}") and same_on_all_ranks(b, f"topk.2buckets.b.{mode}")


# ----------------------------------------------------------------------------- Elastic Horovod's merge
def _elastic_state(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return {"opt": {"state": {0: {"exp_avg": torch.randn(5, 3, generator=g),  # differs: averaged
                                  "exp_avg_sq": torch.rand(7, generator=g, dtype=torch.float64),
                                  "freshness": torch.full((4,), 0.3),  # equal everywhere: kept bitwise
                                  "step": torch.tensor(9, dtype=torch.int64),
                                  "mask_seed": torch.tensor(1000 + rank),  # differs, not a float: the first holder's
                                  "half": torch.randn(3, generator=g).to(torch.bfloat16),
                                  "flags": torch.tensor([True, rank % 2 == 1])}},
                    "param_groups": [{"lr": 0.1 * (rank + 1), "params": [0]}]},
            "params": [torch.randn(2, 2, generator=g)]}


@pytest.mark.parametrize("first", [False, True])
def test_elastic_merge_follows_section10(first):
    """Elastic Horovod's reset (adapters/horovod/elastic.py ``merge``) against docs/algorithm.md section
    10 written out here: over the workers that held state (the even ranks; at the first sync,
    nobody: every worker takes rank 0's), floating-point entries that differ are averaged in
    float64 and cast back, equal ones kept bitwise, everything else taken from the first holder."""
    me, P = hvd.rank(), hvd.size()
    holders = [] if first else [r for r in range(P) if r % 2 == 0]
    from slamb_comm.adapters.horovod.elastic import merge

    merged, got_holders, taken = merge(_elastic_state(me), me in holders, "test.elastic.merge")
    every = [_elastic_state(r) for r in range(P)]
    root = every[0]
    assert got_holders == (None if first else holders)

    def mean(get):
        if first:
            return get(root)
        acc = sum(get(every[r]).to(torch.float64) for r in holders) / len(holders)
        return acc.to(get(root).dtype)

    st, want = merged["opt"]["state"][0], root["opt"]["state"][0]
    for key in ("exp_avg", "exp_avg_sq", "half"):
        exp = mean(lambda s: s["opt"]["state"][0][key])
        assert st[key].dtype == exp.dtype and torch.equal(st[key], exp), key
    assert torch.equal(merged["params"][0], mean(lambda s: s["params"][0]))
    for key in ("freshness", "step", "mask_seed", "flags"):
        assert st[key].dtype == want[key].dtype and torch.equal(st[key], want[key]), key
    assert merged["opt"]["param_groups"][0]["lr"] == root["opt"]["param_groups"][0]["lr"]
    # mask_seed differs between the holders (ranks 0 and 2), flags do not (both even)
    assert taken == (["opt.state.0.mask_seed"] if not first and len(holders) > 1 else []), taken


# ----------------------------------------------------------------------------- the dense reference of a step
def test_step_traffic_counts_one_dense_allreduce_per_step_also_on_sync_steps():
    """docs/algorithm.md section 4: a step's dense reference is one allreduce of every gradient
    (4N bytes of float32), once per step; SLAMB's sync steps (t = 1, 3, 5 at H = 2) send the
    masked momentum and the parameters, and still count one dense allreduce."""
    model = make_model(19)
    opt = slamb_dist(model, lr=0.02, ratio=0.25, sync_interval=2)
    N, P = sum(p.numel() for p in model.parameters()), hvd.size()
    seen = []
    train(model, opt, 4, after_step=lambda t: seen.append(opt.step_traffic()))
    for t, tr in enumerate(seen, start=1):
        assert tr.dense_payload_bytes == 4 * N, (t, tr)
        assert tr.dense_wire_bytes == pytest.approx(slamb_comm.wire.stats.allreduce_wire(4 * N, P))
    if P > 1:  # a sync step sends the parameters (N + 1 float32 values) on top of the masked momentum
        assert seen[0].payload_bytes - seen[1].payload_bytes == 4 * (N + 1)
        assert seen[2].payload_bytes == seen[0].payload_bytes
    train(model, opt, 3, start=5)  # read once after three steps: three dense steps
    tr = opt.step_traffic()
    assert tr.dense_payload_bytes == 3 * 4 * N and tr.payload_bytes == sum(t.payload_bytes for t in seen[:3]), tr


def test_lamb_is_the_dense_baseline():
    """DistributedOptimizer(LAMB) is Horovod's own dense gradient allreduce under LAMB's step: every
    rank ends with the parameters of LAMB alone stepped on the mean of the ranks' gradients
    (computed here from every rank's data), equal on every rank; SLAMB(ratio=1) is not this."""
    model, ref = make_model(20), make_model(20)
    opt = sh.DistributedOptimizer(sh.LAMB(model.parameters(), lr=0.02, weight_decay=0.01),
                                  named_parameters=model.named_parameters())
    assert type(opt).__module__.startswith("horovod")
    alone = sh.LAMB(ref.parameters(), lr=0.02, weight_decay=0.01)
    P = hvd.size()
    for t in range(1, 4):
        opt.zero_grad()
        loss_of(model, hvd.rank(), t).backward()
        opt.step()
        alone.zero_grad()
        grads = None
        for r in range(P):  # the mean of every rank's gradient, in rank order
            ref.zero_grad()
            loss_of(ref, r, t).backward()
            g = [p.grad.double().clone() for p in ref.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(ref.parameters(), grads):
            p.grad = (g / P).float()
        alone.step()
    assert np.allclose(flat_params(model), flat_params(ref), rtol=1e-5, atol=1e-6)
    assert same_on_all_ranks(model, "lamb.dense")
