"""SLAMB's device step (slamb_comm/device/slamb_step.py: the kernels of slamb_comm/device/kernels.py), on one process.

The kernels run here through the strict CuPy double, which compiles their CUDA source for the
host and executes it (tests/support/strict_cupy.py), so every line of their arithmetic runs in CI:

* the payload the pack kernel writes is, bit for bit, the CPU path's payload (the cyclic mask's
  positions in its order, the same values), at every step of a cycle and the first cycle;
* the plan's per-chunk counts are the mask's;
* the whole step takes the tensor-by-tensor path's steps (within float32 rounding: sums run in
  another order) with always-dense tensors, per-tensor learning rates and weight decays, float16
  and float64 payloads, a periodic sync, a list of arrays instead of a fused buffer, and ratio
  changes within a cycle;
* a non-finite gradient fails the step with nothing changed, naming the tensor;
* per step, at 10, 100 and 1,000 tensors: the same device operations (<= 16), no host-to-device
  copy, no host read (the device decides a non-finite step; two on a periodic-sync step), <= 56 bytes
  of device traffic per parameter and <= 10 bytes of device memory per parameter beyond the
  parameters and gradients, on a fused buffer and on a list of arrays, in the mask's first cycle and
  after a ratio change; a skipped step reads nothing either, the step after it names the skip.

The dense float64 reference at 1, 2 and 4 ranks is in ``mpi_tests/test_slamb.py``
(``test_fused_*``). No test here asserts a timing.
"""

import gc

import numpy as np
import pytest

import slamb_comm as sc
from tests.support import strict_cupy
from slamb_comm.methods.slamb import SlambRule

SHAPES = [(60, 200), (200,), (30, 40), (40, 250), (7,), (90, 110)]


def flat_of(rng, shapes, scale=1.0, dtype=np.float32):
    n = sum(int(np.prod(s)) for s in shapes)
    return (rng.standard_normal(n) * scale).astype(dtype)


def make(shapes, ratio=0.1, dense_threshold=2000, transport=None, dtype=np.float32, **kw):
    lay = sc.Layout(shapes, dtype, dense_threshold=dense_threshold)
    comm = sc.Communicator(transport or sc.LocalTransport(), lay, ratio=ratio, seed=3,
                           value_dtype=kw.pop("value_dtype", None))
    return SlambRule(comm, **{"lr": 0.02, "weight_decay": 0.01, "beta3": 0.9, "sync_interval": 4, **kw})


def run(xp, shapes, steps=13, form="fused", schedule=None, **kw):
    """``steps`` steps on ``xp`` arrays: a fused buffer, or one array per tensor (``form="list"``)."""
    opt = make(shapes, **kw)
    dt = opt.layout.dtype
    rng = np.random.default_rng(0)
    x = xp.asarray(flat_of(rng, shapes, dtype=dt))
    for t in range(1, steps + 1):
        if schedule and t in schedule:
            opt.set_ratio(schedule[t])
        g = xp.asarray(flat_of(np.random.default_rng([5, t]), shapes, dtype=dt))
        if form == "list":
            opt.step(opt.layout.views(x), opt.layout.views(g))
        else:
            opt.step(x, g)
    return np.array(sc.arrays.to_host(x)), opt


def kernel_steps():
    return sum(n for op, n in strict_cupy.launches.items() if op.startswith("kernel(slamb_update"))


@pytest.fixture
def double():
    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        strict_cupy.reset_counts()
        yield mod


@pytest.mark.parametrize("vdt", ["float32", "float16", "float64"])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 1.0])
def test_payload_is_the_cpu_payload(double, ratio, vdt):
    """At every step of the first cycle and after it, the pack kernel's payload is the CPU path's,
    bit for bit: the mask's positions in its order, ``b1 m + (1 - b1) g`` there, cast alike."""
    cp = double
    shapes = [(13, 17), (5,), (40, 37), (3, 3), (61, 29), (11,)]
    cpu, dev = make(shapes, ratio, 100, value_dtype=vdt), make(shapes, ratio, 100, value_dtype=vdt)
    rng = np.random.default_rng(4)
    for t in range(1, cpu.comm.mask.num_chunks + 3):
        m, g = flat_of(rng, shapes), flat_of(rng, shapes)
        cpu.place(m)
        cpu.m[...] = m
        cpu.t = t - 1
        cpu.begin_step()
        counts = cpu.tensorwise.counts()
        want = np.empty(sum(counts), cpu.comm.value_dtype)
        starts = np.cumsum([0] + counts)
        for i, gi in enumerate(cpu.layout.flat_views(g)):
            cpu.tensorwise.accumulate(i, gi, out=want[starts[i] : starts[i + 1]])
        cpu.abort_step()
        dev.place(cp.asarray(m))
        dev.m[...] = cp.asarray(m)
        plan = dev.device.plan(cp)
        dev.device.pack(plan, t, cp.asarray(g))
        got = dev.device.payload(plan, t).get()
        assert got[-1] == 0 and np.array_equal(got[:-1].view(np.uint8), want.view(np.uint8)), t


