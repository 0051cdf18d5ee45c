"""slamb_comm.adapters.lightning under a real Lightning Trainer: 2 ranks under torchrun (gloo,
CPU), each launch under an outer timeout (tests/launch.py). The jobs are tests/lightning_job.py;
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
"""

import json

import pytest

from launch import torchrun

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

JOB = "tests/lightning_job.py"


def run_case(case, out, *extra):
    proc = torchrun(2, JOB, case, str(out), *extra, timeout=180)
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
    proc = torchrun(1, JOB, "resize", str(tmp_path), timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads((tmp_path / "resize.0.json").read_text())
    assert res["slamb_params_averaged"] >= 2 and res["slamb_optimizer_averaged"] >= 4, res  # between syncs
    assert res["topk_residuals_averaged"] >= 1, res
