"""Smoke tests: every example runs for a few steps at 2 ranks, the README's Horovod commands at 4
(the benchmarks: test_benchmarks_smoke.py; the main job, DDP and FSDP2 examples: test_first_screen.py).

Each is launched as its users launch it (scripts/mpirun.sh wraps mpirun with an outer
timeout), so a failing rank ends the run instead of hanging it. Every example logs its bytes
per step the same way (``step N  loss L  sent B B, R of dense``, tests.test_first_screen.STEP);
the Horovod example's runs here are the README's first-screen commands, checked against the
lines the README shows under them (tests/test_first_screen.py).
"""

import csv
import math

import pytest

from tests.support.launch import mpirun  # noqa: E402
from tests.test_first_screen import STEP, check_against_readme, run_readme_command


def test_numpy_slamb_example_runs_and_reports_bytes():
    out = mpirun(2, "examples/numpy_slamb.py", "--steps", "12", "--log-every", "4", "--sync-interval", "5")
    assert "validation loss" in out
    assert [int(m[1]) for m in map(STEP.match, out.splitlines()) if m] == [1, 4, 8, 12], out
    # 12 steps at ratio 0.1 with syncs after steps 1, 6, 11: well under half of dense LAMB's bytes
    line = next(l for l in out.splitlines() if l.startswith("bytes handed to MPI"))
    frac = float(line.split("->")[1].split("%")[0]) / 100
    assert 0.1 < frac < 0.5, line


# slamb: the main job (test_first_screen.py::test_main_job runs scripts/main.sh at 4 ranks)
@pytest.mark.parametrize("optimizer", ["lamb", "adam", "sgd", "topk-adam"])
def test_lm_example_each_optimizer(optimizer, tmp_path):
    out_csv = tmp_path / "lm.csv"
    out = mpirun(2, "examples/train_lm.py", "--optimizer", optimizer, "--steps", "4", "--eval-every", "2",
                 "--eval-batches", "1", "--files", "20", "--no-progress", "--csv", str(out_csv))
    assert f"summary: {optimizer} final val loss" in out
    assert [int(m[1]) for m in map(STEP.match, out.splitlines()) if m] == [2, 4], out
    rows = list(csv.DictReader(open(out_csv)))
    assert [int(r["step"]) for r in rows] == [2, 4]
    frac = float(rows[-1]["bytes_vs_dense"])
    if optimizer == "topk-adam":
        assert frac < 0.6, frac  # sparse: well under dense even with the step-1 parameter sync
    else:
        assert frac == 1.0


def test_lm_example_onebit_lamb_compresses_after_freeze_step(tmp_path):
    out_csv = tmp_path / "lm.csv"
    out = mpirun(2, "examples/train_lm.py", "--optimizer", "onebit_lamb", "--steps", "8", "--freeze-step", "4",
                 "--eval-every", "4", "--eval-batches", "1", "--files", "20", "--no-progress", "--csv", str(out_csv))
    assert "summary: onebit_lamb final val loss" in out
    rows = list(csv.DictReader(open(out_csv)))
    # warm-up: dense LAMB's bytes; then the 1-bit exchange: 1/32 (1 + 1/P) of them per step
    assert float(rows[0]["bytes_vs_dense"]) == pytest.approx(1.0, abs=1e-4)  # plus a 4-byte status word
    assert 0.5 < float(rows[-1]["bytes_vs_dense"]) < 0.6, rows[-1]


def test_digits_example_onebit_lamb_trains_with_a_larger_eps():
    """docs/onebit_lamb.md section 4: at DeepSpeed's eps 1e-8 1-bit LAMB diverges on the digits
    right after the freeze; with eps 1e-4 it trains (a finite loss, well below chance)."""
    out = mpirun(2, "examples/train_digits.py", "--optimizer", "onebit_lamb", "--steps", "60", "--freeze-step", "20",
                 "--eval-every", "30", "--eps", "1e-4", "--no-progress")
    line = next(ln for ln in out.splitlines() if ln.startswith("summary: onebit_lamb"))
    loss = float(line.split("final val loss ")[1].split(",")[0])
    assert math.isfinite(loss) and loss < 1.0, line  # 10 classes: chance is ln 10 = 2.3


