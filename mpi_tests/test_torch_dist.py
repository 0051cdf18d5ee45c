"""Tests of the torch.distributed adapter (slamb_comm.adapters.torch), run under MPI:

    bash scripts/mpirun.sh 4 600 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_torch_dist.py

(also at 1 and 2 ranks). mpirun only starts the processes and hands rank 0's free port to
the others; every exchange goes through a torch.distributed gloo process group, as under
torchrun. Each test compares the library with the dense references of torch_reference.py
(docs/algorithm.md section 1 for SLAMB, section 2 for top-k), for the plain DistributedOptimizer
and for the DDP communication hooks. No test asserts a timing.
"""

import copy
import datetime
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import slamb_comm  # noqa: E402
from slamb_comm.adapters import torch as st  # noqa: E402
from tests.support.torch_reference import (  # noqa: E402
    N_ALL, SHAPES, THRESHOLD, RefSlamb, RefTopK, batch, close, flat_params, grads_at, loss_of, make_model, maxdiff,
    set_flat, topk_close, topk_counts,
)

from tests.support import strict_cupy  # noqa: E402  (fused="device": the GPU path on the CPU)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def device_arrays(request):
    """Tests parametrized with ``fused="device"``: the strict CuPy double stands for CuPy and torch's
    CPU tensors reach the core as its device arrays (sharing their memory), so the GPU path -- the
    core's device kernels, and under DDP the exchange launched from DDP's hooks -- runs here."""
    spec = getattr(request.node, "callspec", None)
    if spec is None or spec.params.get("fused") != "device":
        yield
        return
    with strict_cupy.install(), strict_cupy.torch_bridge():
        strict_cupy.Device.current = 0
        strict_cupy.reset_counts()
        yield


def kernel_steps():
    """Steps the core's device kernels took (the double's count of update kernels)."""
    return sum(n for op, n in strict_cupy.launches.items() if op.startswith("kernel(slamb_update"))


@pytest.fixture(scope="module", autouse=True)
def process_group():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size,
                            timeout=datetime.timedelta(seconds=90))
    yield
    dist.destroy_process_group()


def P():
    return dist.get_world_size()


def R():
    return dist.get_rank()


def everyones_params(model):
    """Every rank's parameters, (P, n) float64, through one exact allreduce of one-hot rows."""
    rows = torch.zeros(P(), N_ALL, dtype=torch.float64)
    rows[R()] = torch.from_numpy(flat_params(model))
    dist.all_reduce(rows)
    return rows.numpy()


def same_on_all_ranks(model):
    rows = everyones_params(model)
    return all(np.array_equal(rows[0], rows[r]) for r in range(P()))


def train_step(net, opt, t, scale=1.0):
    opt.zero_grad()
    (loss_of(net, R(), t) * scale).backward()
    opt.step()


def slamb_opt(model, fused=False, **kw):
    kw = {"fused": fused == "device" or fused, "lr": 0.02, "ratio": 0.25, "beta3": 0.9, "weight_decay": 0.01, "dense_threshold": THRESHOLD, **kw}
    return st.DistributedOptimizer(st.SLAMB(model.parameters(), **kw), named_parameters=model.named_parameters())


def ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def gather_failures(failed):
    """Assert after the test's last collective: every rank's failures, on every rank."""
    flag = torch.tensor([len(failed)], dtype=torch.int64)
    dist.all_reduce(flag)
    assert not failed, f"rank {R()}: " + "; ".join(failed[:6])
    assert int(flag[0]) == 0, "another rank failed"


