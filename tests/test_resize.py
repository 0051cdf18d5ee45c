"""slamb_comm.resize on its own (docs/algorithm.md section 10): what is equal is kept bitwise,
floating-point state that differs is averaged in float64 (torch tensors stay torch tensors of
their dtype), the rest is taken from old rank ``rank mod P`` with a warning, a structure that
differs between ranks is refused, and one old state at a time is enough. The resize of real
checkpoints against the dense reference is in ``mpi_tests/test_resize.py``."""

import logging

import numpy as np
import pytest
import torch

from slamb_comm.resize import resize


def states(P):
    return [{
        "step": 7, "seed": 11, "lr": 0.5 + r, "name": "opt",
        "m": np.arange(4, dtype=np.float32) * (r + 1),
        "f": np.array([1.0, np.nan, 0.25], np.float32),  # equal everywhere, NaN included
        "rng": np.array([r, 2 * r], np.int64),
        "torch": {"exp_avg": torch.full((2, 2), float(r), dtype=torch.float16), "step": torch.tensor(7.0)},
        "groups": [{"params": [0, 1], "lr": 1e-3}],
    } for r in range(P)]


def test_kept_averaged_and_taken(caplog):
    old = states(3)
    with caplog.at_level(logging.INFO, logger="slamb_comm"):
        st, rep = resize(old, 2, 1)
    assert st["step"] == 7 and st["seed"] == 11 and st["name"] == "opt" and st["groups"] == old[0]["groups"]
    assert st["f"] is old[0]["f"]  # kept, bitwise (NaN equal to NaN)
    assert st["lr"] == pytest.approx(1.5)
    want = ((np.arange(4) * 1.0 + np.arange(4) * 2.0 + np.arange(4) * 3.0) * (1.0 / 3)).astype(np.float32)
    assert st["m"].dtype == np.float32 and np.array_equal(st["m"], want)
    t = st["torch"]["exp_avg"]
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float16 and torch.equal(t, torch.full((2, 2), 1.0,
                                                                                           dtype=torch.float16))
    assert st["torch"]["step"] is old[0]["torch"]["step"]
    assert np.array_equal(st["rng"], old[1]["rng"])  # rank 1 of 2 takes old rank 1's
    assert set(rep["averaged"]) == {"lr", "m", "torch.exp_avg"} and rep["taken"] == ["rng"]
    assert "took old rank 1's" in caplog.text and "resized for rank 1 of 2" in caplog.text


def test_one_state_at_a_time_and_more_ranks_than_before():
    old = states(2)
    st, _ = resize(iter(old), 5, 4, old_size=2)  # a generator: one old state in memory at once
    assert np.array_equal(st["rng"], old[0]["rng"])  # 4 mod 2
    assert np.array_equal(st["m"], (np.arange(4) * 1.5).astype(np.float32))
    with pytest.raises(ValueError, match="expected 3 old states, got 2"):
        resize(iter(old), 2, 0, old_size=3)


def test_a_structure_that_differs_is_refused():
    old = states(2)
    del old[1]["seed"]
    with pytest.raises(ValueError, match="differs in its keys"):
        resize(old, 1, 0)
    old = states(2)
    old[1]["groups"].append({})
    with pytest.raises(ValueError, match="differs in length"):
        resize(old, 1, 0)
