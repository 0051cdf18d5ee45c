"""Single-process checks of the SlambRule rule's options and its refusal of unsafe set-ups."""

import numpy as np
import pytest

import slamb_comm as sc
from tests.support import strict_cupy
from slamb_comm.methods.slamb import SlambRule


def test_float16_parameters_need_a_float32_master_copy():
    x = [np.zeros((100, 100), np.float16)]
    with pytest.raises(sc.ConfigError, match="float32 master copy"):
        SlambRule(sc.Communicator(None, x))


@pytest.mark.parametrize("kw", [dict(betas=(1.0, 0.999)), dict(beta3=1.0), dict(sync_interval=0),
                                dict(c_min=0.0), dict(eps=-1.0), dict(lr=-0.1), dict(lr=[0.1, 0.2]),
                                dict(on_nonfinite="ignore")])
def test_bad_options_raise_config_error(kw):
    x = [np.zeros((100, 100), np.float32)]
    with pytest.raises(sc.ConfigError):
        SlambRule(sc.Communicator(None, x), **kw)


def test_skipped_step_leaves_state_untouched_in_one_process():
    x = [np.ones((100, 100), np.float32)]
    opt = SlambRule(sc.Communicator(None, x, ratio=0.1), lr=0.01)
    opt.step(x, [np.ones((100, 100), np.float32)])
    before = opt.state_dict(), x[0].copy()
    g = np.ones((100, 100), np.float32)
    g[3, 4] = np.inf
    opt.step(x, [g])
    assert opt.skipped_steps == 1 and opt.t == 1
    after = opt.state_dict()
    for k in ("m", "v", "f"):
        np.testing.assert_array_equal(after[k], before[0][k])
    np.testing.assert_array_equal(x[0], before[1])


@pytest.mark.parametrize("device", [False, True], ids=["tensor by tensor", "device kernels"])
def test_a_step_is_skipped_where_a_square_overflows_not_where_a_sum_of_squares_does(device):
    """docs/algorithm.md section 9: a gradient is bad where an element's square would overflow v
    (``|g| >= sqrt(max)``), not where finite squares add up past the dtype's max; the
    tensor-by-tensor path decides as the device kernels (run through the strict double) do."""
    with strict_cupy.install() as cp:
        xp = cp if device else np
        x = xp.asarray(np.ones(20000, np.float32))
        opt = SlambRule(sc.Communicator(None, [np.ones((100, 200), np.float32)], ratio=0.1, seed=1), lr=0.01)
        with np.errstate(over="ignore"):  # the CPU's check squares in float32
            opt.step(x, xp.asarray(np.full(20000, 1e18, np.float32)))  # each square 1e36 < 3.4e38; their sum is not
            assert opt.skipped_steps == 0 and opt.t == 1 and np.isfinite(sc.arrays.to_host(opt.v)).all()
            opt.step(x, xp.asarray(np.full(20000, 2e19, np.float32)))  # above sqrt(max) = 1.84e19: v would overflow
        assert opt.skipped_steps == 1 and opt.t == 1
        assert (opt.device._plans != {}) == device  # noqa: SLF001 (which path ran)


def test_derived_freshness_is_the_simulated_one():
    """The cyclic mask's freshness is derived from the schedule, not stored: it equals
    ``f = b3 f; f[M_t] = 1`` simulated from the masks themselves (docs/algorithm.md section 1, step 4)."""
    x = [np.ones((40, 300), np.float32), np.ones(30, np.float32), np.ones((70, 150), np.float32)]
    comm = sc.Communicator(None, x, ratio=0.3, seed=8, dense_threshold=100)
    opt = SlambRule(comm, lr=0.01, beta3=0.8)
    assert opt.derived and opt.state.f is None
    f = np.ones(comm.layout.total)
    for t in range(1, 12):
        opt.step(x, [np.full_like(a, 0.1 * t) for a in x])
        f *= 0.8
        f[comm.mask.select(t).index] = 1.0
        np.testing.assert_allclose(opt.freshness(), f, rtol=1e-6)
        np.testing.assert_allclose(opt.freshness(2), f[12030:].reshape(70, 150), rtol=1e-6)


def test_the_mask_keeps_no_array_of_positions():
    """The layout and the cyclic mask keep O(number of tensors) numbers for a 20M-element model."""
    import tracemalloc

    tracemalloc.start()
    lay = sc.Layout([(2000, 2000)] * 5, "float32")
    mask = sc.CyclicMask(lay, 0.1, seed=3, block=1)
    size, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert lay.total == 20_000_000 and mask.count(1, 0) == 400_000
    assert peak < 100_000, peak  # bytes, for everything built


def test_a_steps_scratch_is_bounded_by_the_largest_tensor():
    """Beyond m and v, a step allocates the direction of one tensor at a time, cache-sized
    blocks, the |M_t| payload and one byte per group of C elements (traced NumPy allocations)."""
    import tracemalloc

    shapes = [(1024, 512)] * 8 + [(512,)] * 8
    x = [np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)]
    g = [np.full(s, 0.01, np.float32) for s in shapes]
    comm = sc.Communicator(None, x, ratio=0.1, seed=1)
    opt = SlambRule(comm, lr=0.01, weight_decay=0.01)
    opt.step(x, g)  # the state (m, v) and the reusable scratch are made here
    tracemalloc.start()
    opt.step(x, g)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    n, largest = comm.layout.total, 1024 * 512
    payload = 4 * (0.1 * n + 8 * 512)
    assert peak < 0.25 * 4 * largest + 2 * payload, (peak, largest, payload)  # the model is 8x the largest tensor


class _SecondRank(sc.LocalTransport):
    """Rank 1 of 2 whose twin sends what it sends (for construction-time agreements only)."""

    rank, size = 1, 2

    def allgather(self, sendbuf, recvbuf):
        recvbuf[: sendbuf.size] = sendbuf
        recvbuf[sendbuf.size :] = sendbuf


def test_a_warning_at_construction_when_compression_cannot_save(caplog):
    """Issue 46: a layout of small and 1-D tensors (always sent whole) expects more bytes per step than
    a dense allreduce: one warning on rank 0 at construction, naming the share and the fix; none for a
    layout where the mask saves, none on another rank."""
    small = [np.zeros((30, 30), np.float32), np.zeros(100, np.float32)]
    with caplog.at_level("WARNING", logger="slamb_comm"):
        SlambRule(sc.Communicator(None, small, ratio=0.1, seed=1))
    assert len(caplog.records) == 1, caplog.text
    text = caplog.records[0].getMessage()
    assert "101% of a dense allreduce" in text and "2 of 2 tensors are always sent whole" in text, text
    assert "Lower dense_threshold=" in text and "DDP" in text, text
    want = (900 + 100 + 1) * 4 + (1000 + 1) * 4 / 100
    assert sc.methods.slamb.expected_payload(sc.Communicator(None, small, ratio=0.1, seed=1), 100) == (want, 4000)
    caplog.clear()
    with caplog.at_level("WARNING", logger="slamb_comm"):
        SlambRule(sc.Communicator(None, [np.zeros((300, 300), np.float32)], ratio=0.1, seed=1))
        SlambRule(sc.Communicator(_SecondRank(), small, ratio=0.1, seed=1))
        SlambRule(sc.Communicator(None, small, ratio=0.1, seed=1), warn_payload=False)
    assert not caplog.records, caplog.text