# ============================================================================= SLAMB vs section 1
# fused=True: the buckets as flat buffers (the default on CUDA), on the CPU stepped tensor by tensor
# from step(); fused="device": the same through the core's device kernels on the strict double,
# under DDP exchanged from DDP's hooks; fused=False: tensor by tensor, from the hooks
@pytest.mark.parametrize("fused", [False, True, "device"])
@pytest.mark.parametrize("use_ddp", [False, True])
@pytest.mark.parametrize("ratio,value_dtype", [(0.25, "float32"), (1.0, "float32"), (0.25, "float16")])
def test_slamb_matches_section1_every_step(use_ddp, ratio, value_dtype, fused):
    model = make_model(1)
    net = ddp(model) if use_ddp else model
    opt = slamb_opt(model, ratio=ratio, sync_interval=3, value_dtype=value_dtype, seed=5, fused=fused)
    assert isinstance(opt, st.SLAMB)
    if use_ddp:
        net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    ref = RefSlamb(flat_params(model), SHAPES, P(), lr=0.02, wd=0.01, beta3=0.9, H=3)
    (comm,) = opt.communicators
    assert comm.size == P() and isinstance(comm.transport, st.TorchTransport)
    tol = dict(rtol=2e-4, atol=2e-5) if value_dtype == "float32" else dict(rtol=2e-2, atol=2e-3)
    failed = against_reference(net, model, opt, ref, "section 1", tol)
    if fused == "device" and kernel_steps() != 8:
        failed.append(f"the device kernels took {kernel_steps()} of 8 steps")
    gather_failures(failed)


def against_reference(net, model, opt, ref, section, tol, steps=8, H=3):
    """Eight steps of ``opt`` next to the dense reference ``ref``: what differs, as messages."""
    (comm,) = opt.communicators
    failed = []
    for t in range(1, steps + 1):
        xs = everyones_params(model)
        grads = np.stack([grads_at(xs[r], r, t) for r in range(P())])
        mask = np.asarray(comm.mask.select(t))
        train_step(net, opt, t)
        ref.step(grads, mask)
        if not np.allclose(flat_params(model), ref.x[R()], **tol):
            failed.append(f"step {t}: {maxdiff(flat_params(model), ref.x[R()]):.3g} from {section}")
        if (t - 1) % H == 0 and not same_on_all_ranks(model):
            failed.append(f"step {t}: parameters differ right after a periodic sync")
    return failed


@pytest.mark.parametrize("fused", ["device"])
def test_device_exchange_starts_in_ddp_hooks_before_the_backward_pass_ends(fused, monkeypatch):
    """The GPU path under DDP (docs/core.md): each DDP bucket's masked momentum is packed by the core's
    kernel and its allreduce started from slamb_hook. DDP rebuilds its buckets after the first
    iteration (six here), so from the third step on -- the grouping of the step before -- every
    bucket's exchange starts from its hook, the first one before the backward pass has computed its
    last gradient; the steps before exchange from step(). Every step equals the dense reference."""
    from slamb_comm.adapters.torch.distributed.flat_exchange import FlatExchange

    model = make_model(1)
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    opt = slamb_opt(model, fused=fused, sync_interval=3, seed=5)
    net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    events = []
    launch = FlatExchange.launch

    def logged(self, e, params, grads):
        ok = launch(self, e, params, grads)
        events.append("hook exchange" if ok else "from step()")
        return ok

    monkeypatch.setattr(FlatExchange, "launch", logged)
    first = next(model.parameters())  # the first layer's weight: the backward pass computes its gradient last
    first.register_hook(lambda g: events.append("last gradient"))
    ref = RefSlamb(flat_params(model), SHAPES, P(), lr=0.02, wd=0.01, beta3=0.9, H=3)
    (comm,) = opt.communicators
    failed, seen = [], {}
    for t in range(1, 7):
        events.clear()
        xs = everyones_params(model)
        grads = np.stack([grads_at(xs[r], r, t) for r in range(P())])
        mask = np.asarray(comm.mask.select(t))
        train_step(net, opt, t)
        ref.step(grads, mask)
        seen[t] = list(events)
        if not np.allclose(flat_params(model), ref.x[R()], rtol=2e-4, atol=2e-5):
            failed.append(f"step {t}: {maxdiff(flat_params(model), ref.x[R()]):.3g} from section 1")
    for t in range(3, 7):
        if seen[t].count("hook exchange") != 6 or seen[t].index("hook exchange") > seen[t].index("last gradient"):
            failed.append(f"step {t}: {seen[t]}")
    if "hook exchange" in seen[1] + seen[2]:
        failed.append(f"steps 1-2 exchanged from hooks before DDP's buckets settled: {seen[1]}, {seen[2]}")
    if kernel_steps() != 6:
        failed.append(f"the device kernels took {kernel_steps()} of 6 steps")
    gather_failures(failed)


