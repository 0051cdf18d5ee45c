"""Horovod idioms with slamb_comm's DistributedOptimizer, run under MPI:

    bash scripts/mpirun.sh 4 600 python3 -m pytest -q -p no:cacheprovider --with-mpi mpi_tests/test_horovod_idioms.py

(also at 1 and 2 ranks; an idiom that needs several ranks skips at 1). Each idiom runs in
three modes: ``topk1`` (a torch optimizer with ``compression=TopK(1.0)``), ``topk01``
(``TopK(0.1)``, no always-dense rule) and ``slamb`` (``SLAMB(dense_threshold=300)``).

Every rank recomputes every rank's gradient from seeded per-rank data, so each test compares
the library with a dense reference written out here from docs/algorithm.md: section 1 (SLAMB) in
float64 NumPy, section 2 (top-k with error feedback) in float32 with the wrapped torch
optimizer stepping a twin model on the mean. The idioms: resume by a rank-0 broadcast with
asymmetric state, options unified by ``hvd.broadcast_optimizer_state``, process sets with
non-member ranks, ``hvd.join()`` with uneven data, a layer unfrozen during training, a
mid-training ``broadcast_optimizer_state`` with a stateless optimizer, ``p.grad`` after the
startup broadcast, and TopK's ``dense_threshold``.

Inside a test, checks are collected and asserted after the test's last collective where a
failed check could otherwise leave the other ranks waiting in a collective. No test asserts
a timing; every run needs an outer timeout (scripts/mpirun.sh has one).
"""

import copy
import io
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("horovod.torch")

import slamb_comm  # noqa: E402
from slamb_comm.adapters import horovod as sh  # noqa: E402
from tests.support.mpi_checks import Checks  # noqa: E402
from tests.support.torch_reference import (  # noqa: E402
    N_ALL, SHAPES, SIZES, STARTS, THRESHOLD, RefSlamb, RefTopK, close, flat_of, flat_params, grads_at, loss_of,
    make_model, maxdiff, replay_freshness, set_flat, topk_close, topk_counts,
)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

MODES = ["topk1", "topk01", "slamb"]
TOPK_MODES = ["topk1", "topk01"]
RATIO = {"topk1": 1.0, "topk01": 0.1}


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()
    yield hvd


def need_ranks(n=2):
    if hvd.size() < n:
        pytest.skip(f"this idiom needs at least {n} ranks")


def everyones_params(model, name):
    """Every rank's current parameters as a (P, n) float64 array, through one allreduce of one-hot
    rows (exact; under hvd.join a joined rank's row is zeros).

    The references evaluate the gradients at the ranks' actual parameters, not at their own:
    a gradient element that nearly cancels amplifies the float32-vs-float64 difference of the
    parameters (1e-7) by orders of magnitude, and SLAMB divides the averaged momentum by that
    rank's local sqrt(v), so the comparison would test the conditioning of the data instead of
    the library. The reference's own parameters still evolve independently of the library's."""
    rows = torch.zeros(hvd.size(), N_ALL, dtype=torch.float64)
    rows[hvd.rank()] = torch.from_numpy(flat_params(model))
    return hvd.allreduce(rows, op=hvd.Sum, name=name).numpy()


def step_once(model, opt, t, salt=0):
    opt.zero_grad()
    loss_of(model, hvd.rank(), t, salt).backward()
    opt.step()


def everyone(t, name):
    """This tensor from every rank, stacked (rank-major)."""
    return hvd.allgather(t.detach().reshape(1, -1), name=name)


def same_on_all_ranks(model, name):
    allx = everyone(torch.from_numpy(flat_params(model)), name)
    return all(torch.equal(allx[0], allx[r]) for r in range(allx.shape[0]))


def nobody_waits(tag):
    """A collective after a failure succeeds on every rank: no rank is stuck in an exchange."""
    out = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name=f"idioms.after.{tag}")
    assert float(out[0]) == hvd.size()


def checkpoint_bytes(model, opt):
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def rank0_checkpoint(model, opt, name):
    """Rank 0's checkpoint (model + optimizer state), as every rank sees it (for the references)."""
    blob = checkpoint_bytes(model, opt) if hvd.rank() == 0 else None
    blob = hvd.broadcast_object(blob, 0, name=name)
    return torch.load(io.BytesIO(blob))


# ----------------------------------------------------------------------------- optimizers
SLAMB_KW = dict(lr=0.02, ratio=0.25, beta3=0.9, weight_decay=0.01)


