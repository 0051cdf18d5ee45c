"""HybridTopK, DiLoCo and DesLoc on a model sharded by FSDP2: torchrun, gloo, CPU ranks (tests/support/fsdp_topk_job.py).

At meshes 1 x 2, 2 x 1 and 2 x 2 (replicas x pieces), at every step, each rank's pieces equal the
dense float64 references written out in the job (docs/algorithm.md sections 15.1 and 15.2):

* HybridTopK (under SGD with momentum and under AdamW): top-k with error feedback at R ranks on the
  unsharded model *with top-k taken per piece* (each tensor cut into FSDP2's S row blocks), the
  always-dense rule read on the whole shapes;
* DiLoCo (inner AdamW, sync_interval 3) and DesLoc (inner AdamW, periods 2, 3, 4) with each piece
  averaged over its R replicas.

At 2 x 2 also: a NaN in one rank's gradient piece makes every rank of the mesh skip the step (or
raise NonFiniteError), nothing changed; and the unsupported setups raise ConfigErrors naming the fix.
"""

import json
import os

import pytest

from tests.support.launch import torchrun

pytest.importorskip("torch")

BOUND = 1e-9  # float64 throughout: about 1e-16 here (the gradients are FSDP2's reduce-scatter means,
# summed in another order than the reference's autograd)


def _run(tmp_path, mode, R, S):
    proc = torchrun(R * S, "-m", "tests.support.fsdp_topk_job", mode, str(R), str(S), str(tmp_path), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {m: [json.load(open(os.path.join(tmp_path, f"{m}.{k}.json"))) for k in range(R * S)]
            for m in mode.split("+")}


def _check_match(out, R):
    for res in out["topk"]:
        for name in ("sgd", "adamw"):
            case = res[name]
            assert len(case["worst"]) == 8 and case["skipped"] == 0
            assert max(case["worst"]) < BOUND, (name, res)
            if R > 1:  # only the pieces' top-k crosses the replicas: under a dense allreduce of the pieces
                for sent, dense in case["traffic"]:
                    assert 0 < sent < 0.6 * dense, case["traffic"]
    for mode in ("diloco", "desloc"):
        for res in out[mode]:
            assert len(res["worst"]) == 8
            assert max(res["worst"]) < BOUND, (mode, res)


@pytest.mark.parametrize("R,S", [(1, 2), (2, 1)])
def test_on_two_ranks_each_piece_matches_the_unsharded_references(tmp_path, R, S):
    _check_match(_run(tmp_path, "topk+diloco+desloc", R, S), R)


def test_on_a_2x2_mesh_matches_agrees_on_nonfinite_steps_and_refuses_what_it_cannot_do(tmp_path):
    out = _run(tmp_path, "topk+diloco+desloc+nonfinite+errors", 2, 2)
    _check_match(out, 2)
    for res in out["nonfinite"]:  # the NaN is in rank (1, 0)'s piece: ranks (0, 1) and (1, 1) learn it too
        skip, raised = res["skip"], res["raise"]
        assert skip["2"] == "ok" and skip["2.unchanged"] and skip["nan_grads"] and skip["skipped"] == 1
        assert not skip["3.unchanged"]  # and the next step goes on
        assert raised["2"].startswith("NonFiniteError") and raised["2.unchanged"] and raised["skipped"] == 0
        assert raised["3"] == "ok" and not raised["3.unchanged"]
        assert "from rank(s) [2]" in raised["2"], raised["2"]  # every rank names the rank, (1, 0)
    for res in out["errors"]:
        assert "pure FSDP" in res["topk_pure_fsdp"] and "HybridTopK needs a 2-D mesh" in res["topk_pure_fsdp"]
        assert "mesh=mesh['shard']" in res["topk_whole_mesh"]
        assert "not sharded" in res["topk_unsharded"]
        assert "slamb_comm.TopK" in res["topk_not_topk"]
        assert "pure FSDP" in res["diloco_pure_fsdp"] and "DiLoCo needs" in res["diloco_pure_fsdp"]
        assert "mesh=mesh" in res["diloco_no_mesh"] and "DTensors" in res["diloco_no_mesh"]
        assert "not both" in res["diloco_both"]
        assert "whole 2-D mesh" in res["desloc_whole_mesh"] and "DesLoc" in res["desloc_whole_mesh"]