@pytest.mark.parametrize("fused", [False, True, "device"])
@pytest.mark.parametrize("use_ddp", [False, True])
def test_sadamw_matches_section11_every_step(use_ddp, fused):
    """SAdamW: SLAMB's exchange under AdamW's update (docs/algorithm.md section 11), the dense
    float64 reference with the trust ratio fixed at 1 and AdamW's eps."""
    model = make_model(1)
    net = ddp(model) if use_ddp else model
    opt = st.DistributedOptimizer(
        st.SAdamW(model.parameters(), lr=0.01, ratio=0.25, beta3=0.9, weight_decay=0.01, dense_threshold=THRESHOLD,
                  sync_interval=3, seed=5, fused=fused == "device" or fused), named_parameters=model.named_parameters())
    if use_ddp:
        net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    ref = RefSlamb(flat_params(model), SHAPES, P(), lr=0.01, eps=1e-8, wd=0.01, beta3=0.9, H=3, c_min=1.0, c_max=1.0)
    gather_failures(against_reference(net, model, opt, ref, "section 11", dict(rtol=2e-4, atol=2e-5)))


# A ratio schedule as the reference's CIFAR-10 runs (denser first), with a change before the
# previous ratio's first cycle is complete (0.25 for 2 of its 4 steps), to ratio 1 and back.
SCHEDULE = {4: 0.25, 6: 0.1, 9: 1.0, 10: 0.2}


@pytest.mark.parametrize("fused", [False, True, "device"])
@pytest.mark.parametrize("use_ddp", [False, True])
def test_slamb_ratio_schedule_matches_section1_every_step(use_ddp, fused):
    """``param_group['ratio']`` changed between steps on every rank: from that step on, the
    exchange follows the new ratio's mask (one abandoned exchange at the change) and the
    result equals section 1 with f carried through every change."""
    model = make_model(1)
    net = ddp(model) if use_ddp else model
    opt = slamb_opt(model, ratio=0.5, sync_interval=3, seed=5, fused=fused)
    if use_ddp:
        net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    ref = RefSlamb(flat_params(model), SHAPES, P(), lr=0.02, wd=0.01, beta3=0.9, H=3)
    (comm,) = opt.communicators
    failed = []
    for t in range(1, 14):
        if t in SCHEDULE:
            for g in opt.param_groups:
                g["ratio"] = SCHEDULE[t]
        xs = everyones_params(model)
        grads = np.stack([grads_at(xs[r], r, t) for r in range(P())])
        train_step(net, opt, t)
        mask = np.asarray(comm.mask.select(t))  # after the step: the mask the change made
        ref.step(grads, mask)
        if not np.allclose(flat_params(model), ref.x[R()], rtol=2e-4, atol=2e-5):
            failed.append(f"step {t}: {maxdiff(flat_params(model), ref.x[R()]):.3g} from section 1")
        o = sum(int(np.prod(s)) for s in SHAPES[:2])  # the 32x32 weight: compressible
        if not np.allclose(opt.state_dict()["state"][2]["freshness"].reshape(-1), ref.f[o:o + 1024], rtol=1e-6):
            failed.append(f"step {t}: freshness differs from section 1")
    if comm.ratio != 0.2 or int(opt.state[model[0].weight]["step"]) != 13:
        failed.append(f"ratio {comm.ratio}, step {int(opt.state[model[0].weight]['step'])}")
    gather_failures(failed)