def slamb_opt(model, process_set=None, **kw):
    kw = {**SLAMB_KW, **kw}
    kw.setdefault("dense_threshold", THRESHOLD)
    extra = {} if process_set is None else {"process_set": process_set}
    return sh.DistributedOptimizer(sh.SLAMB(model.parameters(), **kw), named_parameters=model.named_parameters(),
                                   **extra)


def topk_opt(model, mode, inner=None, process_set=None, dense_threshold=None):
    inner = inner if inner is not None else torch.optim.Adam(model.parameters(), lr=0.01)
    extra = {} if process_set is None else {"process_set": process_set}
    comp = sh.TopK(RATIO[mode]) if dense_threshold is None else sh.TopK(RATIO[mode], dense_threshold=dense_threshold)
    return sh.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=comp, **extra)


def build(mode, model, process_set=None, **slamb_kw):
    if mode == "slamb":
        return slamb_opt(model, process_set=process_set, **slamb_kw)
    return topk_opt(model, mode, process_set=process_set)


# ----------------------------------------------------------------------------- references
def mask_of(opt, which=0):
    comm = opt.communicators[which]
    return lambda t: np.asarray(comm.mask.select(t))


def residuals(opt):
    """This rank's error buffers, from ``opt.state_dict()['slamb_comm_topk']`` (None: not yet used)."""
    return [None if s["residual"] is None else s["residual"].clone() for s in opt.state_dict()["slamb_comm_topk"]]


def same_residuals(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            if not (x is None and y is None):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def is_zero_residual(r):
    return r is None or float(r.abs().sum()) == 0.0


# ============================================================================= 1. resume by rank-0 broadcast
@pytest.mark.parametrize("mode", MODES)
def test_resume_by_rank0_broadcast_with_asymmetric_state(mode, caplog):
    """Rank 0 saves; every rank builds a new model and optimizer; ONLY rank 0 loads; then
    broadcast_parameters + broadcast_optimizer_state and training goes on (Horovod's idiom)."""
    P, rank, N, M, H = hvd.size(), hvd.rank(), 4, 4, 3
    chk = Checks()
    model = make_model(7)
    opt = build(mode, model, sync_interval=H, seed=7)
    for t in range(1, N + 1):
        step_once(model, opt, t)
    ck = rank0_checkpoint(model, opt, f"idioms.resume.{mode}")
    ck_x = flat_of(ck["model"].values())
    orig_mask = mask_of(opt) if mode == "slamb" else None

    model2 = make_model(99 + rank)  # different everywhere: the parameters must come from rank 0
    opt2 = build(mode, model2, sync_interval=H, seed=1000 + rank)
    if rank == 0:
        model2.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
    hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
    before = flat_params(model2)
    chk(np.array_equal(before, ck_x), "broadcast_parameters did not give rank 0's saved parameters")
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="slamb_comm")
    hvd.broadcast_optimizer_state(opt2, root_rank=0)  # hung for TopK before: a hidden step on ranks != 0 only
    chk(np.array_equal(flat_params(model2), before), "broadcast_optimizer_state moved a parameter")
    params = list(model2.parameters())

    if mode == "slamb":
        for i, p in enumerate(params):
            st, saved = opt2.state[p], ck["opt"]["state"][i]
            chk(int(float(st["step"])) == N, f"step count {float(st['step'])} != {N}")
            chk(torch.equal(st["exp_avg"], saved["exp_avg"]), f"exp_avg of tensor {i} is not rank 0's")
            chk(torch.equal(st["exp_avg_sq"], saved["exp_avg_sq"]), f"exp_avg_sq of tensor {i} is not rank 0's")
            chk(int(st["mask_seed"]) == 7, f"mask seed {st['mask_seed']} is not rank 0's 7")
        m0 = flat_of(ck["opt"]["state"][i]["exp_avg"] for i in range(len(params)))
        v0 = flat_of(ck["opt"]["state"][i]["exp_avg_sq"] for i in range(len(params)))
        ref = RefSlamb(ck_x, SHAPES, P, lr=0.02, wd=0.01, beta3=0.9, H=H, m0=m0, v0=v0, t0=N,
                       f0=replay_freshness(orig_mask, N, N_ALL, 0.9))
        for t in range(N + 1, N + M + 1):
            xs = everyones_params(model2, f"idioms.resume.x.{t}")
            grads = np.stack([grads_at(xs[r], r, t) for r in range(P)])
            step_once(model2, opt2, t)
            if t == N + 1 and rank != 0:
                warned = [r for r in caplog.records if r.name == "slamb_comm" and r.levelno == logging.WARNING
                          and "broadcast" in r.getMessage().lower()]
                chk(warned, "no WARNING on logger 'slamb_comm' mentioning 'broadcast' on a rank whose state "
                            "was replaced by the broadcast")
            ref.step(grads, orig_mask(t))  # rank 0's mask seed (7) on every rank
            chk(close(flat_params(model2), ref.x[rank]), f"step {t}: {maxdiff(flat_params(model2), ref.x[rank]):.3g} "
                                                        "from section 1 started from rank 0's state")
        chk(int(opt2.communicators[0].seed) == 7, "mask seed is not rank 0's")
    else:
        sd_saved = ck["opt"]
        for i, p in enumerate(params):
            st, saved = opt2.state[p], sd_saved["state"][i]
            for k in ("step", "exp_avg", "exp_avg_sq"):
                chk(torch.equal(torch.as_tensor(st[k]), torch.as_tensor(saved[k])),
                    f"Adam {k} of tensor {i} is not rank 0's")
        mine = residuals(opt2)
        saved_res = [s["residual"] for s in sd_saved["slamb_comm_topk"]]
        if rank == 0:
            chk(same_residuals(mine, saved_res), "rank 0's error buffer is not its saved one")
        else:
            chk(all(is_zero_residual(r) for r in mine), "a fresh rank's error buffer is not zeros")
        twin = make_model(0)
        twin.load_state_dict(ck["model"])
        twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
        # a deep copy: torch's load_state_dict keeps the very tensors it is given, and rank 0's
        # optimizer was loaded from these
        twin_opt.load_state_dict(copy.deepcopy({k: v for k, v in sd_saved.items() if k != "slamb_comm_topk"}))
        ref = RefTopK(twin, twin_opt, topk_counts(RATIO[mode]), P)
        (res0,) = saved_res
        ref.errors[0] = np.zeros(N_ALL, np.float32) if res0 is None else res0.numpy()  # rank 0's; the others: zeros
        for t in range(N + 1, N + M + 1):
            x = flat_params(model2)  # the replicas' parameters (identical where they exchange)
            grads = [grads_at(x, r, t) for r in range(P)]
            ref.apply(ref.exchange(grads, P, range(P)))
            step_once(model2, opt2, t)
            chk(topk_close(flat_params(model2), ref.x()), f"step {t}: {maxdiff(flat_params(model2), ref.x()):.3g} "
                                                         "from section 2 with rank 0's state")
        (res,) = residuals(opt2)
        chk(res is not None and np.allclose(res.numpy(), ref.errors[rank], rtol=1e-5, atol=1e-6),
            "error buffer differs from section 2's")
        chk(same_on_all_ranks(model2, f"idioms.resume.same.{mode}"), "replicas differ")
    chk.done()


