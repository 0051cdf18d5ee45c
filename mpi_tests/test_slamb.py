"""SLAMB on flat buffers over MPI, against the dense reference of docs/algorithm.md section 1."""

import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from slamb_comm.methods.slamb import SlambRule

from tests.support.slamb_reference import ReferenceSlamb

from tests.support import strict_cupy  # noqa: E402  (the device kernels run on the CPU through it)

SHAPES = [(60, 200), (200,), (30, 40), (40, 250)]  # (30, 40) is below the dense threshold


def rank_params(r, dtype):
    rng = np.random.default_rng(100 + r)
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def rank_grads(r, t, xs, dtype):
    """Gradient of rank r at step t: depends on the rank's parameters and on (r, t)."""
    rng = np.random.default_rng([7, r, t])
    return [(0.5 * x.astype(np.float64) + rng.standard_normal(x.shape)).astype(dtype) for x in xs]


def run(ratio, dtype=np.float64, value_dtype=None, steps=22, H=5, beta3=0.9, wd=0.01, check_every=True, block=1,
        schedule=None, fused=False):
    """``fused``: step on one fused buffer of device arrays (the strict CuPy double), so that the
    device kernels of slamb_comm.device.slamb_step run, as on a GPU."""
    if fused:
        with strict_cupy.install() as cp:
            strict_cupy.Device.current = 0
            return _run(ratio, dtype, value_dtype, steps, H, beta3, wd, block, schedule, cp)
    return _run(ratio, dtype, value_dtype, steps, H, beta3, wd, block, schedule, None)


def _run(ratio, dtype, value_dtype, steps, H, beta3, wd, block, schedule, cp):
    comm_world = MPI.COMM_WORLD
    P, me = comm_world.size, comm_world.rank
    x = rank_params(me, dtype)
    comm = sc.Communicator(sc.MPITransport(), x, ratio=ratio, mask="cyclic", seed=11, value_dtype=value_dtype,
                           block=block)
    opt = SlambRule(comm, lr=0.02, weight_decay=wd, beta3=beta3, sync_interval=H)
    if cp is not None:
        flat = cp.asarray(np.concatenate([a.ravel() for a in x]))
    ref = ReferenceSlamb([rank_params(r, dtype) for r in range(P)], comm.layout.offsets, lr=0.02,
                         wd=wd, beta3=beta3, H=H)
    worst = 0.0
    for t in range(1, steps + 1):
        grads = [rank_grads(r, t, [a.astype(dtype) for a in ref.x[r]], dtype) for r in range(P)]
        if schedule and t in schedule:  # a ratio schedule: the new ratio from step t on
            opt.set_ratio(schedule[t])
        if cp is not None:
            opt.step(flat, cp.asarray(np.concatenate([g.ravel() for g in grads[me]])))
            x = comm.layout.views(flat.get())
        else:
            opt.step(x, [g.copy() for g in grads[me]])
        ref.step([[g.astype(np.float64) for g in gr] for gr in grads], comm.mask.select(t).index.astype(np.int64))
        for mine, want in zip(x, ref.x[me]):
            worst = max(worst, float(np.max(np.abs(mine - want)) / np.max(np.abs(want))))  # relative to the tensor's scale
        if (t - 1) % H == 0:
            everyone = comm_world.allgather(np.concatenate([a.ravel() for a in x]))
            for r in range(P):
                assert np.array_equal(everyone[r], everyone[0]), f"step {t}: rank {r} differs after sync"
    return x, ref, comm, opt, worst


@pytest.mark.mpi
@pytest.mark.parametrize("ratio", [0.1, 0.3, 1.0])
def test_slamb_matches_reference_fp64(ratio):
    _, _, _, _, worst = run(ratio, np.float64)
    assert worst < 1e-9, worst


@pytest.mark.mpi
@pytest.mark.parametrize("block", [16, 256])
def test_slamb_with_run_mask_matches_reference(block):
    """The reference takes M_t as given, so a mask of whole runs must give the same formulas."""
    _, _, comm, _, worst = run(0.1, np.float64, block=block)
    assert comm.mask.select(1).blocks is not None
    assert worst < 1e-9, worst