@pytest.mark.parametrize("fused", [False, True])
def test_ratio_changed_on_one_rank_raises_on_every_rank_and_changes_nothing(fused):
    model = make_model(7)
    opt = slamb_opt(model, seed=3, fused=fused)
    train_step(model, opt, 1)
    before = flat_params(model)
    culprit = P() - 1
    if R() == culprit:
        opt.param_groups[0]["ratio"] = 0.5
    failed = []
    try:
        train_step(model, opt, 2)
        if P() > 1:
            failed.append("no error")
    except slamb_comm.ConfigError as err:
        if R() != culprit or "every rank alike" not in str(err):
            failed.append(f"ConfigError here: {err}")
    except slamb_comm.PeerError as err:
        if R() == culprit or err.ranks != (culprit,):
            failed.append(f"PeerError here: {err}")
    if P() > 1:
        if not np.array_equal(flat_params(model), before) or int(opt.state[model[0].weight]["step"]) != 1:
            failed.append("the refused change moved something")
        opt.param_groups[0]["ratio"] = 0.25  # undone: training goes on
        train_step(model, opt, 3)
        if int(opt.state[model[0].weight]["step"]) != 2 or opt.communicators[0].ratio != 0.25:
            failed.append("no step after the change was undone")
    gather_failures(failed)


def test_slamb_hook_keeps_gradients_local_and_launches_from_buckets():
    model = make_model(2)
    net = ddp(model)
    opt = slamb_opt(model)
    net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    opt.zero_grad()
    (comm,) = opt.communicators
    loss_of(net, R(), 1).backward()
    local = make_model(2)
    loss_of(local, R(), 1).backward()
    mine = np.concatenate([p.grad.reshape(-1).numpy() for p in model.parameters()])
    want = np.concatenate([p.grad.reshape(-1).numpy() for p in local.parameters()])
    exchanges = lambda: comm.stats.by_kind.get("masked_allreduce", slamb_comm.Traffic()).calls  # noqa: E731
    during = exchanges()  # the exchange ran (and finished) inside backward()
    opt.step()
    failed = [] if np.allclose(mine, want, rtol=1e-6, atol=1e-7) else ["p.grad is not this rank's own gradient"]
    if during != 1 or exchanges() != 1:
        failed.append(f"{during} exchanges during backward, {exchanges()} in all (want 1 and 1)")
    with pytest.raises(RuntimeError):  # DDP's own rule: one communication hook per model
        net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    gather_failures(failed)


def test_flat_buckets_exchange_once_from_step_and_keep_gradients_local():
    """fused=True under DDP with slamb_hook: the parameters are views into the bucket's flat
    buffer, the hook leaves each rank its own gradient, and the step's one exchange (the core's
    whole-buffer one) runs in step(), also with clip_grad_norm_ in between."""
    model = make_model(2)
    net = ddp(model)
    opt = slamb_opt(model, fused=True)
    net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    (comm,) = opt.communicators
    e = opt.buckets[0]
    failed = [] if all(p.data_ptr() == v.data_ptr() for p, v in zip(e.params, e.flat.xv)) else ["not views"]
    exchanges = lambda: comm.stats.by_kind.get("masked_allreduce", slamb_comm.Traffic()).calls  # noqa: E731
    for t in range(1, 4):
        opt.zero_grad()
        loss_of(net, R(), t).backward()
        local = make_model(2)
        set_flat(local, flat_params(model))
        loss_of(local, R(), t).backward()
        mine = np.concatenate([p.grad.reshape(-1).numpy() for p in model.parameters()])
        want = np.concatenate([p.grad.reshape(-1).numpy() for p in local.parameters()])
        if not np.allclose(mine, want, rtol=1e-6, atol=1e-7):
            failed.append(f"step {t}: p.grad is not this rank's own gradient")
        during = exchanges()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        if during != t - 1 or exchanges() != t:
            failed.append(f"step {t}: {during} exchanges before step(), {exchanges()} after (want {t - 1}, {t})")
    gather_failures(failed)


@pytest.mark.parametrize("fused", [False, True, "device"])
@pytest.mark.parametrize("use_ddp", [False, True])
def test_nan_on_one_rank_skips_the_step_on_every_rank(use_ddp, fused):
    model = make_model(3)
    net = ddp(model) if use_ddp else model
    opt = slamb_opt(model, fused=fused)
    if use_ddp:
        net.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    train_step(net, opt, 1)
    before = flat_params(model)
    train_step(net, opt, 2, scale=float("nan") if R() == P() - 1 else 1.0)
    failed = [] if np.array_equal(flat_params(model), before) else ["a skipped step moved the parameters"]
    if opt.skipped_steps != 1 or int(opt.state[model[0].weight]["step"]) != 1:
        failed.append(f"skipped_steps {opt.skipped_steps}, step {int(opt.state[model[0].weight]['step'])}")
    train_step(net, opt, 3)
    if int(opt.state[model[0].weight]["step"]) != 2:
        failed.append("the step after the skipped one did not count")
    gather_failures(failed)


