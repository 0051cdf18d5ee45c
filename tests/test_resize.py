"""slamb_comm.methods.resize on its own (docs/algorithm.md section 10): what is equal is kept bitwise,
floating-point state that differs is averaged in float64 (torch tensors stay torch tensors of
their dtype), the rest is taken from old rank ``rank mod P`` with a warning, a structure that
differs between ranks is refused, and one old state at a time is enough. The resize of real
checkpoints against the dense reference is in ``mpi_tests/test_resize.py``."""

import logging

import numpy as np
import pytest
import torch

from slamb_comm.methods.resize import resize
from tests.support.state_compare import averaged_from_two, leaves


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


# ----------------------------------------------------------------------------- per-rank files of the frameworks
def _slamb_files(tmp_path, P):
    """What Lightning's SlambDDPStrategy and the Trainer's save_rank_state write: one torch file
    per rank with its world size, model and optimizer state (a torch SLAMB, moments per rank)."""
    from slamb_comm.adapters.torch import SLAMB

    for r in range(P):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        opt = SLAMB(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(r)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        torch.save({"world_size": P, "rank": r, "model": model.state_dict(), "optimizer": opt.state_dict()},
                   tmp_path / f"slamb_rank{r}.pt")
    return [torch.load(tmp_path / f"slamb_rank{r}.pt", weights_only=False) for r in range(P)]


@pytest.mark.parametrize("new_world", [1, 3])
def test_framework_rank_files_resize_to_another_world(tmp_path, new_world):
    """adapters.torch.rank_files on 2 ranks' files: the same world loads each rank's own file
    bitwise; another world gives every new rank the float64 mean of the floating-point tensors
    (moments, parameters), written out here, and every other entry as saved."""
    from slamb_comm.adapters.torch.rank_files import load_rank_file

    old = _slamb_files(tmp_path, 2)
    path_of = lambda r: str(tmp_path / f"slamb_rank{r}.pt")  # noqa: E731
    own, note = load_rank_file(path_of, 2, 1)
    assert note is None and all(torch.equal(a, b) if torch.is_tensor(a) else a == b
                                for (_, a), (_, b) in zip(leaves(own), leaves(old[1])))
    for rank in range(new_world):
        st, note = load_rank_file(path_of, new_world, rank)
        assert note.startswith(f"per-rank state of 2 ranks resized for rank {rank} of {new_world}"), note
        assert st["world_size"] == new_world and "rank" not in st
        averaged = averaged_from_two({k: st[k] for k in ("model", "optimizer")},
                                     *({k: o[k] for k in ("model", "optimizer")} for o in old))
        assert averaged >= 6, averaged  # weight and bias, and each one's m and v at least


def test_framework_rank_files_missing_or_mixed(tmp_path):
    from slamb_comm.adapters.torch.rank_files import load_rank_file

    path_of = lambda r: str(tmp_path / f"slamb_rank{r}.pt")  # noqa: E731
    assert load_rank_file(path_of, 2, 0) == (None, f"no per-rank state file {path_of(0)}")
    _slamb_files(tmp_path, 3)
    (tmp_path / "slamb_rank2.pt").unlink()
    st, problem = load_rank_file(path_of, 2, 0)
    assert st is None and problem == f"saved at 3 ranks, but {path_of(2)} is missing"
    torch.save({"world_size": 2, "model": {}}, path_of(2))
    with pytest.raises(ValueError, match="different checkpoints"):
        load_rank_file(path_of, 4, 0)