# The reference implementation's CIFAR-10 schedule (0.5, 0.5, 0.2, then 0.1, per epoch) with
# epochs of 4 steps; then changes before the previous ratio's first cycle is complete (0.1 ->
# 0.3 after 4 of its 10 steps, 0.3 -> 1.0 -> 0.1), so that freshness follows three masks at once.
SCHEDULE = {1: 0.5, 9: 0.2, 13: 0.1, 17: 0.3, 19: 1.0, 20: 0.1}


@pytest.mark.mpi
@pytest.mark.parametrize("block", [1, 16])
def test_ratio_schedule_matches_reference(block):
    """A ratio changed between steps (collectively, on every rank) equals the dense reference,
    which keeps f = b3 f; f[M_t] = 1 through every change; after a change to k every element is
    synchronised within ceil(1/k) steps; the freshness is derived throughout (none stored)."""
    x, ref, comm, opt, worst = run(0.5, np.float64, steps=34, H=7, block=block, schedule=SCHEDULE)
    assert worst < 1e-9, worst
    assert opt.state.f is None and opt.state.fx == {}
    np.testing.assert_allclose(opt.freshness(), np.concatenate([f.ravel() for f in ref.f]), rtol=1e-12)
    assert comm.ratio == 0.1 and comm.mask.num_chunks == 10
    lay = comm.layout
    for start, k in SCHEDULE.items():  # the staleness bound of the new ratio, from the change on
        C = int(np.ceil(1 / k - 1e-9))
        end = min([s for s in SCHEDULE if s > start] + [35])
        if end - start < C:
            continue
        seen = np.zeros(lay.total, bool)
        mask = sc.wire.masks.make_mask("cyclic", lay, k, comm.seed, block, [(k, start - 1)])
        for t in range(start, start + C):
            seen[mask.select(t).index] = True
        assert seen.all(), (start, k)


@pytest.mark.mpi
def test_ratio_change_resumes_bitwise_mid_transition():
    """A state saved two steps after 0.1 -> 0.25 (while freshness still follows both masks) and
    loaded into a communicator built with the first ratio continues bitwise."""
    me = MPI.COMM_WORLD.rank
    sched = {4: 0.25, 9: 0.1}

    def make():
        x = rank_params(me, np.float32)
        return x, SlambRule(sc.Communicator(sc.MPITransport(), x, ratio=0.1, seed=5), lr=0.01, sync_interval=6)

    def steps(x, o, ts):
        for t in ts:
            if t in sched:
                o.set_ratio(sched[t])
            o.step(x, rank_grads(me, t, x, np.float32))

    x1, o1 = make()
    steps(x1, o1, range(1, 16))
    x2, o2 = make()
    steps(x2, o2, range(1, 6))
    assert not o2.comm.mask.settled(o2.t)
    saved_state, saved_x = o2.state_dict(), [a.copy() for a in x2]
    x3, o3 = make()
    for a, b in zip(x3, saved_x):
        a[...] = b
    o3.load_state_dict(saved_state)
    assert o3.comm.ratio == 0.25 and o3.comm.mask.schedule() == o2.comm.mask.schedule()
    steps(x3, o3, range(6, 16))
    for a, b in zip(x1, x3):
        assert np.array_equal(a, b)


@pytest.mark.mpi
def test_ratio_changed_on_one_rank_raises_on_every_rank():
    P, me = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
    if P < 2:
        pytest.skip("needs 2 ranks")
    x = rank_params(me, np.float32)
    opt = SlambRule(sc.Communicator(sc.MPITransport(), x, ratio=0.1, seed=5), lr=0.01)
    opt.step(x, rank_grads(me, 1, x, np.float32))
    culprit = P - 1
    if me == culprit:
        with pytest.raises(sc.ConfigError, match="every rank alike"):
            opt.set_ratio(0.5)
    else:
        with pytest.raises(sc.PeerError) as info:
            opt.set_ratio(0.1)
        assert info.value.ranks == (culprit,)
    assert opt.comm.ratio == 0.1
    with pytest.raises(sc.ConfigError):  # an invalid ratio on every rank
        opt.set_ratio(0.0)
    opt.set_ratio(0.2)  # then a good change, and a step, on every rank
    opt.step(x, rank_grads(me, 2, x, np.float32))
    assert opt.comm.ratio == 0.2 and opt.t == 2


def _kernel_steps():
    return sum(n for op, n in strict_cupy.launches.items() if op.startswith("kernel(slamb_update"))