@pytest.mark.parametrize("fused", [False, True, "device"])
def test_checkpoint_resumes_bitwise(fused):
    model = make_model(4)
    opt = slamb_opt(model, sync_interval=2, seed=None, fused=fused)
    for t in range(1, 4):
        train_step(model, opt, t)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for t in range(4, 7):
        train_step(model, opt, t)
    want = flat_params(model)
    model2 = make_model(99)
    opt2 = slamb_opt(model2, sync_interval=2, seed=None, fused=fused)  # another random mask seed: the checkpoint's wins
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    for t in range(4, 7):
        train_step(model2, opt2, t)
    gather_failures([] if np.array_equal(flat_params(model2), want) else ["the resumed run is not bitwise the same"])


@pytest.mark.parametrize("wrapped", [False, True])
def test_options_set_after_a_load_take_effect(wrapped):
    """torch's load_state_dict makes new param_group dicts: an lr schedule writing into them
    after a resume must still reach the update (lr = 0: nothing moves)."""
    model = make_model(5)
    opt = slamb_opt(model) if wrapped else st.SLAMB(model.parameters(), lr=0.02, dense_threshold=THRESHOLD)
    train_step(model, opt, 1)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = flat_params(model)
    train_step(model, opt, 2)
    gather_failures([] if np.array_equal(flat_params(model), before) else ["lr = 0 after a load still moved"])


def test_checkpoint_mid_ratio_change_resumes_bitwise():
    """Saved two steps after 0.25 -> 0.1 (freshness still follows both masks): the checkpoint
    carries the ratio (param group) and the mask's schedule; a new optimizer built with the
    first ratio continues bitwise."""
    def run(model, opt, ts):
        for t in ts:
            if t == 3:
                opt.param_groups[0]["ratio"] = 0.1
            train_step(model, opt, t)

    model = make_model(4)
    opt = slamb_opt(model, sync_interval=4, seed=9)
    run(model, opt, range(1, 5))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    failed = [] if "mask_schedule" in saved[1]["state"][0] else ["no mask schedule in the checkpoint"]
    run(model, opt, range(5, 12))
    want = flat_params(model)
    model2 = make_model(99)
    opt2 = slamb_opt(model2, sync_interval=4, seed=None)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    run(model2, opt2, range(5, 12))
    if not np.array_equal(flat_params(model2), want):
        failed.append("the resumed run is not bitwise the same")
    gather_failures(failed)


