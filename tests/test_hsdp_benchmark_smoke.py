"""Smoke test of benchmarks/hsdp.py's ``measure`` (replica bytes and optimizer memory) at a tiny size,
under torchrun (4 CPU ranks, gloo, a 2 x 2 mesh), as its users launch it: the CSVs and tables are
written and their figures are sane. No timing is asserted (the ``time`` part needs root and minutes)."""

import csv

import pytest

from tests.support.launch import torchrun  # noqa: E402

pytest.importorskip("torch")

TINY = ("--d-model", "32", "--heads", "2", "--layers", "1", "--context", "16", "--steps", "6",
        "--sync-interval", "3", "--no-warm")


def test_measure_writes_bytes_and_memory(tmp_path):
    out = tmp_path / "hsdp_bytes.csv"
    proc = torchrun(4, "benchmarks/hsdp.py", "measure", *TINY, "--out", str(out), timeout=150)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "| arm | local params | HSDP model count / step |" in proc.stdout
    assert "| arm | optimizer state / local param | / AdamW |" in proc.stdout

    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert sorted((r["arm"], int(r["rank"])) for r in rows) == sorted(
        (a, k) for a in ("hsdp_adamw", "hybrid_slamb") for k in range(4))
    for r in rows:
        n = int(r["params_local"])
        assert 0 < n < int(r["params_total"]) and int(r["steps"]) == 6
        assert int(r["hsdp_model_bytes_per_step"]) == 4 * n
        assert float(r["shard_bytes_per_step"]) > 0  # FSDP2's all-gathers and reduce-scatters in the shard group
        if r["arm"] == "hsdp_adamw":
            # what crossed the replica group is exactly HSDP's float32 allreduce of every gradient piece
            assert float(r["replica_bytes_steady"]) == 4 * n == float(r["replica_bytes_mean_all"])
            assert r["replica_bytes_sync_step"] == ""
            continue
        steady, sync = float(r["replica_bytes_steady"]), float(r["replica_bytes_sync_step"])
        # a float16 payload: at most half of the float32 pieces even where every tensor goes whole
        assert 0 < steady < 0.6 * 4 * n
        assert sync > 4 * n  # the sync step sends the parameters (float32) besides the momentum
        # the period mean: 1 sync step in 3 (steps 1 and 4 of 6)
        assert float(r["replica_bytes_period_mean"]) == pytest.approx((sync + 2 * steady) / 3, rel=1e-3)
        assert float(r["of_hsdp_steady"]) == pytest.approx(steady / (4 * n))
        # the optimizer's own count (step_traffic) against what crossed: the rest are a few flag words
        extra = steady - float(r["step_traffic_payload_steady"])
        assert 0 <= extra <= 16 * int(r["tensors"]) + 64
        assert int(r["step_traffic_dense_per_step"]) == 4 * n

    with open(tmp_path / "hsdp_memory.csv") as fh:
        mem = list(csv.DictReader(fh))
    assert len(mem) == 8
    for m in mem:
        per = float(m["state_bytes_per_param"])
        if m["arm"] == "hsdp_adamw":  # exp_avg and exp_avg_sq in float32, a step scalar per tensor
            assert 8.0 <= per < 8.5 and "exp_avg_sq=" in m["state_breakdown"]
            assert float(m["state_of_adamw"]) == 1.0
        else:  # m and v in float32, and scratch
            assert per >= 8.0 and "m=" in m["state_breakdown"] and "v=" in m["state_breakdown"]
            assert float(m["state_of_adamw"]) == pytest.approx(per / 8.0, rel=0.02)
        assert float(m["rss_growth_first_step"]) >= 0