def test_digits_example_slamb_fp16(tmp_path):
    out = mpirun(2, "examples/train_digits.py", "--steps", "6", "--eval-every", "3", "--value-dtype", "float16",
                 "--no-progress")
    assert "summary: slamb final val loss" in out and "accuracy" in out
    assert [int(m[1]) for m in map(STEP.match, out.splitlines()) if m] == [3, 6], out


def test_horovod_slamb_example_under_mpirun():
    """The README's mpirun command (scripts/mpirun.sh, 4 ranks) at 10 steps: the lines it shows."""
    command = "bash scripts/mpirun.sh 4 300 python3 examples/horovod_slamb.py"
    proc = run_readme_command(command, "--steps", "10")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_against_readme(command, proc.stdout, proc.stderr)


@pytest.mark.parametrize("mode", ["slamb", "topk"])
def test_horovod_slamb_example_checkpoint_and_resume(mode, tmp_path):
    """Horovod's resume idiom: rank 0 saves at the end; the next run's rank 0 loads, then
    broadcast_parameters / broadcast_optimizer_state / the start step reach every rank."""
    ckpt = tmp_path / "ckpt.pt"
    first = mpirun(2, "examples/horovod_slamb.py", "--mode", mode, "--steps", "3", "--log-every", "1",
                   "--checkpoint", str(ckpt), timeout=180)
    assert "resumed from step" not in first
    assert "step    3" in first and f"saved checkpoint at step 3 to {ckpt}" in first
    assert ckpt.exists() and not list(tmp_path.glob("*.tmp*"))  # written through a temporary file, then renamed
    second = mpirun(2, "examples/horovod_slamb.py", "--mode", mode, "--steps", "3", "--log-every", "1",
                    "--checkpoint", str(ckpt), "--resume", timeout=180)
    assert f"resumed from step 3 ({ckpt})" in second
    logged = [int(line.split()[1]) for line in second.splitlines() if line.startswith("step ")]
    assert logged == [4, 5, 6], logged  # starts at the saved step
    assert f"({mode})" in second and f"saved checkpoint at step 6 to {ckpt}" in second


def test_horovod_slamb_example_under_horovodrun():
    """The README's horovodrun command as written (4 ranks; horovodrun passes mpirun
    --allow-run-as-root itself) at 10 steps: the lines it shows."""
    import shutil

    if shutil.which("horovodrun") is None:
        pytest.skip("horovodrun is not installed")
    command = "horovodrun -np 4 python examples/horovod_slamb.py"
    proc = run_readme_command(command, "--steps", "10")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_against_readme(command, proc.stdout, proc.stderr)


def test_lm_example_saves_on_two_ranks_and_resumes_on_one(tmp_path):
    """The README's resize commands ("Jobs that change size") at a small scale: --save-at on 2
    ranks, --resume on 1 (the checkpoint resized by docs/algorithm.md section 10), trained on to
    the end."""
    ckpt = tmp_path / "ckpt"
    common = ["--optimizer", "slamb", "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--files", "20",
              "--no-progress", "--checkpoint-dir", str(ckpt)]
    first = mpirun(2, "examples/train_lm.py", *common, "--save-at", "2", "--csv", str(tmp_path / "a.csv"))
    assert "summary: slamb final val loss" in first
    second = mpirun(1, "examples/train_lm.py", *common, "--resume", "--csv", str(tmp_path / "b.csv"))
    assert f"resumed at step 2 from {ckpt} (saved by 2 ranks, now 1)" in second, second[-2000:]
    assert [int(r["step"]) for r in csv.DictReader(open(tmp_path / "b.csv"))] == [4]