# ============================================================================= top-k vs section 2
def make_inner(name, params):
    return {"sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            "adam": lambda: torch.optim.Adam(params, lr=0.01)}[name]()


@pytest.mark.parametrize("use_ddp", [False, True])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("ratio,dense_threshold", [(0.1, None), (1.0, None), (0.1, THRESHOLD)])
def test_topk_matches_section2(use_ddp, opt_name, ratio, dense_threshold):
    model, twin = make_model(5), make_model(5)
    inner = make_inner(opt_name, model.parameters())
    compression = slamb_comm.TopK(ratio, dense_threshold=dense_threshold)
    if use_ddp:
        net, opt = ddp(model), inner
        state = st.TopKHookState(model.named_parameters(), compression)
        net.register_comm_hook(state, st.topk_hook)
    else:
        net = model
        opt = st.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=compression)
    ref = RefTopK(twin, make_inner(opt_name, twin.parameters()), topk_counts(ratio, dense_threshold), P())
    failed = []
    for t in range(1, 7):
        x = flat_params(model)
        grads = [grads_at(x, r, t) for r in range(P())]
        ref.apply(ref.exchange(grads, P(), range(P())))
        train_step(net, opt, t)
        if not topk_close(flat_params(model), ref.x()):
            failed.append(f"step {t}: {maxdiff(flat_params(model), ref.x()):.3g} from section 2")
    if use_ddp:  # error buffers per parameter name, this rank's, as the reference's
        names = [n for n, _ in model.named_parameters()]
        mine = np.concatenate([state.state_dict()[n].reshape(-1).numpy() for n in names])
        if not np.allclose(mine, ref.errors[R()], rtol=1e-5, atol=1e-6):
            failed.append("error buffers differ from the reference's")
    if not same_on_all_ranks(model):
        failed.append("replicas differ")
    gather_failures(failed)


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_topk_hook_at_ratio_one_is_ddp_averaging(opt_name):
    a, b = make_model(6), make_model(6)
    net_a, net_b = ddp(a), ddp(b)
    net_b.register_comm_hook(st.TopKHookState(b.named_parameters(), slamb_comm.TopK(1.0)), st.topk_hook)
    opt_a, opt_b = make_inner(opt_name, a.parameters()), make_inner(opt_name, b.parameters())
    for t in range(1, 5):
        train_step(net_a, opt_a, t)
        train_step(net_b, opt_b, t)
    gather_failures([] if np.allclose(flat_params(a), flat_params(b), rtol=1e-5, atol=1e-6)
                    else [f"{maxdiff(flat_params(a), flat_params(b)):.3g} from DDP's averaging"])


class _Bucket:
    """What a DDP communication hook is handed (GradBucket's methods that the hooks use)."""

    def __init__(self, params):
        self._params = params
        self._buf = torch.cat([p.grad.reshape(-1) for p in params])
        at, self._grads = 0, []
        for p in params:
            self._grads.append(self._buf[at:at + p.numel()].view(p.shape))
            at += p.numel()

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads


def test_hooks_return_a_future_of_the_bucket_and_states_pickle():
    import pickle

    model = make_model(7)
    loss_of(model, R(), 1).backward()
    params = list(model.parameters())
    state = st.TopKHookState(model.named_parameters(), slamb_comm.TopK(0.1))
    fut = st.topk_hook(state, _Bucket(params))
    out = fut.wait()
    failed = [] if isinstance(fut, torch.futures.Future) and out.shape == (N_ALL,) else ["not a Future of the bucket"]
    again = pickle.loads(pickle.dumps(state))  # no process group inside; the error buffers come along
    if set(again.state_dict()) != {n for n, _ in model.named_parameters()}:
        failed.append("the pickled top-k state lost its error buffers")
    opt = slamb_opt(model)
    hook_state = st.SlambHookState(opt)
    fut = st.slamb_hook(hook_state, _Bucket(params))
    if not torch.equal(fut.wait(), torch.cat([p.grad.reshape(-1) for p in params])):
        failed.append("slamb_hook changed the gradients")
    opt.step()
    pickle.loads(pickle.dumps(hook_state))
    gather_failures(failed)


def test_plain_optimizer_without_compression_is_refused():
    model = make_model(8)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        st.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_torch_transport_alltoall_and_the_onebit_exchange():
    """TorchTransport.alltoall (equal blocks, as MPI_Alltoall), and the core's 1-bit exchange on
    it equal to the same exchange over MPI (the transports move the same bytes)."""
    from mpi4py import MPI

    t = st.TorchTransport()
    failed = []
    for dtype in (np.uint8, np.float32, np.int32):
        send = (np.arange(3 * P(), dtype=np.int64) + 100 * R()).astype(dtype)
        recv = np.zeros_like(send)
        t.alltoall(send, recv)
        want = np.concatenate([(np.arange(3 * R(), 3 * R() + 3) + 100 * r).astype(dtype) for r in range(P())])
        if not np.array_equal(recv, want):
            failed.append(f"alltoall {np.dtype(dtype).name}: {recv} != {want}")
    with pytest.raises(ValueError):
        t.alltoall(np.zeros(3 * P(), np.float32), np.zeros(3 * P() + 1, np.float32))
    x = [np.random.default_rng([5, R()]).standard_normal(s).astype(np.float32) for s in SHAPES]
    y = [a.copy() for a in x]
    slamb_comm.Communicator(t, x, seed=3).onebit_allreduce(x)
    slamb_comm.Communicator(slamb_comm.MPITransport(MPI.COMM_WORLD), y, seed=3).onebit_allreduce(y)
    if not all(np.array_equal(a, b) for a, b in zip(x, y)):
        failed.append("the 1-bit exchange over torch.distributed differs from the one over MPI")
    gather_failures(failed)