@pytest.mark.mpi
@pytest.mark.parametrize("ratio", [0.1, 0.3, 1.0])
def test_fused_step_matches_reference_fp64(ratio):
    """The device kernels (a GPU's default), run through the strict double, against the dense
    float64 reference."""
    strict_cupy.reset_counts()
    _, _, comm, opt, worst = run(ratio, np.float64, fused=True)
    assert worst < 1e-9, worst
    assert opt.t == 22 and comm.stats.by_kind["masked_allreduce"].calls == 22
    assert _kernel_steps() == 22, "the device kernels did not take every step"


@pytest.mark.mpi
@pytest.mark.parametrize("value_dtype,tol", [(None, 1e-5), ("float16", 1e-3)])
def test_fused_step_matches_reference_fp32(value_dtype, tol):
    strict_cupy.reset_counts()
    _, _, _, opt, worst = run(0.1, np.float32, value_dtype=value_dtype, steps=14, fused=True)
    assert worst < tol, worst
    assert _kernel_steps() == 14, "the device kernels did not take every step"


@pytest.mark.mpi
def test_fused_ratio_schedule_matches_reference():
    """The kernels derive the freshness through ratio changes within a cycle (up to three masks at
    once in SCHEDULE), as the dense reference's f = b3 f; f[M_t] = 1 does."""
    strict_cupy.reset_counts()
    _, ref, _, opt, worst = run(0.5, np.float64, steps=34, H=7, schedule=SCHEDULE, fused=True)
    assert worst < 1e-9, worst
    assert _kernel_steps() == 34, "the device kernels did not take every step"
    np.testing.assert_allclose(opt.freshness(), np.concatenate([f.ravel() for f in ref.f]), rtol=1e-12)


@pytest.mark.mpi
def test_slamb_matches_reference_fp32():
    _, _, comm, _, worst = run(0.1, np.float32, steps=20)
    assert worst < 1e-5, worst
    assert comm.stats.by_kind["masked_allreduce"].calls == 20


@pytest.mark.mpi
def test_slamb_fp16_payload_within_tolerance():
    _, _, comm, _, worst = run(0.1, np.float32, value_dtype="float16", steps=12)
    assert worst < 1e-3, worst
    fp16 = comm.stats.by_kind["masked_allreduce"]
    # 2 bytes per element sent, plus one 2-byte status slot per exchange
    assert fp16.payload_bytes == 2 * (fp16.elements_sent + fp16.calls)


@pytest.mark.mpi
def test_momentum_identical_on_mask_and_bytes():
    P = MPI.COMM_WORLD.size
    x, _, comm, opt, _ = run(0.1, np.float32, steps=3, H=100)
    idx = comm.mask.select(3).index
    everyone = MPI.COMM_WORLD.allgather(opt.m[idx])
    for r in range(P):
        assert np.array_equal(everyone[r], everyone[0])
    dense_part = comm.layout.dense_index.size
    last = comm.stats.by_kind["masked_allreduce"]
    per_call = last.payload_bytes / last.calls
    bound = 4 * (0.1 * (comm.layout.total - dense_part) + dense_part + 2)
    assert per_call <= bound, (per_call, bound)


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_gradient_on_one_rank_changes_nothing(policy, caplog):
    P, me = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
    x = rank_params(me, np.float32)
    comm = sc.Communicator(sc.MPITransport(), x, ratio=0.1, seed=3)
    opt = SlambRule(comm, lr=0.01, on_nonfinite=policy)
    opt.step(x, rank_grads(me, 1, x, np.float32))
    before = ([a.copy() for a in x], opt.state_dict())
    g = rank_grads(me, 2, x, np.float32)
    if me == P - 1:
        g[0][5, 7] = np.nan  # not in every mask: must still be caught
    if policy == "raise":
        with pytest.raises(sc.NonFiniteError) as err:
            opt.step(x, g)
        assert P - 1 in err.value.ranks
        if me == P - 1:
            assert err.value.tensors == ("0",)
    else:
        with caplog.at_level("WARNING", logger="slamb_comm"):
            opt.step(x, g)
        assert opt.skipped_steps == 1
        assert f"rank(s) [{P - 1}]" in caplog.text and "skipped on every rank" in caplog.text
    after = opt.state_dict()
    assert after["step"] == before[1]["step"] == 1
    for k in ("m", "v", "f"):
        assert np.array_equal(after[k], before[1][k])
    for a, b in zip(x, before[0]):
        assert np.array_equal(a, b)
    # and the next good step goes on as if the bad one never happened
    opt.step(x, rank_grads(me, 2, x, np.float32))
    assert opt.t == 2