# ============================================================================= 2. options unified by the broadcast
def per_rank_options(mode, rank):
    if mode == "slamb":
        return dict(lr=0.02 * (1 + rank), betas=(0.9 - 0.05 * rank, 0.999 - 0.001 * rank), eps=1e-6 * 10 ** rank,
                    weight_decay=0.01 + 0.02 * rank, beta3=0.9 + 0.02 * rank)
    # Not weight_decay: Horovod's hidden step (zero gradients, before the broadcast) runs the wrapped
    # optimizer with each rank's own options, and a per-rank weight decay moves that rank's
    # parameters there, in plain Horovod as here (the README says so).
    return dict(lr=0.01 * (1 + rank), betas=(0.9 - 0.05 * rank, 0.999 - 0.001 * rank), eps=1e-8 * 10 ** rank)


@pytest.mark.parametrize("mode", MODES)
def test_options_unified_by_broadcast_optimizer_state(mode):
    P, rank, steps, H = hvd.size(), hvd.rank(), 4, 3
    chk = Checks()
    model = make_model(21)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    mine, root = per_rank_options(mode, rank), per_rank_options(mode, 0)
    if mode == "slamb":
        opt = slamb_opt(model, sync_interval=H, **mine)
    else:
        opt = topk_opt(model, mode, inner=torch.optim.Adam(model.parameters(), **mine))
    before = flat_params(model)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    chk(np.array_equal(flat_params(model), before), "broadcast_optimizer_state moved a parameter "
                                                    f"(rank {rank}'s own options: {mine})")
    for g in opt.param_groups:
        for k, v in root.items():
            got = tuple(g[k]) if k == "betas" else g[k]
            chk(got == v, f"param_groups {k} = {got!r}, rank 0's is {v!r}")
    if mode == "slamb":
        ref = RefSlamb(before, SHAPES, P, lr=root["lr"], betas=root["betas"], eps=root["eps"],
                       wd=root["weight_decay"], beta3=root["beta3"], H=H)
        for t in range(1, steps + 1):
            xs = everyones_params(model, f"idioms.options.x.{t}")
            grads = np.stack([grads_at(xs[r], r, t) for r in range(P)])
            step_once(model, opt, t)
            ref.step(grads, mask_of(opt)(t))
            chk(close(flat_params(model), ref.x[rank]), f"step {t}: {maxdiff(flat_params(model), ref.x[rank]):.3g} "
                                                       "from section 1 with rank 0's options")
    else:
        twin = make_model(21)
        set_flat(twin, before)
        twin_opt = torch.optim.Adam(twin.parameters(), **root)
        if len(opt.state):  # Horovod's hidden step (zero gradients) created the state: mirror it
            for p in twin.parameters():
                p.grad = torch.zeros_like(p)
            twin_opt.step()
            for p, q in zip(model.parameters(), twin.parameters()):
                for k in ("step", "exp_avg", "exp_avg_sq"):
                    chk(torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(twin_opt.state[q][k])),
                        f"Adam {k} after the broadcast is not rank 0's")
        ref = RefTopK(twin, twin_opt, topk_counts(RATIO[mode]), P)
        for t in range(1, steps + 1):
            x = flat_params(model)  # the replicas' parameters (identical where they exchange)
            grads = [grads_at(x, r, t) for r in range(P)]
            ref.apply(ref.exchange(grads, P, range(P)))
            step_once(model, opt, t)
            chk(topk_close(flat_params(model), ref.x()), f"step {t}: {maxdiff(flat_params(model), ref.x()):.3g} "
                                                        "from section 2 with rank 0's options")
        chk(same_on_all_ranks(model, f"idioms.options.same.{mode}"), "replicas differ")
    chk.done()


