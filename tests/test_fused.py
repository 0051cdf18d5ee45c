"""SLAMB's whole-buffer step (slamb_comm/fused.py), the default on a device, on one process:

* its positions of M_t are the cyclic mask's, bitwise, at every step of a cycle;
* on NumPy and on the strict CuPy double it takes the steps of the tensor-by-tensor path
  (within float32 rounding: the sums run in another order), with always-dense tensors, per-tensor
  learning rates and weight decays, a float16 payload, and a periodic sync;
* a non-finite gradient fails the step with nothing changed, naming the tensor;
* on the double, its device operations, host-to-device copies and host reads per step are
  counted at 10, 100 and 1,000 tensors: the same at every tensor count, <= 64 per step.

The dense float64 reference at 1, 2 and 4 ranks is in ``mpi_tests/test_slamb.py``
(``test_fused_step_matches_reference_*``). No test here asserts a timing.
"""

import numpy as np
import pytest

import slamb_comm as sc
import strict_cupy
from slamb_comm.slamb import Slamb

SHAPES = [(60, 200), (200,), (30, 40), (40, 250), (7,), (90, 110)]


def flat_of(rng, shapes, scale=1.0):
    n = sum(int(np.prod(s)) for s in shapes)
    return (rng.standard_normal(n) * scale).astype(np.float32)


def make(xp, shapes, fused, ratio=0.1, dense_threshold=2000, transport=None, **kw):
    lay = sc.Layout(shapes, dense_threshold=dense_threshold)
    comm = sc.Communicator(transport or sc.LocalTransport(), lay, ratio=ratio, seed=3,
                           value_dtype=kw.pop("value_dtype", None))
    opt = Slamb(comm, **{"lr": 0.02, "weight_decay": 0.01, "beta3": 0.9, "sync_interval": 4, **kw})
    opt.fused = fused
    return opt


def run(xp, shapes, fused, steps=13, **kw):
    opt = make(xp, shapes, fused, **kw)
    rng = np.random.default_rng(0)
    x = xp.asarray(flat_of(rng, shapes))
    for t in range(1, steps + 1):
        g = xp.asarray(flat_of(np.random.default_rng([5, t]), shapes))
        opt.step(x, g)
    return np.array(sc.arrays.to_host(x)), opt


@pytest.fixture
def double():
    with strict_cupy.install() as mod:
        strict_cupy.Device.current = 0
        strict_cupy.reset_counts()
        yield mod


@pytest.mark.parametrize("ratio", [0.1, 0.25, 1.0])
def test_positions_are_the_masks(ratio):
    opt = make(np, SHAPES, True, ratio=ratio)
    plan = opt._plan(np)  # noqa: SLF001
    mask = opt.comm.mask
    for t in range(1, mask.num_chunks + 2):
        want = mask.select(t).index
        got = np.arange(opt.layout.total) if plan.everything else plan.positions(mask.chunk(t))
        assert np.array_equal(got, want), t
        assert plan.K[mask.chunk(t) if not plan.everything else 0] == want.size


KW = {
    "plain": {},
    "per-tensor lr and wd": {"lr": [0.02, 0.01, 0.02, 0.03, 0.0, 0.02], "weight_decay": [0.01, 0, 0, 0.02, 0, 0.01]},
    "float16 payload": {"value_dtype": "float16"},
    "all dense": {"dense_threshold": 10**6},
    "no weight decay": {"weight_decay": 0.0},
}


@pytest.mark.parametrize("case", list(KW))
def test_fused_numpy_takes_the_tensor_by_tensor_steps(case):
    a, fused_opt = run(np, SHAPES, True, **KW[case])
    b, _ = run(np, SHAPES, False, **KW[case])
    assert fused_opt._plans  # noqa: SLF001 (the fused path ran)
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    assert fused_opt.t == 13


@pytest.mark.parametrize("case", ["plain", "per-tensor lr and wd", "float16 payload"])
def test_fused_on_the_double_takes_the_numpy_steps(double, case):
    a, opt = run(double, SHAPES, None, **KW[case])  # None: the default, fused on a device
    b, _ = run(np, SHAPES, False, **KW[case])
    assert opt._plans  # noqa: SLF001
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_fused_nonfinite_changes_nothing(double, policy):
    cp = double
    opt = make(cp, SHAPES, None, on_nonfinite=policy)
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


def test_fused_refuses_a_buffer_of_the_wrong_size():
    opt = make(np, SHAPES, True)
    x = np.zeros(opt.layout.total + 1, np.float32)
    with pytest.raises(sc.LayoutError, match="fused buffer"):
        opt.step(x, x)


def shapes_of(tensors, total=655_360):
    n = total // tensors
    sizes = [n] * tensors
    sizes[-1] += total - n * tensors
    return [(s // 64, 64) if s % 64 == 0 else (1, s) for s in sizes]


class Twin:
    """Rank 0 of 2 whose twin sends what this rank sends (sums are twice this rank's values)."""

    rank, size, name = 0, 2, "twin"

    @staticmethod
    def _raw(buf):
        if isinstance(buf, strict_cupy.ndarray):
            strict_cupy.launches["collective"] += 1  # one NCCL call: one launch
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


@pytest.mark.parametrize("ranks,H", [(1, 100), (2, 100), (2, 1)], ids=["1 rank", "2 ranks", "2 ranks, sync step"])
def test_device_operations_per_step_do_not_grow_with_tensors(double, ranks, H):
    """Counted on the step after 12 (a settled cycle): the same at 10, 100 and 1,000 tensors of
    655,360 elements, <= 64 device operations, <= 1 host-to-device copy, 1 host read (2 on a
    sync step at 2 ranks)."""
    cp = double
    seen = {}
    for tensors in (10, 100, 1000):
        shapes = shapes_of(tensors)
        opt = make(cp, shapes, None, dense_threshold=0, sync_interval=H,
                   transport=sc.LocalTransport() if ranks == 1 else Twin())
        rng = np.random.default_rng(0)
        x = cp.asarray(flat_of(rng, shapes, 0.1))
        for t in range(1, 13):
            opt.step(x, cp.asarray(flat_of(np.random.default_rng(t), shapes, 0.1)))
        opt.step(x, cp.asarray(flat_of(rng, shapes, 0.1)))  # the first settled step of this chunk: its row copied
        g = cp.asarray(flat_of(rng, shapes, 0.1))
        for _ in range(opt.comm.mask.num_chunks - 1):
            opt.step(x, g)
        with strict_cupy.counting() as c:
            opt.step(x, g)
        seen[tensors] = (c.launches, c.h2d, c.syncs)
    assert len(set(seen.values())) == 1, seen
    launches, h2d, syncs = seen[10]
    assert launches <= 64, seen
    assert h2d == 0, seen
    assert syncs == (2 if ranks == 2 and H == 1 else 1), seen


@pytest.mark.parametrize("fused", [True, False])
def test_a_failed_periodic_sync_raises_and_is_not_counted_as_a_skip(fused):
    """Parameters that are not finite after the update make the periodic sync fail on every rank:
    the step was applied, so it raises (both paths), and no skipped step is counted."""
    opt = make(np, SHAPES, fused, sync_interval=1, transport=Twin())
    rng = np.random.default_rng(0)
    x = flat_of(rng, SHAPES)
    x[3] = np.inf
    with np.errstate(all="ignore"), pytest.raises(sc.NonFiniteError):
        opt.step(x if fused else opt.layout.views(x), flat_of(rng, SHAPES) if fused
                 else opt.layout.views(flat_of(rng, SHAPES)))
    assert opt.skipped_steps == 0 and opt.t == 1