@pytest.mark.mpi
def test_resume_is_bitwise():
    me = MPI.COMM_WORLD.rank

    def make():
        x = rank_params(me, np.float32)
        comm = sc.Communicator(sc.MPITransport(), x, ratio=0.1, seed=5)
        return x, SlambRule(comm, lr=0.01, sync_interval=4)

    x1, o1 = make()
    for t in range(1, 11):
        o1.step(x1, rank_grads(me, t, x1, np.float32))
    x2, o2 = make()
    for t in range(1, 6):
        o2.step(x2, rank_grads(me, t, x2, np.float32))
    saved_state, saved_x = o2.state_dict(), [a.copy() for a in x2]
    x3, o3 = make()
    for a, b in zip(x3, saved_x):
        a[...] = b
    o3.load_state_dict(saved_state)
    for t in range(6, 11):
        o3.step(x3, rank_grads(me, t, x3, np.float32))
    for a, b in zip(x1, x3):
        assert np.array_equal(a, b)


@pytest.mark.mpi
def test_checkpoint_directory_resume_is_bitwise_and_atomic(tmp_path_factory):
    from slamb_comm.methods import checkpoint

    world = MPI.COMM_WORLD
    me = world.rank
    base = world.bcast(str(tmp_path_factory.mktemp("ckpt")) if me == 0 else None, root=0)
    ckpt = f"{base}/run"
    transport = sc.MPITransport()

    def make():
        x = rank_params(me, np.float32)
        return x, SlambRule(sc.Communicator(transport, x, ratio=0.1, seed=9), lr=0.01, sync_interval=3)

    x1, o1 = make()
    for t in range(1, 9):
        o1.step(x1, rank_grads(me, t, x1, np.float32))
    x2, o2 = make()
    for t in range(1, 5):
        o2.step(x2, rank_grads(me, t, x2, np.float32))
    checkpoint.save(ckpt, {"x": x2, "opt": o2.state_dict()}, transport, meta={"step": 4})
    # a later save killed halfway: a temporary directory without a manifest is left behind
    if me == 0:
        import os
        os.makedirs(f"{ckpt}.tmp-dead", exist_ok=True)
        open(f"{ckpt}.tmp-dead/rank00000.pkl", "wb").write(b"partial")
    world.Barrier()
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint.load(f"{ckpt}.tmp-dead", transport)
    state = checkpoint.load(ckpt, transport)
    x3, o3 = make()
    for a, b in zip(x3, state["x"]):
        a[...] = b
    o3.load_state_dict(state["opt"])
    for t in range(5, 9):
        o3.step(x3, rank_grads(me, t, x3, np.float32))
    for a, b in zip(x1, x3):
        assert np.array_equal(a, b)
    # a corrupted file on one rank fails on every rank
    world.Barrier()
    if me == world.size - 1:
        with open(f"{ckpt}/rank{me:05d}.pkl", "r+b") as fh:
            fh.seek(10)
            fh.write(b"\x00\x01\x02")
    world.Barrier()
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(ckpt, transport)
    if world.size > 1:  # written by P ranks, read by a communicator of one rank: refused with resize=False;
        solo = sc.MPITransport(MPI.COMM_SELF)  # a resize reads every rank's file, and refuses the corrupt one
        with pytest.raises(checkpoint.CheckpointError, match=f"written by {world.size} ranks.*resize=False"):
            checkpoint.load(ckpt, solo, resize=False)
        with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
            checkpoint.load(ckpt, solo)


@pytest.mark.mpi
def test_mismatched_options_fail_on_every_rank():
    P, me = MPI.COMM_WORLD.size, MPI.COMM_WORLD.rank
    if P == 1:
        pytest.skip("needs two ranks")
    x = rank_params(me, np.float32)
    comm = sc.Communicator(sc.MPITransport(), x, ratio=0.1, seed=3)
    with pytest.raises(sc.ConfigError, match=rf"rank\(s\) \[{P - 1}\] differ"):
        SlambRule(comm, lr=0.01, beta3=0.9 if me < P - 1 else 0.99)