def test_slamb_differing_update_options_without_broadcast_raise_config_error_at_first_step():
    need_ranks(2)
    model = make_model(22)
    opt = slamb_opt(model, sync_interval=3, **per_rank_options("slamb", hvd.rank()))  # construction succeeds
    before = flat_params(model)
    opt.zero_grad()
    loss_of(model, hvd.rank(), 1).backward()
    with pytest.raises(slamb_comm.ConfigError):
        opt.step()
    assert np.array_equal(flat_params(model), before)
    assert all(int(float(opt.state[p]["step"])) == 0 for p in model.parameters())
    nobody_waits("options.nobroadcast")


EXCHANGE_OPTIONS = [
    ("slamb", "ratio", 0.5), ("slamb", "mask", "bernoulli"), ("slamb", "value_dtype", "float16"),
    ("slamb", "dense_threshold", 1000), ("slamb", "block", 16),
    ("topk", "ratio", 0.2), ("topk", "dense_threshold", THRESHOLD),
]


@pytest.mark.parametrize("kind,option,value", EXCHANGE_OPTIONS)
def test_exchange_options_differing_between_ranks_fail_at_construction(kind, option, value):
    need_ranks(2)
    culprit = hvd.size() - 1
    model = make_model(23)
    with pytest.raises(slamb_comm.SlambCommError):
        if kind == "slamb":
            kw = {option: value} if hvd.rank() == culprit else {}
            slamb_opt(model, **kw)
        else:
            tk = dict(ratio=0.1)  # rank 0: the default dense_threshold (None)
            if hvd.rank() == culprit:
                tk[option] = value
            sh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), compression=sh.TopK(**tk))
    nobody_waits(f"options.exchange.{kind}.{option}")