def test_plan_counts_are_the_masks():
    """Per chunk and tensor, the plan's counts are the mask's, for groups that straddle tensors."""
    shapes = [(13, 17), (5,), (40, 37), (1, 3), (61, 29), (7, 7)]
    lay = sc.Layout(shapes, np.float32, dense_threshold=10)
    mask = sc.CyclicMask(lay, 1 / 7, seed=9)
    plan = sc.device.slamb_step.Plan(lay, mask, np)
    for j in range(mask.num_chunks):
        assert [mask.count_of_chunk(j, i) for i in range(len(lay))] == plan.counts[j].tolist()
        assert plan.k_of(j) == sum(plan.counts[j])


KW = {
    "plain": {},
    "per-tensor lr and wd": {"lr": [0.02, 0.01, 0.02, 0.03, 0.0, 0.02], "weight_decay": [0.01, 0, 0, 0.02, 0, 0.01]},
    "float16 payload": {"value_dtype": "float16"},
    "float64 payload": {"value_dtype": "float64"},
    "all dense": {"dense_threshold": 10**6},
    "ratio 1": {"ratio": 1.0},
    "no weight decay": {"weight_decay": 0.0},
    "list of arrays": {"form": "list"},
    "ratio changes within a cycle": {"schedule": {3: 0.25, 5: 0.5, 6: 0.1}, "steps": 18},
}


@pytest.mark.parametrize("case", list(KW))
def test_device_step_takes_the_cpu_steps(double, case):
    a, opt = run(double, SHAPES, **KW[case])
    b, _ = run(np, SHAPES, **KW[case])
    assert kernel_steps() == opt.t, "the device kernels did not take every step"
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_float64_parameters(double):
    a, opt = run(double, SHAPES, dtype=np.float64, value_dtype="float64")
    b, _ = run(np, SHAPES, dtype=np.float64, value_dtype="float64")
    assert kernel_steps() == opt.t
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_nonfinite_changes_nothing(double, policy, caplog):
    """A non-finite gradient skips the step with nothing changed: 'raise' at once; 'skip' decided on the
    device, learnt when the skipped steps are read (or at the next step, which logs the rank and tensor)."""
    cp = double
    opt = make(SHAPES, on_nonfinite=policy)
    rng = np.random.default_rng(0)
    x = cp.asarray(flat_of(rng, SHAPES))
    opt.step(x, cp.asarray(flat_of(rng, SHAPES)))
    before = (np.array(x.get()), opt.state_dict())
    g = flat_of(rng, SHAPES)
    g[opt.layout.offsets[3] + 5] = np.inf  # in tensor 3, probably not in M_t
    if policy == "raise":
        with pytest.raises(sc.NonFiniteError, match=r"non-finite gradient in \['3'\]"):
            opt.step(x, cp.asarray(g))
    else:
        opt.step(x, cp.asarray(g))
        assert opt.skipped_steps == 1
    after = opt.state_dict()
    assert np.array_equal(np.array(x.get()), before[0]) and after["step"] == 1
    for k in ("m", "v"):
        assert np.array_equal(after[k], before[1][k])
    opt.step(x, cp.asarray(flat_of(rng, SHAPES)))  # and the next step goes (no flag left behind)
    assert opt.t == 2 and opt.skipped_steps == (1 if policy == "skip" else 0)
    if policy == "skip":
        assert "step 2 skipped on every rank" in caplog.text and "rank(s) [0]" in caplog.text
        assert "non-finite gradient in ['3']" in caplog.text


def test_refuses_a_buffer_of_the_wrong_size(double):
    opt = make(SHAPES)
    x = double.zeros(opt.layout.total + 1, np.float32)
    with pytest.raises(sc.LayoutError, match="fused buffer"):
        opt.step(x, x)


