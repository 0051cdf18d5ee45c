"""HybridSLAMB under FSDP2 itself: torchrun, gloo, CPU ranks (tests/support/fsdp_job.py).

At meshes 1 x 2, 2 x 1 and 2 x 2 (replicas x pieces) the sharded run's parameters equal, at every
step, the dense float64 reference of SLAMB at R ranks on the unsharded model (docs/algorithm.md
section 15), tensor by tensor and, with the pieces as device arrays on the strict CuPy double, by the
core's device kernels; the setups it does not support are refused with an error that names the fix; the recipes
users run between backward() and step() give the runs they must equal; per-rank files and
torch.distributed.checkpoint resume bitwise.
"""

import json
import os

import pytest

from tests.support.launch import torchrun

pytest.importorskip("torch")


def _run(tmp_path, mode, R, S):
    proc = torchrun(R * S, "-m", "tests.support.fsdp_job", mode, str(R), str(S), str(tmp_path), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {m: [json.load(open(os.path.join(tmp_path, f"{m}.{k}.json"))) for k in range(R * S)]
            for m in mode.split("+")}


def _check_match(results, R, S, words=7):
    for res in results:
        assert res["steps"] == 9
        # the agreements that cross the replicas are counted too: per step, which of the 6 parameters
        # have a gradient (6 float64) and the end-of-backward word (1 float64); tests/test_fsdp_overlap.py
        # checks the overlap's one more
        assert res["control"] == [9, 9 * words * 8], res["control"]
        assert max(res["worst"]) < 1e-6, res  # the bound; float64 gives about 1e-8 (the gradients
        # are FSDP2's reduce-scatter averages, summed in another order than the reference's autograd)
    if R > 1:
        for res in results:  # only the pieces' payloads cross: well under the dense replica allreduce
            sent, dense = map(sum, zip(*res["traffic"][1:]))
            assert sent < 0.8 * dense, res["traffic"]


@pytest.mark.parametrize("R,S", [(1, 2), (2, 1)])
def test_hybrid_slamb_on_two_ranks_matches_the_unsharded_reference(tmp_path, R, S):
    _check_match(_run(tmp_path, "match", R, S)["match"], R, S)


def test_hybrid_slamb_and_sadamw_on_a_2x2_mesh_match_refuse_and_keep_the_recipes(tmp_path):
    out = _run(tmp_path, "match+match_sadamw+match_device+errors+recipes+resume+dcp", 2, 2)
    _check_match(out["match"], 2, 2)
    _check_match(out["match_sadamw"], 2, 2)
    # the pieces as device arrays (the strict CuPy double): the core's kernels, read in place, the same
    # result; the last step (a sync step: 9 = 2 H + 1) in 14 device operations, 2 host reads and one copy
    # of the gradients' table of addresses (FSDP2 makes new gradient tensors each step)
    _check_match(out["match_device"], 2, 2)
    for res in out["match_device"]:
        assert (res["launches"], res["syncs"], res["h2d"]) == (14, 2, 1), res
    for res in out["errors"]:
        assert "HybridSLAMB(model, mesh)" in res["plain_slamb"]
        assert "mesh=mesh['shard']" in res["whole_mesh"]
        assert "pure FSDP" in res["pure_fsdp"]
        assert "not sharded" in res["unsharded"]
        assert "HybridSLAMB(model, mesh" in res["no_model"]
    for res in out["recipes"]:
        # a GradScaler with a power-of-two scale: bitwise the run without it
        assert res["scaler_bitwise"] and res["scale"] == 1024.0, res
        # an inf in one rank's loss: every rank's scaler skips and halves alike, and the run is bitwise the
        # run without that step; without a scaler the optimizer skips it on every rank
        assert res["inf_bitwise"] and res["inf_scales"] == [512.0, 1024.0] and res["inf_steps"] == [4, 4], res
        assert res["skipped"] == 1 and res["steps_no_scaler"] == 3, res
        # clip_grad_norm_ on the DTensor gradients clips the whole model's norm (each replica its own)
        assert all(abs(n - 0.05) < 1e-6 for n in res["clipped_norms"]), res
        # two micro-batches with FSDP2's gradient sync off for the first: the one-batch run, to float32
        assert res["accumulation_diff"] < 1e-5, res
        assert res["bf16_finite"] and res["bf16_replicas_equal"], res
    for res in out["resume"]:  # every rank's own state saved and loaded: bitwise the uninterrupted run
        assert res == {"bitwise": True, "steps": 7, "seed": 3}, res
    for res in out["dcp"]:  # torch.distributed.checkpoint, saved right after a periodic sync: bitwise too
        assert res == {"bitwise": True, "steps": 8, "seed": 3}, res


def test_a_script_that_ends_without_tearing_down_exits_cleanly(tmp_path):
    proc = torchrun(2, "-m", "tests.support.fsdp_job", "no_teardown", "2", "1", str(tmp_path), timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in out, out[-3000:]
    assert json.load(open(os.path.join(tmp_path, "no_teardown.0.json")))["steps"] == 2