# ============================================================================= 3. process sets
@pytest.mark.parametrize("mode", MODES)
def test_process_set_with_non_member_ranks(mode):
    """ps = the even ranks; every rank builds the optimizer with process_set=ps. Members exchange
    among themselves; non-members optimise alone (SLAMB with P = 1; TopK: the wrapped optimizer
    on the local gradient, as Horovod does)."""
    need_ranks(2)
    P, rank, steps, H = hvd.size(), hvd.rank(), 4, 2
    members = list(range(0, P, 2))
    member = rank in members
    chk = Checks()
    ps = hvd.add_process_set(members)
    try:
        model = make_model(31)
        try:
            opt = build(mode, model, process_set=ps, sync_interval=H)
        except Exception as err:  # noqa: BLE001 -- reported after the process set is removed
            chk(False, f"building the optimizer with process_set={members} raised {type(err).__name__}: {err}")
            opt = None
        if opt is not None:
            x0 = flat_params(model)
            if mode == "slamb":
                ref = (RefSlamb(x0, SHAPES, len(members), H=H, lr=0.02, wd=0.01, beta3=0.9) if member
                       else RefSlamb(x0, SHAPES, 1, H=H, lr=0.02, wd=0.01, beta3=0.9))
                row = members.index(rank) if member else 0
                for t in range(1, steps + 1):
                    ranks = members if member else [rank]
                    xs = everyones_params(model, f"idioms.ps.x.{t}")
                    grads = np.stack([grads_at(xs[r], r, t) for r in ranks])
                    step_once(model, opt, t)
                    ref.step(grads, mask_of(opt)(t))
                    chk(close(flat_params(model), ref.x[row]),
                        f"step {t} ({'member' if member else 'non-member'}): "
                        f"{maxdiff(flat_params(model), ref.x[row]):.3g} from section 1")
            else:
                twin = make_model(31)
                ref = RefTopK(twin, torch.optim.Adam(twin.parameters(), lr=0.01), topk_counts(RATIO[mode]), P)
                for t in range(1, steps + 1):
                    x = flat_params(model)  # the replicas' parameters (identical where they exchange)
                    if member:
                        grads = {r: grads_at(x, r, t) for r in members}
                        ref.apply(ref.exchange(grads, len(members), members))
                    else:
                        ref.local(grads_at(x, rank, t))
                    step_once(model, opt, t)
                    chk(topk_close(flat_params(model), ref.x()),
                        f"step {t} ({'member' if member else 'non-member'}): "
                        f"{maxdiff(flat_params(model), ref.x()):.3g} from the reference")
            del opt
    finally:
        hvd.remove_process_set(ps)
    chk.done()


# ============================================================================= 4. hvd.join with uneven data
@pytest.mark.parametrize("mode", MODES)
def test_join_with_uneven_data_across_a_sync_step(mode):
    """The last rank trains 2 steps and joins; the others train 5 (SLAMB syncs after steps 1, 3,
    5) and join. A joined rank contributes zeros; SLAMB's periodic sync averages the ranks still
    stepping; the joined rank's parameters stay as they were."""
    need_ranks(2)
    P, rank, H, short, long_ = hvd.size(), hvd.rank(), 2, 2, 5
    last = P - 1
    mine = short if rank == last else long_
    chk = Checks()
    model = make_model(41)
    opt = build(mode, model, sync_interval=H)
    if mode == "slamb":
        ref = RefSlamb(flat_params(model), SHAPES, P, lr=0.02, wd=0.01, beta3=0.9, H=H)
    else:
        twin = make_model(41)
        ref = RefTopK(twin, torch.optim.Adam(twin.parameters(), lr=0.01), topk_counts(RATIO[mode]), P)
    try:
        for t in range(1, mine + 1):
            active = list(range(P)) if t <= short else [r for r in range(P) if r != last]
            if mode == "slamb":
                xs = everyones_params(model, f"idioms.join.x.{t}")
                grads = np.stack([grads_at(xs[r], r, t) if r in active else np.zeros(N_ALL) for r in range(P)])
                step_once(model, opt, t)
                ref.step(grads, mask_of(opt)(t), active=active)
                want = ref.x[rank]
                chk(close(flat_params(model), want), f"step {t} (active {active}): "
                                                     f"{maxdiff(flat_params(model), want):.3g} from section 1")
            else:
                x = flat_params(model)  # the replicas' parameters (identical where they exchange)
                grads = {r: grads_at(x, r, t) for r in active}
                ref.apply(ref.exchange(grads, P, active))
                step_once(model, opt, t)
                chk(topk_close(flat_params(model), ref.x()),
                    f"step {t} (active {active}): {maxdiff(flat_params(model), ref.x()):.3g} from section 2")
    except Exception as err:  # noqa: BLE001 -- join anyway, so that no rank waits for this one
        chk(False, f"training raised {type(err).__name__}: {err}")
    at_join = flat_params(model)
    hvd.join()
    chk(np.array_equal(flat_params(model), at_join), "parameters changed after join")
    chk.done()


# ============================================================================= 5. a layer unfrozen during training
FROZEN = (2, 3)  # model[2] (Linear 32x32): weight (compressible) and bias
MAIN = [i for i in range(len(SHAPES)) if i not in FROZEN]


def _index(tensors):
    return np.concatenate([np.arange(STARTS[i], STARTS[i] + SIZES[i]) for i in tensors])