def test_refuses_a_list_with_a_wrong_array(double):
    opt = make(SHAPES)
    x = [double.zeros(s, np.float32) for s in SHAPES]
    g = [double.zeros(s, np.float32) for s in SHAPES]
    g[2] = double.zeros(SHAPES[2], np.float64)
    with pytest.raises(sc.LayoutError, match="tensor '2' has 1200 float64, expected 1200 float32"):
        opt.step(x, g)


@pytest.mark.parametrize("device", [True, False], ids=["device kernels", "tensor by tensor"])
def test_a_failed_periodic_sync_raises_and_is_not_counted_as_a_skip(double, device):
    """Parameters that are not finite after the update make the periodic sync fail on every rank:
    the step was applied, so it raises (both paths), and no skipped step is counted."""
    xp = double if device else np
    opt = make(SHAPES, sync_interval=1, transport=Twin())
    rng = np.random.default_rng(0)
    x = flat_of(rng, SHAPES)
    x[3] = np.inf
    g = flat_of(rng, SHAPES)
    with np.errstate(all="ignore"), pytest.raises(sc.NonFiniteError):
        opt.step(xp.asarray(x), xp.asarray(g))
    assert opt.skipped_steps == 0 and opt.t == 1
    assert kernel_steps() == (1 if device else 0)