def test_public_api_has_docstrings():
    import inspect

    for name in st.__all__:
        obj = getattr(st, name)
        doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
        assert doc and doc.strip(), f"slamb_comm.adapters.torch.{name} has no docstring"


# ============================================================================= parameters without a gradient
LAST = (6, 7)  # the last Linear's weight and bias


def loss_without_last(model, rank, step, drop):
    """The usual loss, or (``drop``) one in which the last Linear takes no part: its gradient is None."""
    if not drop:
        return loss_of(model, rank, step)
    x, _ = batch(rank, step)
    return model[:6](x).square().mean()


def grads_dropping(flat_x, rank, step, drop):
    model = make_model(0)
    set_flat(model, flat_x)
    loss_without_last(model, rank, step, drop).backward()
    return np.concatenate([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1).double().numpy()
                           for p in model.parameters()])


def dropped(t, r):
    """The last Linear has no gradient on every rank at steps 3 and 4, and on rank 0 alone at step 6."""
    return t in (3, 4) or (t == 6 and r == 0)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mask", ["cyclic", "bernoulli"])
def test_slamb_parameter_without_gradient_on_every_rank_is_left_as_it_is(mask, fused):
    model = make_model(11)
    opt = slamb_opt(model, sync_interval=3, mask=mask, seed=3, fused=fused)
    (comm,) = opt.communicators
    ref = RefSlamb(flat_params(model), SHAPES, P(), lr=0.02, wd=0.01, beta3=0.9, H=3)
    failed = []
    for t in range(1, 9):
        xs = everyones_params(model)
        grads = np.stack([grads_dropping(xs[r], r, t, dropped(t, r)) for r in range(P())])
        everywhere = all(dropped(t, r) for r in range(P()))
        mask_t = np.asarray(comm.mask.select(t))
        last = [p.detach().clone() for p in model[6].parameters()]
        opt.zero_grad()
        loss_without_last(model, R(), t, dropped(t, R())).backward()
        opt.step()
        ref.step(grads, mask_t, skip=LAST if everywhere else ())
        if not close(flat_params(model), ref.x[R()]):
            failed.append(f"step {t}: {maxdiff(flat_params(model), ref.x[R()]):.3g} from section 1")
        if everywhere and (t - 1) % 3 and not all(torch.equal(a, b) for a, b in zip(last, model[6].parameters())):
            failed.append(f"step {t}: a parameter without any gradient moved")
    f = np.concatenate([opt.state_dict()["state"][k]["freshness"].reshape(-1).double().numpy() for k in range(8)])
    if not np.allclose(f, ref.f, rtol=1e-6, atol=0):
        failed.append(f"freshness {maxdiff(f, ref.f):.3g} from the reference's")
    gather_failures(failed)


def test_topk_parameter_without_gradient_on_every_rank_is_left_as_it_is():
    model, twin = make_model(12), make_model(12)
    opt = st.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), compression=slamb_comm.TopK(0.1))
    ref = RefTopK(twin, torch.optim.Adam(twin.parameters(), lr=0.01), topk_counts(0.1), P())
    failed = []
    for t in range(1, 8):
        x = flat_params(model)
        grads = [grads_dropping(x, r, t, dropped(t, r)) for r in range(P())]
        everywhere = all(dropped(t, r) for r in range(P()))
        tensors = [i not in LAST for i in range(len(SHAPES))] if everywhere else None
        ref.apply(ref.exchange(grads, P(), range(P()), tensors=tensors), tensors=tensors)
        opt.zero_grad()
        loss_without_last(model, R(), t, dropped(t, R())).backward()
        opt.step()
        if not topk_close(flat_params(model), ref.x()):
            failed.append(f"step {t}: {maxdiff(flat_params(model), ref.x()):.3g} from section 2")
        if everywhere and model[6].weight.grad is not None:
            failed.append(f"step {t}: p.grad was made for a parameter without any gradient")
    if not np.allclose(opt.communicators[0].residual, ref.errors[R()], rtol=1e-5, atol=1e-6):
        failed.append("error buffers differ from the reference's")
    gather_failures(failed)


