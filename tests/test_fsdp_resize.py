"""HybridSLAMB's torch.distributed.checkpoint resumed at another replica count (docs/algorithm.md sections 10
and 15.3): torchrun, gloo, CPU ranks (tests/support/fsdp_resize_job.py).

A 2 x 2 run (replicas x pieces) saves right after a periodic sync (step 5) and between syncs (step 7); the
checkpoints are resumed on 2 x 2 (bitwise the uninterrupted run), 1 x 4, 1 x 2 and 2 x 1, and a 1 x 2
checkpoint on 2 x 1 (through a torchtitan-like ``Stateful`` with flattened keys). Each resumed rank's m and
v must equal section 10's rule written out here in float64 from the old ranks' own saved pieces: at another
replica count the mean over the old replicas (float64 sum in replica order, times 1/R, cast back), at the
same count each replica's own; the freshness and the step are kept, the model is one old replica's, and two
more steps stay finite. What is not supported is refused with an error that names the fix.
"""

import glob
import json
import os

import pytest

from tests.support.launch import torchrun

torch = pytest.importorskip("torch")

PER_REPLICA = ("exp_avg", "exp_avg_sq", "freshness")
#: resumed case -> (checkpoint, its step)
CASES = {"2x2_s5": ("s5", 5), "1x4_s7": ("s7", 7), "1x2_s5": ("s5", 5), "2x1_s7": ("s7", 7), "1x2_s7": ("s7", 7),
         "2x1_g9": ("g9", 9), "2x1_d9": ("d9", 9)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both jobs, once: the 4-rank one saves (and resumes on 4 ranks), the 2-rank one resumes from it."""
    out = tmp_path_factory.mktemp("fsdp_resize")
    results = {}
    for mode, n in (("four", 4), ("two", 2)):
        proc = torchrun(n, "-m", "tests.support.fsdp_resize_job", mode, str(out), timeout=150)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        results[mode] = [json.load(open(os.path.join(out, f"{mode}.{k}.json"))) for k in range(n)]
    return out, results


def _dumps(out, prefix):
    return [torch.load(f) for f in sorted(glob.glob(os.path.join(out, f"{prefix}.*.pt")))]


def _replicas(dumps):
    """The old ranks' pieces put together: replica r -> parameter -> key -> the whole tensor."""
    by_r = {}
    for d in dumps:
        by_r.setdefault(d["r"], []).append(d)
    whole = {}
    for r, ds in by_r.items():
        ds.sort(key=lambda d: d["s"])
        whole[r] = {n: {k: torch.cat([d["state"][n][k] for d in ds]) for k in (*PER_REPLICA, "param")}
                    for n in ds[0]["state"]}
    return whole


def _section10(rows):
    """The rule, written out: float64 sum over the old replicas in order, times 1/R, cast to the saved dtype."""
    acc = torch.zeros(rows[0].shape, dtype=torch.float64)
    for x in rows:
        acc += x.to(torch.float64)
    return (acc * (1.0 / len(rows))).to(rows[0].dtype)


def _check_case(out, case):
    tag, step = CASES[case]
    old = _replicas(_dumps(out, f"saved.{tag}"))
    R_old, loaded = len(old), _dumps(out, f"loaded.{case}")
    assert old and len(loaded) == loaded[0]["R"] * loaded[0]["S"], case  # every old and new rank's file
    for d in loaded:
        R, r = d["R"], d["r"]
        assert d["steps"] == step, (case, d["steps"])
        for n, piece in d["state"].items():
            rows = slice(piece["start"], piece["start"] + piece["param"].shape[0])
            whole = {k: [old[q][n][k] for q in range(R_old)] for k in (*PER_REPLICA, "param")}
            for k in ("exp_avg", "exp_avg_sq"):
                want = whole[k][r] if R == R_old else _section10(whole[k])
                assert torch.equal(piece[k], want[rows]), (case, n, k, d["r"], d["s"])
            # the freshness is equal on every old replica and kept; so is the step
            assert all(torch.equal(f, whole["freshness"][0]) for f in whole["freshness"]), (case, n)
            assert torch.equal(piece["freshness"], whole["freshness"][0][rows]), (case, n)
            assert piece["step"] == float(step), (case, n, piece["step"])
            # the model is what DCP saved: one old replica's pieces (all equal right after a sync)
            assert any(torch.equal(piece["param"], x[rows]) for x in whole["param"]), (case, n)
    return old


def test_a_2x2_checkpoint_resumes_bitwise_on_2x2_and_by_section_10_on_1x4_1x2_and_2x1(runs):
    out, results = runs
    for res in results["four"]:
        # the same mesh, through prepare_load too: bitwise the uninterrupted run (parameters and m at step 8)
        assert res["2x2_s5"] == {"finite": True, "steps": 8, "seed": 3, "bitwise": True}, res
        assert res["1x4_s7"] == {"finite": True, "steps": 9, "seed": 3}, res
    for res in results["two"]:
        for case in ("1x2_s5", "2x1_s7", "1x2_s7", "2x1_g9"):
            assert res[case] == {"finite": True, "steps": CASES[case][1] + 2, "seed": 3}, (case, res)
    for case in ("2x2_s5", "1x4_s7", "1x2_s5", "2x1_s7", "1x2_s7"):
        old = _check_case(out, case)
        assert len(old) == 2
    # the replicas' moments differed when saved, so the mean is not any one replica's: the rule was applied
    s7 = _replicas(_dumps(out, "saved.s7"))
    assert not torch.equal(s7[0]["0.weight"]["exp_avg"], s7[1]["0.weight"]["exp_avg"])
    # between syncs the replicas' parameters differ; DCP kept one replica's
    assert not torch.equal(s7[0]["0.weight"]["param"], s7[1]["0.weight"]["param"])


def test_a_1x2_checkpoint_resumes_on_2x1_through_a_torchtitan_like_stateful_and_as_opt_state_dict(runs):
    out, _ = runs
    for case in ("2x1_g9", "2x1_d9"):  # flattened keys by name; keys by parameter index
        old = _check_case(out, case)
        assert len(old) == 1  # R 1 -> 2: both new replicas take the one old replica's moments, bitwise


def test_what_is_not_supported_is_refused_naming_the_fix(runs):
    _, results = runs
    for rank, res in enumerate(results["two"]):
        err = res["errors"]
        # a per-rank file of the 2 x 2 mesh on 2 x 1: its pieces are not this rank's
        assert err["per_rank_file"].startswith("ConfigError") and "prepare_load" in err["per_rank_file"], err
        assert "resumes only on the mesh that saved it" in err["per_rank_file"], err
        # ... on one rank only: that rank raises it, every other rank PeerError (no rank loads alone)
        want = "ConfigError" if rank == 1 else "PeerError"
        assert err["per_rank_file_on_rank_1"].startswith(want) and "per-rank file" in err["per_rank_file_on_rank_1"]
        # a checkpoint without HybridSLAMB's state
        assert err["model_only"].startswith("ConfigError") and "holds no HybridSLAMB state" in err["model_only"], err
        # without prepare_load DCP itself refuses the (R_old, ...) entries, on every rank (docs/algorithm.md
        # section 15.3)
        assert err["no_prepare"] is not None and err["no_prepare"].startswith("CheckpointException"), err