@pytest.mark.parametrize("mode", MODES)
def test_layer_frozen_at_construction_and_unfrozen_later(mode):
    P, rank, H, frozen_steps, more = hvd.size(), hvd.rank(), 3, 2, 3
    chk = Checks()
    model = make_model(51)
    for p in model[2].parameters():
        p.requires_grad_(False)
    opt = build(mode, model, sync_interval=H)
    x0 = flat_params(model)
    steps = frozen_steps + more
    if mode == "slamb":
        main_idx, new_idx = _index(MAIN), _index(FROZEN)
        x_all = np.tile(x0, (P, 1))
        kw = dict(lr=0.02, wd=0.01, beta3=0.9, H=H)
        ref_main = RefSlamb(x0[main_idx], [SHAPES[i] for i in MAIN], P, **kw)
        ref_new = None
        for t in range(1, steps + 1):
            if t == frozen_steps + 1:
                for p in model[2].parameters():
                    p.requires_grad_(True)
                ref_new = RefSlamb(x0[new_idx], [SHAPES[i] for i in FROZEN], P, **kw)  # fresh state, own step count
            xs = everyones_params(model, f"idioms.unfreeze.x.{t}")
            grads = np.stack([grads_at(xs[r], r, t) for r in range(P)])
            step_once(model, opt, t)
            comms = {tuple(tuple(s) for s in c.layout.shapes): c for c in opt.communicators}
            main_c = comms.get(tuple(SHAPES[i] for i in MAIN))
            new_c = comms.get(tuple(SHAPES[i] for i in FROZEN))
            if main_c is None or (ref_new is not None and new_c is None):
                chk(False, f"step {t}: buckets {list(comms)}: expected the main one and (after the unfreeze) "
                           "one of the unfrozen layer")
                break
            ref_main.step(grads[:, main_idx], np.asarray(main_c.mask.select(t)))
            x_all[:, main_idx] = ref_main.x
            if ref_new is not None:
                ref_new.step(grads[:, new_idx], np.asarray(new_c.mask.select(t - frozen_steps)))
                x_all[:, new_idx] = ref_new.x
            chk(close(flat_params(model), x_all[rank]), f"step {t}: {maxdiff(flat_params(model), x_all[rank]):.3g} "
                                                       "from section 1 (the unfrozen bucket counts from 1)")
        st_main, st_new = opt.state[model[0].weight], opt.state.get(model[2].weight, {})
        chk(int(float(st_main.get("step", -1))) == steps, f"main bucket step {st_main.get('step')}")
        chk(int(float(st_new.get("step", -1))) == more, f"unfrozen bucket step {st_new.get('step')}, expected {more}")
    else:
        twin = make_model(51)
        ref = RefTopK(twin, torch.optim.Adam(twin.parameters(), lr=0.01), topk_counts(RATIO[mode]), P)
        tensors = [i not in FROZEN for i in range(len(SHAPES))]
        for t in range(1, steps + 1):
            if t == frozen_steps + 1:
                for p in model[2].parameters():
                    p.requires_grad_(True)
                tensors = [True] * len(SHAPES)
            x = flat_params(model)  # the replicas' parameters (identical where they exchange)
            grads = [grads_at(x, r, t) for r in range(P)]
            ref.apply(ref.exchange(grads, P, range(P), tensors), tensors)
            step_once(model, opt, t)
            chk(topk_close(flat_params(model), ref.x()), f"step {t}: {maxdiff(flat_params(model), ref.x()):.3g} "
                                                        "from section 2 (the layer exchanged from the unfreeze on)")
        chk(same_on_all_ranks(model, f"idioms.unfreeze.same.{mode}"), "replicas differ")
    chk(not np.array_equal(flat_params(model)[_index(FROZEN)], x0[_index(FROZEN)]), "the unfrozen layer did not move")
    chk.done()


@pytest.mark.parametrize("mode", MODES)
def test_layer_unfrozen_on_one_rank_only_raises_on_every_rank(mode):
    need_ranks(2)
    culprit = hvd.size() - 1
    model = make_model(52)
    for p in model[2].parameters():
        p.requires_grad_(False)
    opt = build(mode, model, sync_interval=3)
    for t in (1, 2):
        step_once(model, opt, t)
    if hvd.rank() == culprit:
        for p in model[2].parameters():
            p.requires_grad_(True)
    with pytest.raises(slamb_comm.SlambCommError) as info:
        step_once(model, opt, 3)
    expected = slamb_comm.LayoutError if hvd.rank() == culprit else slamb_comm.PeerError
    assert isinstance(info.value, expected), (type(info.value).__name__, str(info.value))
    if hvd.rank() != culprit:
        assert not isinstance(info.value, slamb_comm.LayoutError)
    nobody_waits(f"unfreeze.one.{mode}")


