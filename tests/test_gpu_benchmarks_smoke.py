"""Smoke tests of the GPU benchmarks on the CPU, at tiny sizes: what ``benchmarks/gpu_check.sh``
runs on a GPU machine (which has no network and little time) must run here first.

``benchmarks/gpu_train_step.py`` (a whole training step of a GPT-like model: AdamW, SLAMB, and
DistributedOptimizer(SLAMB) on a 1-rank gloo group made in the process) and
``benchmarks/gpu_step.py`` (the optimizer step alone, arms interleaved or a fresh process each)
run as users run them (in subprocesses with timeouts, but for one ``gpu_step.py`` run in this
process, to save the start of one more); their CSVs must hold every arm with finite
numbers, the device's name and the date. No timing is asserted.
"""

import csv
import math
import os
import subprocess
import sys

import pytest

from tests.support.launch import script_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
gpu_step = script_module("benchmarks/gpu_step.py")


def _run(script, *args, timeout=120):
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, f"{script} failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _finite(row, *keys):
    for k in keys:
        assert math.isfinite(float(row[k])), (k, row[k])


def test_train_step_writes_every_arm_with_finite_numbers(tmp_path):
    out = tmp_path / "train.csv"
    text = _run("gpu_train_step.py", "--device", "cpu", "--layers", 2, "--width", 32, "--heads", 2, "--vocab", 128,
                "--batch", 2, "--seq", 16, "--steps", 2, "--warmup", 1, "--repeats", 2, "--out", out)
    assert "| arm | step ms | optimizer ms |" in text
    rows = _rows(out)
    assert [r["arm"] for r in rows] == ["adamw-fused", "slamb", "slamb-distributed"]
    for r in rows:
        _finite(r, "step_ms_median", "step_ms_min", "step_ms_max", "opt_ms_median", "opt_share",
                "vs_adamw-fused_median", "vs_adamw-fused_min", "vs_adamw-fused_max", "loss_last")
        assert float(r["step_ms_min"]) <= float(r["step_ms_median"]) <= float(r["step_ms_max"])
        assert 0 < float(r["opt_ms_median"]) <= float(r["step_ms_median"])
        assert r["device"].startswith("cpu") and len(r["date"]) == 10 and r["autocast"] == "none"
        # 2 blocks of 12 w^2 + 13 w, the embeddings (128 + 16) w, the final norm 2 w, the head 128 w
        assert int(r["params"]) == 2 * (12 * 32 * 32 + 13 * 32) + (128 + 16) * 32 + 2 * 32 + 128 * 32
    assert float(rows[0]["vs_adamw-fused_median"]) == 1.0


def test_optimizer_step_interleaved_and_fresh(tmp_path):
    out, kout = tmp_path / "step.csv", tmp_path / "kernels.csv"
    gpu_step.main(["--device", "cpu", "--tensors", "2,3", "--elements", "12000", "--reps", "2", "--profile-steps",
                   "1", "--arms", "adamw-fused,slamb", "--out", str(out), "--kernels-out", str(kout)])
    rows = _rows(out)
    assert [(r["tensors"], r["arm"]) for r in rows] == [("2", "adamw-fused"), ("2", "slamb"), ("3", "adamw-fused"),
                                                       ("3", "slamb")]
    for r in rows:
        _finite(r, "step_ms_median", "vs_first_arm", "ratio_p25", "ratio_p75")
        assert r["device"].startswith("cpu") and len(r["date"]) == 10
    assert kout.exists()  # no device events on the CPU: the table is empty there
    fresh = tmp_path / "fresh.csv"
    _run("gpu_step.py", "--device", "cpu", "--tensors", 2, "--elements", 12000, "--reps", 2, "--no-profile",
         "--arms", "adamw-fused,slamb-fp16", "--fresh", "--out", fresh)
    rows = _rows(fresh)
    assert [r["arm"] for r in rows] == ["adamw-fused", "slamb-fp16"]
    assert all(r["fresh_process"] == "1" and r["ratio_p25"] == "" for r in rows)
    _finite(rows[1], "step_ms_median", "vs_first_arm")
    assert float(rows[0]["vs_first_arm"]) == 1.0


def test_tally_of_device_events():
    events = [("slamb_moments_f4h2", 30.0), ("slamb_update_f4", 20.0), ("Memcpy HtoD (Pageable -> Device)", 2.0),
              ("Memset (Device)", 1.0), ("slamb_moments_f4h2", 30.0), ("slamb_update_f4", 20.0),
              ("Memcpy DtoH (Device -> Pinned)", 1.0), ("Memcpy DtoD (Device -> Device)", 4.0)]
    kernels, htod, dtoh, table = gpu_step.tally(events, steps=2)
    assert (kernels, htod, dtoh) == (2.0, 0.5, 0.5)
    assert [r["kernel"] for r in table[:2]] == ["slamb_moments_f4h2", "slamb_update_f4"]
    first = table[0]
    assert first["calls_per_step"] == 1.0 and first["device_us_per_step"] == 30.0 and first["kind"] == "kernel"
    assert abs(first["share"] - 60.0 / 108.0) < 1e-12 and abs(sum(r["share"] for r in table) - 1.0) < 1e-12
    assert {r["kind"] for r in table} == {"kernel", "htod", "dtoh", "memset", "memcpy"}


def test_gpu_check_script_parses():
    script = os.path.join(BENCH, "gpu_check.sh")
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    if not os.access(script, os.X_OK):
        pytest.fail("benchmarks/gpu_check.sh is not executable (chmod +x)")
