"""slamb_comm.adapters.huggingface under the real transformers.Trainer and Accelerate: 2 ranks
under torchrun (gloo, CPU), each launch under an outer timeout (tests/launch.py). The jobs are
tests/hf_job.py; they assert on every rank and write what they measured.

* SlambTrainer, SLAMB at ratio 1 with the Trainer's default clipping (max_grad_norm=1.0):
  bitwise the stock DDP + slamb_hook loop replayed on the Trainer's batches (that loop is
  compared with the dense reference of docs/algorithm.md section 1 in mpi_tests/test_torch_dist.py);
  replicas agree after the periodic sync; ratio 0.1 and TopK(0.1): a step's bytes; TopK(1.0)
  is the stock Trainer's DDP averaging.
* gradient_accumulation_steps and bf16; save_steps + resume_from_checkpoint bitwise.
* Accelerate: install() after prepare, save_rank_state / load_rank_state.
* the misuses raise at the first step, naming the fix.
"""

import json

import pytest

from launch import torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

JOB = "tests/hf_job.py"


def run_case(case, out):
    proc = torchrun(2, JOB, case, str(out), timeout=180)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    res = [json.loads((out / f"{case}.{rank}.json").read_text()) for rank in (0, 1)]
    return res[0]


def test_trainer_slamb_against_the_ddp_loop_and_its_bytes(tmp_path):
    res = run_case("trainer", tmp_path)
    assert res["ratio1_maxdiff"] <= 1e-6 and res["hook_calls"] == 9
    assert res["slamb_step_bytes"] < 0.16 * res["dense_bytes"], res


def test_trainer_topk_against_ddp_and_its_bytes(tmp_path):
    res = run_case("trainer_topk", tmp_path)
    assert res["topk1_maxdiff"] < 1e-5
    assert res["topk_step_bytes"] < 0.25 * res["dense_bytes"], res


def test_trainer_accumulation_and_bf16(tmp_path):
    res = run_case("recipes", tmp_path)
    assert res == {"accumulate_maxdiff": 0.0, "bf16_slamb_hook_calls": 4, "bf16_topk_hook_calls": 4}


def test_trainer_resume_from_checkpoint_is_bitwise(tmp_path):
    res = run_case("resume", tmp_path)
    assert res == {"slamb_ranks_differ": True, "topk_ranks_differ": False}
    # the same checkpoint (saved at 2 ranks) on 1 rank: both ranks' files averaged (docs/algorithm.md
    # section 10), no rank-0 fallback, training goes on
    proc = torchrun(1, JOB, "resize", str(tmp_path), timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads((tmp_path / "resize.0.json").read_text())
    assert res["slamb_params_averaged"] >= 2 and res["slamb_optimizer_averaged"] >= 4, res  # between syncs
    assert res["topk_residuals_averaged"] >= 1, res


def test_accelerate_install_and_rank_state(tmp_path):
    res = run_case("accelerate", tmp_path)
    assert res["slamb_maxdiff"] <= 1e-6 and res["slamb_hook_calls"] == 7


def test_misuse_raises_naming_the_fix(tmp_path):
    res = run_case("misuse", tmp_path)
    assert set(res) == {"slamb_stock_trainer", "topk_opt_stock_trainer", "adamw_in_slamb_trainer"}