# ============================================================================= 6. mid-training broadcast
@pytest.mark.parametrize("mode", MODES)
def test_broadcast_optimizer_state_mid_training(mode):
    """TopK with stateless SGD: Horovod's hidden step must not send the error-feedback remainder
    (parameters and error buffers unchanged). SLAMB: every rank's state becomes rank 0's, the step
    count is kept, the parameters are unchanged."""
    P, rank, N, M = hvd.size(), hvd.rank(), 3, 3
    chk = Checks()
    model = make_model(61)
    if mode == "slamb":
        opt = slamb_opt(model, sync_interval=100)
        ref = RefSlamb(flat_params(model), SHAPES, P, lr=0.02, wd=0.01, beta3=0.9, H=100)
        for t in range(1, N + 1):
            xs = everyones_params(model, f"idioms.mid.x.{t}")
            grads = np.stack([grads_at(xs[r], r, t) for r in range(P)])
            step_once(model, opt, t)
            ref.step(grads, mask_of(opt)(t))
        params = list(model.parameters())
        root = {}
        for i, p in enumerate(params):
            for k in ("exp_avg", "exp_avg_sq"):
                root[i, k] = hvd.broadcast(opt.state[p][k].clone(), 0, name=f"idioms.mid.root.{i}.{k}")
        before = flat_params(model)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        chk(np.array_equal(flat_params(model), before), "broadcast_optimizer_state moved a parameter")
        for i, p in enumerate(params):
            for k in ("exp_avg", "exp_avg_sq"):
                chk(torch.equal(opt.state[p][k], root[i, k]), f"{k} of tensor {i} is not rank 0's")
            chk(int(float(opt.state[p]["step"])) == N, f"step count {float(opt.state[p]['step'])} != {N}")
        m0 = flat_of(root[i, "exp_avg"] for i in range(len(params)))
        v0 = flat_of(root[i, "exp_avg_sq"] for i in range(len(params)))
        ref.m[:], ref.v[:] = m0, v0  # every rank goes on from rank 0's moments, its own parameters
        for t in range(N + 1, N + M + 1):
            xs = everyones_params(model, f"idioms.mid.x.{t}")
            grads = np.stack([grads_at(xs[r], r, t) for r in range(P)])
            step_once(model, opt, t)
            ref.step(grads, mask_of(opt)(t))
            chk(close(flat_params(model), ref.x[rank]), f"step {t}: {maxdiff(flat_params(model), ref.x[rank]):.3g}")
        chk(int(float(opt.state[params[0]]["step"])) == N + M, "step count after the broadcast")
    else:
        opt = topk_opt(model, mode, inner=torch.optim.SGD(model.parameters(), lr=0.05))
        twin = make_model(61)
        ref = RefTopK(twin, torch.optim.SGD(twin.parameters(), lr=0.05), topk_counts(RATIO[mode]), P)

        def steps(ts):
            for t in ts:
                x = flat_params(model)  # the replicas' parameters (identical where they exchange)
                grads = [grads_at(x, r, t) for r in range(P)]
                ref.apply(ref.exchange(grads, P, range(P)))
                step_once(model, opt, t)
                chk(topk_close(flat_params(model), ref.x()), f"step {t}: {maxdiff(flat_params(model), ref.x()):.3g} "
                                                            "from the uninterrupted section-2 run")

        steps(range(1, N + 1))
        before, res_before = flat_params(model), residuals(opt)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        chk(np.array_equal(flat_params(model), before), "broadcast_optimizer_state moved a parameter "
                                                        f"(by up to {maxdiff(flat_params(model), before):.3g})")
        chk(same_residuals(residuals(opt), res_before), "broadcast_optimizer_state changed the error buffers")
        steps(range(N + 1, N + M + 1))
        chk(same_on_all_ranks(model, f"idioms.mid.same.{mode}"), "replicas differ")
    chk.done()