@pytest.mark.parametrize("fused", [False, True])
def test_checkpoint_of_p_ranks_resumes_on_fewer(fused, tmp_path_factory):
    """docs/algorithm.md section 10 through the torch adapter: every rank saves its model and
    optimizer state with slamb_comm.methods.checkpoint; the first half of the ranks (a new process
    group: 4 -> 2, 2 -> 1) loads it. Parameters and moments are the old ranks' means, step and
    mask seed kept; training goes on, and the new ranks agree right after the next sync."""
    from mpi4py import MPI

    from slamb_comm.methods import checkpoint

    if P() == 1:
        pytest.skip("needs two ranks")
    world = MPI.COMM_WORLD
    base = world.bcast(str(tmp_path_factory.mktemp("resize")) if R() == 0 else None, root=0)
    model = make_model(20)
    opt = slamb_opt(model, sync_interval=4, seed=3, fused=fused)
    for t in range(1, 4):  # steps 2 and 3 after the sync at step 1: parameters differ per rank
        train_step(model, opt, t)
    checkpoint.save(base + "/ckpt", {"model": model.state_dict(), "opt": opt.state_dict()}, sc_transport(world))
    olds = [flat_params(model)] + [torch.cat([s["exp_avg"].reshape(-1) for s in opt.state_dict()["state"].values()])
                                   .numpy()]
    olds = world.allgather(olds)
    new = P() // 2
    group = dist.new_group(list(range(new)))
    sub = world.Split(0 if R() < new else MPI.UNDEFINED, R())
    failed = []
    if R() < new:
        st = checkpoint.load(base + "/ckpt", sc_transport(sub))
        model2 = make_model(99)
        model2.load_state_dict(st["model"])
        opt2 = st_dist_slamb(model2, group, fused)
        opt2.load_state_dict(st["opt"])
        def rule(arrays):  # section 10: the float64 sum in old rank order, times 1/P, as float32
            acc = np.zeros(arrays[0].shape, np.float64)
            for a in arrays:
                acc += a
            return (acc * (1.0 / len(arrays))).astype(np.float32)

        got_m = torch.cat([s["exp_avg"].reshape(-1) for s in opt2.state_dict()["state"].values()]).numpy()
        if not np.array_equal(flat_params(model2).astype(np.float32), rule([o[0] for o in olds])):
            failed.append("parameters are not the old ranks' mean")
        if not np.array_equal(got_m, rule([o[1] for o in olds])):
            failed.append("exp_avg is not the old ranks' mean")
        if int(opt2.state[model2[0].weight]["step"]) != 3 or opt2.communicators[0].size != new:
            failed.append("step or group size wrong after the resize")
        for t in range(4, 6):  # step 5 is a periodic sync (H = 4)
            opt2.zero_grad()
            loss_of(model2, R(), t).backward()
            opt2.step()
        rows = sub.allgather(flat_params(model2))
        if not all(np.array_equal(rows[0], r) for r in rows):
            failed.append("the new ranks differ right after the sync")
    world.Barrier()
    assert not failed, f"rank {R()}: {failed}"


def sc_transport(comm):
    return slamb_comm.MPITransport(comm)


def st_dist_slamb(model, group, fused):
    return st.DistributedOptimizer(st.SLAMB(model.parameters(), lr=0.02, ratio=0.25, beta3=0.9, weight_decay=0.01,
                                            dense_threshold=THRESHOLD, sync_interval=4, seed=3, fused=fused),
                                   named_parameters=model.named_parameters(), process_group=group)
