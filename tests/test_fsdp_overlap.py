"""HybridSLAMB's momentum exchange overlapped with FSDP2's backward pass (issue 35;
adapters/torch/fsdp/overlap.py): torchrun, gloo, CPU ranks (tests/support/fsdp_overlap_job.py).

* At meshes 1 x 2, 2 x 1 and 2 x 2 the run with the overlap (``overlap=True``) equals the dense float64
  reference of tests/support/fsdp_job.py's ``match`` at every step, each step applying the exchange started
  during the backward pass (one allreduce per FSDP module).
* The first modules' exchanges start while autograd is still computing the earlier layers.
* What users do between backward() and step() (GradScaler.unscale_ and clip_grad_norm_, a second
  backward pass adding to the gradients) gives the run without the overlap, bitwise: the overlapped
  exchange is dropped on every rank (its bytes counted: sent twice), then the steps exchange from
  step() (deferred) and send them once; accumulation with FSDP2's sync off, a clip that changes
  nothing, parameters without a gradient on some or every rank and a float16 payload keep the overlap;
  an inf on one rank skips the step on every rank.
"""

import json
import os

import pytest

from tests.support.launch import torchrun

pytest.importorskip("torch")

EACH = [True] * 5


def _run(tmp_path, mode, R, S):
    proc = torchrun(R * S, "-m", "tests.support.fsdp_overlap_job", mode, str(R), str(S), str(tmp_path), timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {m: [json.load(open(os.path.join(tmp_path, f"{m}.{k}.json"))) for k in range(R * S)]
            for m in mode.split("+")}


def _check_match(results):
    for res in results:
        assert res["steps"] == 9 and max(res["worst"]) < 1e-6, res  # the bound of tests/test_fsdp.py
        # 6 have-a-gradient words, the end-of-backward word and the overlap's word per step
        assert res["control"] == [9, 9 * 8 * 8], res["control"]
        # every step applied the exchange started during the backward pass: one allreduce per FSDP
        # module (layers 4, 2, 0; the root holds no parameter), all started before backward() returned
        assert [(x["mode"], x["units"], x["early"], x["applied"]) for x in res["reports"]] == [
            ("overlap", 3, 3, True)] * 9, res["reports"]


@pytest.mark.parametrize("R,S", [(1, 2), (2, 1)])
def test_overlapped_exchange_matches_the_reference_on_two_ranks(tmp_path, R, S):
    _check_match(_run(tmp_path, "match", R, S)["match"])


def test_overlap_on_a_2x2_mesh_matches_starts_early_and_keeps_the_recipes(tmp_path):
    out = _run(tmp_path, "match+recipes", 2, 2)
    _check_match(out["match"])
    for res in out["recipes"]:
        for name, sc in res.items():  # every scenario: bitwise the run without the overlap
            assert sc["bitwise"], (name, sc)
        plain = res["early"]
        # inside the backward pass: layer 4's exchange had started when autograd reached the Tanh before
        # it, layers 4's and 2's at the Tanh before layer 2 (layer 0's comes in FSDP2's end-of-backward)
        assert plain["seen_in_backward"] == [[1, 2]] * 5 and plain["applied"] == EACH, plain
        # the overlapped payload has no status word: 4 bytes fewer than the exchange in step()
        assert [a + 4 for a in plain["masked_on"]] == plain["masked_off"], plain

        # GradScaler.unscale_ + clip_grad_norm_ change the gradients after their exchange started (seen
        # from their values: neither moves a version counter of FSDP2's gradients): step 1 is
        # exchanged again in step() (its bytes sent twice, both counted), later steps only there
        sc = res["scaled_and_clipped"]
        assert sc["modes"] == ["overlap"] + ["deferred"] * 4 and sc["fell_back"] == [True] + [False] * 4, sc
        assert sc["masked_on"][0] == 2 * sc["masked_off"][0] - 4 and sc["masked_on"][1:] == sc["masked_off"][1:]
        # a second backward pass adding into the gradients (FSDP2's sync on for both micro-batches): alike
        sc = res["accumulate_synced"]
        assert sc["modes"] == ["overlap"] + ["deferred"] * 4 and sc["fell_back"][0], sc
        assert sc["masked_on"][0] == 2 * sc["masked_off"][0] - 4, sc

        # what keeps the overlap: a clip that changes nothing, micro-batches with FSDP2's sync off for the
        # first, a float16 payload, and parameters without a gradient on one replica (they count as zero;
        # its later modules' exchanges wait for the end of its backward pass, so that every replica
        # starts them in the same order) or on every rank (left exactly as they are)
        for name in ("clip_no_op", "accumulate_no_sync", "float16_payload", "no_gradient_somewhere"):
            assert res[name]["applied"] == EACH and res[name]["steps"] == [5, 5], (name, res[name])
        # an inf in the last rank's loss at step 3: every rank skips it (with or without the overlap)
        sc = res["inf_on_one_rank"]
        assert sc["skipped"] == [1, 1] and sc["steps"] == [4, 4] and sc["fell_back"][2], sc
        assert sc["applied"] == [True, True, False, False, True], sc  # step 4 deferred, then back
    early = [res["no_gradient_somewhere"]["early"] for res in out["recipes"]]
    assert early[:2] == [[3, 3, 3, 0, 3]] * 2 and early[2:] == [[3, 0, 0, 0, 3]] * 2, early