# ============================================================================= 7. p.grad after the startup broadcast
@pytest.mark.parametrize("mode", MODES)
def test_grads_after_startup_broadcast(mode):
    """Horovod's test_broadcast_state_no_grad: with requires_grad=False parameters (a float bias,
    and an int32 one as in Horovod's test)."""
    model = make_model(71)
    frozen = model[6].bias
    frozen.requires_grad_(False)
    model.register_parameter("index", torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                                         requires_grad=False))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if mode == "slamb":
        opt = slamb_opt(model)
    else:
        opt = topk_opt(model, mode, inner=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    before, frozen_before = flat_params(model), frozen.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert np.array_equal(flat_params(model), before)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert frozen.grad is None and model.index.grad is None
    if mode == "slamb":  # SLAMB's state exists from construction: no hidden step, no gradient
        assert all(p.grad is None for p in model.parameters())
    else:  # Horovod's hidden step ran the wrapped optimizer locally on zero gradients
        assert all(p.grad is not None and float(p.grad.abs().sum()) == 0.0 for p in trainable)
        assert all("momentum_buffer" in opt.state[p] for p in trainable)
    for t in (1, 2):
        step_once(model, opt, t)
    assert torch.equal(frozen, frozen_before)
    assert model.index.tolist() == [1, 3]
    if mode != "slamb":
        assert same_on_all_ranks(model, f"idioms.nograd.same.{mode}")


# ============================================================================= 8. TopK dense_threshold
@pytest.mark.parametrize("dense_threshold", [None, THRESHOLD])
def test_topk_dense_threshold_counts_and_training(dense_threshold):
    P, steps = hvd.size(), 4
    comp = sh.TopK(0.1, dense_threshold=dense_threshold)
    assert "dense_threshold" in repr(comp) and repr(dense_threshold) in repr(comp)
    model = make_model(81)
    opt = sh.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), compression=comp)
    counts = topk_counts(0.1, dense_threshold)
    if dense_threshold is not None:
        # biases, 6x32 and 24x3 whole; 32x32 and 32x24 their top 10 %
        assert counts == [192, 32, 102, 32, 77, 24, 72, 3]
    else:
        assert counts == [slamb_comm.k_elems(0.1, n) for n in SIZES]
    (comm,) = opt.communicators
    assert list(comm.wire.counts) == counts
    twin = make_model(81)
    ref = RefTopK(twin, torch.optim.Adam(twin.parameters(), lr=0.01), counts, P)
    chk = Checks()
    for t in range(1, steps + 1):
        x = flat_params(model)  # the replicas' parameters (identical where they exchange)
        grads = [grads_at(x, r, t) for r in range(P)]
        ref.apply(ref.exchange(grads, P, range(P)))
        step_once(model, opt, t)
        chk(topk_close(flat_params(model), ref.x()), f"step {t}: {maxdiff(flat_params(model), ref.x()):.3g}")
    chk(same_on_all_ranks(model, f"idioms.dense.same.{dense_threshold}"), "replicas differ")
    chk.done()


# ============================================================================= 11. ratio schedule
SCHEDULE = {4: 0.1, 6: 0.5, 8: 1.0, 9: 0.25}  # 0.25 -> 0.1 -> 0.5 after 2 of 0.1's 10 steps -> ...


def test_slamb_ratio_schedule_matches_section1():
    """``param_group['ratio']`` changed between steps on every rank (a schedule, as the
    reference's CIFAR-10 runs): section 1 with f carried through every change, at every step."""
    model = make_model(61)
    opt = slamb_opt(model, sync_interval=3, seed=4)
    ref = RefSlamb(flat_params(model), SHAPES, hvd.size(), lr=0.02, wd=0.01, beta3=0.9, H=3)
    mask = mask_of(opt)
    checks = Checks()
    for t in range(1, 13):
        if t in SCHEDULE:
            opt.param_groups[0]["ratio"] = SCHEDULE[t]
        xs = everyones_params(model, f"sched.x.{t}")
        grads = np.stack([grads_at(xs[r], r, t) for r in range(hvd.size())])
        step_once(model, opt, t)
        ref.step(grads, mask(t))
        checks(close(flat_params(model), ref.x[hvd.rank()]),
                      f"step {t}: {maxdiff(flat_params(model), ref.x[hvd.rank()]):.3g} from section 1")
    checks(opt.communicators[0].ratio == 0.25, f"ratio {opt.communicators[0].ratio}")
    checks.done()


def test_slamb_ratio_changed_on_one_rank_only_raises_on_every_rank():
    need_ranks(2)
    culprit = hvd.size() - 1
    model = make_model(62)
    opt = slamb_opt(model)
    step_once(model, opt, 1)
    before = flat_params(model)
    if hvd.rank() == culprit:
        opt.param_groups[0]["ratio"] = 0.5
    with pytest.raises(slamb_comm.SlambCommError) as info:
        step_once(model, opt, 2)
    expected = slamb_comm.ConfigError if hvd.rank() == culprit else slamb_comm.PeerError
    assert isinstance(info.value, expected), (type(info.value).__name__, str(info.value))
    assert np.array_equal(flat_params(model), before) and int(opt.state[model[0].weight]["step"]) == 1
    nobody_waits("ratio.one")
