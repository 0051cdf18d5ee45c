"""slamb_comm.adapters.lightning under a real Lightning Trainer: 2 ranks under torchrun (gloo,
CPU), each launch under an outer timeout (tests/support/launch.py). The jobs are tests/support/lightning_job.py;
they assert on every rank and print what they measured.

* SLAMB at ratio 1 equals the stock DDP + slamb_hook loop (compared with the dense reference of
  docs/algorithm.md section 1 in mpi_tests/test_torch_dist.py), replicas agree after the
  periodic sync; at ratio 0.1 a step sends 0.1 of the weights and the dense biases.
* top-k: TopK(1.0) is DDP's averaging; TopK(0.1) sends the expected elements.
* bf16-mixed, gradient_clip_val, accumulate_grad_batches: the hook runs once per step; an LR
  scheduler on the bare SLAMB follows the distributed optimizer.
* ModelCheckpoint + fit(ckpt_path=...) by a new Trainer is bitwise the uninterrupted run
  (tests/test_torchrun.py resumes in new processes at the torch level).
* the misuses raise at the first step, naming the fix.
* issue 37: the checkpoint's state_dict is the float64 mean of the ranks' replicas (computed here
  from each rank's own parameters), the resume stays bitwise, the bytes reach the logger.
"""

import json

import pytest

from tests.support.launch import torchrun

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

JOB = "tests.support.lightning_job"  # a module: "-m", JOB


def run_case(case, out, *extra):
    proc = torchrun(2, "-m", JOB, case, str(out), *extra, timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    res = [json.loads((out / f"{case}.{rank}.json").read_text()) for rank in (0, 1)]
    return res[0]


def test_slamb_ratio1_equals_ddp_hook_loop_and_ratio01_bytes(tmp_path):
    res = run_case("slamb", tmp_path)
    assert res["ratio1_maxdiff"] <= 1e-6 and res["ratio1_hook_calls"] >= 9
    assert res["bytes_ratio"] < 0.16, res  # (256 + 132) / 2692 elements, plus status words


def test_topk_ratio1_is_ddp_and_ratio01_bytes(tmp_path):
    res = run_case("topk", tmp_path)
    assert res["ratio1_maxdiff"] < 1e-5 and res["hook_calls"] == 5
    assert res["bytes"] < 0.25 * res["dense_bytes"], res


def test_bf16_clipping_and_accumulation(tmp_path):
    res = run_case("recipes", tmp_path)
    assert res == {"slamb_hook_calls": 4, "topk_hook_calls": 4, "fp16_slamb_hook_calls": 4, "fp16_topk_hook_calls": 4}


def test_misuse_raises_naming_the_fix(tmp_path):
    res = run_case("misuse", tmp_path)
    assert set(res) == {"slamb_plain_ddp", "topk_opt_plain_ddp", "topk_hook_not_registered",
                        "plain_sgd_under_slamb_strategy"}


def test_checkpoint_resume_is_bitwise(tmp_path):
    """Uninterrupted 12 steps against 6, a checkpoint, and a resume by a new model, strategy and
    Trainer (the job compares on every rank, and checks SLAMB's replicas differ at step 12)."""
    res = run_case("resume", tmp_path)
    assert res["slamb_ranks_differ"] is True
    # the same checkpoint (saved at 2 ranks) on 1 rank: both ranks' files averaged (docs/algorithm.md
    # section 10), no rank-0 fallback, training goes on
    proc = torchrun(1, "-m", JOB, "resize", str(tmp_path), timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads((tmp_path / "resize.0.json").read_text())
    assert res["slamb_params_averaged"] >= 2 and res["slamb_optimizer_averaged"] >= 4, res  # between syncs
    assert res["topk_residuals_averaged"] >= 1, res


def test_saved_model_is_the_mean_of_the_replicas_and_bytes_are_logged(tmp_path):
    """Issue 37, 30 steps at H = 100: checkpoint 30's state_dict is the float64 mean of the two
    ranks' parameters (which differ), its per-rank files keep each rank's own, and a resume from
    checkpoint 15 is bitwise (asserted in the job); the CSVLogger's metrics carry every step's bytes."""
    import csv

    res = run_case("saved_mean", tmp_path)
    own = [torch.load(tmp_path / f"own.{r}.pt") for r in (0, 1)]
    saved = torch.load(tmp_path / "ck" / "step=30.ckpt", weights_only=False)["state_dict"]
    assert saved.keys() == own[0].keys()
    differ = 0
    for k, v in saved.items():
        mean = ((own[0][k].double() + own[1][k].double()) / 2).to(own[0][k].dtype)
        assert torch.equal(v, mean), k
        differ += not torch.equal(own[0][k], own[1][k])
    assert differ >= 2, "the replicas' weights should differ (H = 100)"
    for r in (0, 1):
        mine = torch.load(tmp_path / "ck" / f"step=30.ckpt.slamb_rank{r}", weights_only=False)["state_dict"]
        assert all(torch.equal(mine[k], own[r][k]) for k in own[r]), r

    rows = list(csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv")))
    logged = [float(r["slamb/payload_bytes"]) for r in rows if r.get("slamb/payload_bytes")]
    assert logged == [float(b) for b in res["payload"]] and len(logged) == 30, (logged, res["payload"])
    ratios = [float(r["slamb/of_dense"]) for r in rows if r.get("slamb/of_dense")]
    assert ratios[0] > 1.0, ratios[0]  # step 1 also syncs the parameters (docs/integrations.md)
    want = (256 + 132) / 2692  # 0.1 of the two weights, the biases whole, + status words
    assert all(want < x < want + 0.01 for x in ratios[1:]), ratios
    assert all(abs(a - b) < 1e-6 for a, b in zip(ratios, res["of_dense"]))