# ---------------------------------------------------------------------------- what a step costs
def shapes_of(tensors, total=655_360):
    n = total // tensors
    sizes = [n] * tensors
    sizes[-1] += total - n * tensors
    return [(s // 64, 64) if s % 64 == 0 else (1, s) for s in sizes]


class Twin:
    """Rank 0 of 2 whose twin sends what this rank sends (sums are twice this rank's values);
    a collective on device memory is one launch that reads and writes the buffer, as NCCL's."""

    rank, size, name = 0, 2, "twin"

    @staticmethod
    def _raw(buf):
        if isinstance(buf, strict_cupy.ndarray):
            strict_cupy.launches["collective"] += 1
            strict_cupy.bytes_read["collective"] += buf.nbytes
            strict_cupy.bytes_written["collective"] += buf.nbytes
            return buf._a
        return buf  # the option agreement, on the host

    def allreduce(self, buf):
        b = self._raw(buf)
        b *= b.dtype.type(2)

    def allgather(self, sendbuf, recvbuf):
        s, r = self._raw(sendbuf), self._raw(recvbuf)
        r[: s.size] = s
        r[s.size :] = s

    def broadcast(self, buf, root=0):
        pass

    def barrier(self):
        pass


def cost(cp, tensors, ranks=1, H=100, vdt=None, form="fused", when="settled"):
    """One step's counts after a few steps (``when``: 'settled', 'first cycle', or 'after a ratio
    change'), and the device memory the optimizer holds beyond x and g, per parameter."""
    gc.collect()  # an optimizer of an earlier call (a cycle with its DeviceStep) must not die mid-measurement
    shapes = shapes_of(tensors)
    x = cp.asarray(flat_of(np.random.default_rng(0), shapes, 0.1))
    g = cp.asarray(flat_of(np.random.default_rng(1), shapes, 0.1))
    base = strict_cupy.memory()
    opt = make(shapes, dense_threshold=0, sync_interval=H, value_dtype=vdt,
               transport=sc.LocalTransport() if ranks == 1 else Twin())
    xs, gs = (opt.layout.views(x), opt.layout.views(g)) if form == "list" else (x, g)
    warm = {"settled": 12, "first cycle": 3, "after a ratio change": 12}[when]
    for t in range(1, warm + 1):
        opt.step(xs, gs)
    if when == "after a ratio change":
        opt.set_ratio(0.2)
        opt.step(xs, gs)
    strict_cupy.reset_peak()
    with strict_cupy.counting() as c:
        opt.step(xs, gs)
    n = opt.layout.total
    assert sum(k for op, k in c.by_op.items() if op.startswith("kernel(slamb_update")) == 1, c.by_op
    return {"launches": c.launches, "h2d": c.h2d, "syncs": c.syncs, "bytes": c.bytes / n,
            "kept": (strict_cupy.memory() - base) / n, "peak": (strict_cupy.peak() - base) / n}


@pytest.mark.parametrize("ranks,H,vdt", [(1, 100, None), (2, 100, None), (2, 100, "float16"), (2, 1, None)],
                         ids=["1 rank", "2 ranks", "2 ranks, float16 payload", "2 ranks, sync step"])
def test_step_costs_do_not_grow_with_tensors(double, ranks, H, vdt):
    """The issue-33 table on the double, with issue 43's host reads: the same at 10, 100 and 1,000
    tensors of 655,360 elements in all, <= 8 device operations (<= 16 on a sync step), no host-to-device
    copy, no host read (two on a sync step: its own verdict and the sync's), <= 48 bytes of traffic per
    parameter (the sync step's parameter average aside) and <= 10 bytes of device memory per parameter
    beyond x and g, kept and at the peak."""
    seen = {t: cost(double, t, ranks, H, vdt) for t in (10, 100, 1000)}
    ops = {t: (s["launches"], s["h2d"], s["syncs"]) for t, s in seen.items()}
    assert len(set(ops.values())) == 1, seen
    launches, h2d, syncs = ops[10]
    assert launches <= (16 if H == 1 else 8) and h2d == 0 and syncs == (2 if H == 1 else 0), seen
    for s in seen.values():
        assert s["kept"] <= 10 and s["peak"] <= 10, seen
        assert s["bytes"] <= (48 if H > 1 else 48 + 24), seen


@pytest.mark.parametrize("form,when", [("list", "settled"), ("fused", "first cycle"), ("list", "first cycle"),
                                       ("fused", "after a ratio change")])
def test_every_entry_point_costs_the_same(double, form, when):
    """A list of arrays, the mask's first cycle and the steps after a ratio change cost what a
    settled step on a fused buffer costs: constants, no host-to-device copy."""
    want = cost(double, 10, 2)
    seen = {t: cost(double, t, 2, form=form, when=when) for t in (10, 100, 1000)}
    for s in seen.values():
        assert (s["launches"], s["h2d"], s["syncs"]) == (want["launches"], 0, 0), (want, seen)
        assert s["bytes"] <= 56 and s["kept"] <= 10 and s["peak"] <= 10, seen


def test_a_skipped_step_reads_nothing(double):
    """A non-finite gradient on the device path: the skipped step itself makes no host read and the
    operations of any step; the next step reads what names the skip (the failure path), the one after
    nothing again."""
    cp = double
    shapes = shapes_of(10)
    opt = make(shapes, dense_threshold=0, transport=Twin(), sync_interval=100)
    x = cp.asarray(flat_of(np.random.default_rng(0), shapes, 0.1))
    good = cp.asarray(flat_of(np.random.default_rng(1), shapes, 0.1))
    bad = flat_of(np.random.default_rng(1), shapes, 0.1)
    bad[7] = np.nan
    bad = cp.asarray(bad)
    for _ in range(3):
        opt.step(x, good)
    seen = []
    for g in (bad, good, good):
        with strict_cupy.counting() as c:
            opt.step(x, g)
        seen.append((c.launches, c.syncs))
    assert seen[0] == (7, 0) and seen[2] == (7, 0), seen
    assert seen[1][1] > 0, seen  # the skip named: who flagged, where
    assert opt.skipped_steps == 1 and opt.t == 5


@pytest.mark.parametrize("C", [2, 3, 7, 10, 11, 1000, 4095, 4096, 4097, 50_000, 63_000])
def test_the_divisor_is_exact_over_a_tiles_span(C):
    """The kernels' group of a position p of a tile's span is (p M) >> 32 with M = divisor(C): exact
    for every p < C + TILE, or M = 0 (the kernels divide) where 32 bits cannot hold it."""
    M = int(sc.device.slamb_step.divisor(C))
    if M == 0:
        assert C * (C + sc.device.kernels.TILE) >= 2**32
        return
    p = np.arange(C + sc.device.kernels.TILE, dtype=np.uint64)
    assert np.array_equal((p * np.uint64(M)) >> np.uint64(32), p // np.uint64(C))


def test_the_kernels_divide_where_no_divisor_fits(double, monkeypatch):
    """Where no 32-bit M exists (C (C + TILE) >= 2^32: k below about 1/63,000) the kernels divide: that
    branch, forced at k = 0.1, takes the CPU path's steps. (The CPU path itself cannot run such a k: its
    picks build a C x C table.)"""
    monkeypatch.setattr(sc.device.slamb_step, "divisor", lambda C: np.uint32(0))
    a, opt = run(double, SHAPES, steps=8)
    b, _ = run(np, SHAPES, steps=8)
    assert kernel_steps() == opt.t
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
