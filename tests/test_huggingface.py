"""slamb_comm.adapters.huggingface under the real transformers.Trainer and Accelerate: 2 ranks
under torchrun (gloo, CPU), each launch under an outer timeout (tests/support/launch.py). The jobs are
tests/support/hf_job.py; they assert on every rank and write what they measured.

* SlambTrainer, SLAMB at ratio 1 with the Trainer's default clipping (max_grad_norm=1.0):
  bitwise the stock DDP + slamb_hook loop replayed on the Trainer's batches (that loop is
  compared with the dense reference of docs/algorithm.md section 1 in mpi_tests/test_torch_dist.py);
  replicas agree after the periodic sync; ratio 0.1 and TopK(0.1): a step's bytes; TopK(1.0)
  is the stock Trainer's DDP averaging.
* gradient_accumulation_steps and bf16; save_steps + resume_from_checkpoint bitwise.
* Accelerate: install() after prepare, save_rank_state / load_rank_state.
* the misuses raise at the first step, naming the fix.
* issue 37: save_model, the checkpoints and Accelerate's get_state_dict / save_model / save_state
  write the float64 mean of the ranks' replicas (computed here from each rank's own parameters)
  while resumes stay bitwise; the bytes reach the log history and Accelerate's trackers; an
  AdamW-like lr gets one warning.
"""

import json

import pytest

from tests.support.launch import torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

JOB = "tests.support.hf_job"  # a module: "-m", JOB


def run_case(case, out):
    proc = torchrun(2, "-m", JOB, case, str(out), timeout=180)
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
    proc = torchrun(1, "-m", JOB, "resize", str(tmp_path), timeout=180)
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


# ----------------------------------------------------------------------------- issue 37
def _assert_mean(saved, own, keys_at_least):
    """Every tensor in ``saved`` is the float64 mean of the two ranks' own, cast back; returns how
    many of them differ between the ranks (the test proves something only if some do)."""
    assert len(saved) >= keys_at_least and set(saved) <= set(own[0]), sorted(set(saved) ^ set(own[0]))
    differ = 0
    for k, v in saved.items():
        mean = ((own[0][k].double() + own[1][k].double()) / 2).to(own[0][k].dtype)
        assert torch.equal(v, mean), k
        differ += not torch.equal(own[0][k], own[1][k])
    return differ


WANT = (256 + 132) / 2692  # the test MLP at ratio 0.1: 0.1 of the two weights, the biases whole, + status words


def test_trainer_saves_the_mean_of_the_replicas_and_logs_the_bytes(tmp_path):
    """Issue 37's tiny GPT-2 (tied output layer), 30 steps at H = 100: save_model's and checkpoint-30's
    weights are the float64 mean of the ranks' parameters, checkpoint-30's per-rank files keep each
    rank's own, the resume from checkpoint-15 is bitwise (asserted in the job), and the log history
    carries each step's bytes: 0.205 of dense per step, and at step 1 the parameter sync plus the
    exchange twice (the Trainer clips at max_grad_norm=1.0, so the first exchange is redone from
    step()): 1 + 2 x 0.205 = 1.41, issue 37's figure."""
    from safetensors.torch import load_file

    res = run_case("saved_mean", tmp_path)
    own = [torch.load(tmp_path / f"own.{r}.pt") for r in (0, 1)]
    for path in (tmp_path / "final", tmp_path / "run" / "checkpoint-30"):
        assert _assert_mean(load_file(path / "model.safetensors"), own, 20) >= 10, path
    for r in (0, 1):
        mine = torch.load(tmp_path / "run" / "checkpoint-30" / f"slamb_rank{r}.pt", weights_only=False)["model"]
        assert all(torch.equal(mine[k], own[r][k]) for k in own[r]), r
    assert res["logged_payload"] == res["payload"] and len(res["payload"]) == 30
    assert res["logged_of_dense"] == res["of_dense"]
    assert all(0.205 < x < 0.2054 for x in res["of_dense"][1:]), res["of_dense"]
    assert abs(res["of_dense"][0] - (1 + 2 * res["of_dense"][1])) < 1e-3, res["of_dense"][:2]


def test_trainer_warns_once_when_the_lr_looks_like_adamw(tmp_path):
    res = run_case("lr_warning", tmp_path)
    assert "learning_rate=0.01" in res["warning"] and "1e-3" not in res["warning"], res


def test_accelerate_saves_the_mean_of_the_replicas_and_logs_the_bytes(tmp_path):
    """Accelerate + install(), 30 steps at H = 100: get_state_dict, save_model and save_state's
    weights are the float64 mean of the ranks' parameters; load_state + load_rank_state resume
    bitwise (asserted in the job); accelerator.log(step_metrics(state)) reaches the tracker."""
    from safetensors.torch import load_file

    res = run_case("accelerate_saved_mean", tmp_path)
    own = [torch.load(tmp_path / f"own.{r}.pt") for r in (0, 1)]
    assert _assert_mean(torch.load(tmp_path / "acc_get_state_dict.pt"), own, 4) == 4
    assert _assert_mean(load_file(tmp_path / "acc_final" / "model.safetensors"), own, 4) == 4
    at15 = [torch.load(tmp_path / "acc15" / f"slamb_rank{r}.pt", weights_only=False)["model"] for r in (0, 1)]
    state15 = {k.removeprefix("module."): v for k, v in load_file(tmp_path / "acc15" / "model.safetensors").items()}
    assert _assert_mean(state15, at15, 4) == 4
    logged = [x for x in res["logged"] if "slamb/of_dense" in x]
    assert [x["step"] for x in logged] == list(range(1, 31)), logged
    assert logged[0]["slamb/of_dense"] > 1.0 and all(WANT < x["slamb/of_dense"] < WANT + 0.01 for x in logged[1:])
    assert all(x["slamb/payload_bytes"] > 0 and x["slamb/wire_bytes"] > 0 for x in logged)
