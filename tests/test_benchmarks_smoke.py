"""Smoke tests of the benchmarks: the OSU-style benchmark (2 ranks, tiny sizes), the
analytic model, and the emulated cluster's set-up / tear-down (root + `ip netns` only).

Everything runs in subprocesses with timeouts, as users run it.
"""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.support.launch import ROOT, mpirun  # noqa: E402
CLUSTER = os.path.join(ROOT, "benchmarks", "cluster.py")


def _have_horovod():
    return subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------- OSU benchmark
def test_osu_benchmark_writes_csv_plots_and_table(tmp_path):
    methods = "mpi,hvd,hvd_fp16,masked,topk" if _have_horovod() else "mpi,masked,topk"
    out_csv = tmp_path / "osu.csv"
    out = mpirun(2, "benchmarks/osu.py", "--sizes", "12", "--ratios", "1,0.1", "--iters", "2", "--min-iters", "2",
                 "--warmup", "1", "--max-seconds", "0.5", "--methods", methods, "--out", str(out_csv))
    assert "| method | payload / dense |" in out
    rows = list(csv.DictReader(open(out_csv)))
    assert {r["method"] for r in rows} == set(methods.split(","))
    n = 4096
    for r in rows:
        assert int(r["ranks"]) == 2 and int(r["elements"]) == n and int(r["iters"]) == 2
        assert float(r["lat_min_s"]) <= float(r["lat_median_s"]) <= float(r["lat_max_s"])
        assert r["horovod_autotune"] == "0" and r["horovod_fusion_threshold"] and r["horovod_cycle_time"]
    dense = next(r for r in rows if r["method"] == "mpi" and r["payload_dtype"] == "float32")
    assert int(dense["payload_bytes"]) == 4 * n and float(dense["time_vs_dense"]) == 1.0
    # 2 ranks: a ring allreduce puts 2 (P-1)/P = 1 x the payload on the wire
    assert float(dense["wire_bytes"]) == 4 * n
    # masked fp16 at k = 0.1 (always-dense rule off): one cyclic chunk (409 or 410 of 4096) + the status element
    m16 = next(r for r in rows if r["method"] == "masked" and r["payload_dtype"] == "float16" and r["ratio"] == "0.1")
    assert int(m16["payload_bytes"]) in (2 * 410, 2 * 411)
    assert float(m16["encode_s"]) > 0 and float(m16["decode_s"]) > 0 and float(m16["encode_in_GBps"]) > 0
    # top-k fp32 at k = 0.1: 410 values + 410 int32 indices + an 8-byte header; allgather wire (P-1) x payload
    t32 = next(r for r in rows if r["method"] == "topk" and r["payload_dtype"] == "float32" and r["ratio"] == "0.1")
    assert int(t32["payload_bytes"]) == 410 * 8 + 8 and float(t32["wire_bytes"]) == int(t32["payload_bytes"])
    for png in ("osu_latency_p2.png", "osu_ratios.png"):
        assert (tmp_path / png).stat().st_size > 1000


# ---------------------------------------------------------------------------- codec benchmark
def test_codec_benchmark_writes_csv_plot_and_tables(tmp_path):
    out_csv = tmp_path / "codec.csv"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "codec.py"), "--sizes", "15",
                          "--ratios", "0.1,0.01", "--blocks", "1,64", "--repeats", "2", "--out", str(out_csv)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "| n | k / n | method |" in out and "gather / memcpy" in out
    rows = list(csv.DictReader(open(out_csv)))
    topk = {(r["method"], r["ratio"]) for r in rows if r["part"] == "topk"}
    assert {("fast", "0.1"), ("argpartition", "0.01"), ("sort_reference", "0.1")} <= topk
    mask = [r for r in rows if r["part"] == "mask"]
    assert {(r["method"], r["block"]) for r in mask} == {(op, b) for op in ("gather", "scatter") for b in ("1", "64")}
    for r in rows:
        assert int(r["elements"]) == 2**15 and float(r["p25"]) <= float(r["seconds"]) <= float(r["p75"])
        assert float(r["GBps"]) > 0
    assert all(float(r["vs_baseline"]) > 0 and float(r["copy_seconds"]) > 0 for r in mask)
    assert (tmp_path / "codec.png").stat().st_size > 1000


# ---------------------------------------------------------------------------- end-to-end LM (no emulation)
@pytest.mark.skipif(not _have_horovod(), reason="horovod.torch is not installed")
def test_cluster_lm_local_writes_step_times_and_bytes(tmp_path):
    out_csv = tmp_path / "lm.csv"
    p = subprocess.run([sys.executable, CLUSTER, "lm", "--nodes", "2", "--rates", "local", "--steps", "4",
                        "--d-model", "64", "--files", "5", "--timeout", "300", "--out", str(out_csv)],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "| nodes | link per node | optimizer | median step ms |" in p.stdout
    rows = {r["optimizer"]: r for r in csv.DictReader(open(out_csv))}
    assert set(rows) == {"lamb", "slamb"} and all(r["ok"] == "1" and r["link"] == "local" for r in rows.values())
    lamb, slamb = rows["lamb"], rows["slamb"]
    assert float(lamb["step_ms_median"]) > 0 and float(slamb["step_ms_median"]) > 0
    assert float(lamb["payload_bytes_per_step"]) == float(lamb["dense_bytes_per_step"]) == 4 * int(lamb["params"])
    assert float(slamb["payload_bytes_per_step"]) < 0.5 * float(lamb["payload_bytes_per_step"])
    assert (tmp_path / "lm.png").stat().st_size > 1000


def test_cluster_tta_local_finds_the_time_to_dense_lambs_loss(tmp_path):
    out_csv = tmp_path / "tta.csv"
    p = subprocess.run([sys.executable, CLUSTER, "tta", "--nodes", "2", "--rate", "local", "--steps", "8",
                        "--eval-every", "4", "--files", "5", "--methods", "SLAMB k=0.1 fp16,dense LAMB",
                        "--lrs", "dense LAMB=0.01,SLAMB k=0.1 fp16=0.01", "--timeout", "300", "--out", str(out_csv)],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = list(csv.DictReader(open(out_csv)))
    assert [(r["label"], r["step"]) for r in rows] == [("dense LAMB", "4"), ("dense LAMB", "8"),
                                                      ("SLAMB k=0.1 fp16", "4"), ("SLAMB k=0.1 fp16", "8")]
    assert all(0 < float(r["train_seconds"]) <= float(r["seconds"]) for r in rows)
    table = (tmp_path / "tta.md").read_text()
    target = float(rows[1]["val_loss"])
    assert f"target: dense LAMB's final validation loss {target:.4f}" in table
    dense_line = next(line for line in table.splitlines() if line.startswith("| dense LAMB |"))
    first = next(r for r in rows[:2] if float(r["val_loss"]) <= target)  # dense LAMB reaches its own loss
    assert dense_line.startswith(f"| dense LAMB | 0.01 | {first['step']} | ") and "| 1.00x |" in dense_line
    slamb = [r for r in rows if r["label"] != "dense LAMB"]
    hit = next((r for r in slamb if float(r["val_loss"]) <= target), None)
    slamb_line = next(line for line in table.splitlines() if line.startswith("| SLAMB k=0.1 fp16 |"))
    assert ("not reached" in slamb_line) == (hit is None)
    assert (tmp_path / "tta.png").stat().st_size > 1000


def test_convergence_tune_seed_sweeps_one_seed_then_runs_the_best_lr(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/convergence.py", "--methods", "dense LAMB", "--ranks", "2",
                        "--steps", "4", "--eval-every", "2", "--seeds", "0,1", "--tune-seed", "0", "--grid-size", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    runs = sorted(f.name for f in (tmp_path / "runs").iterdir())
    finals = {lr: float(list(csv.DictReader(open(tmp_path / "runs" / f"dense_LAMB_{lr.replace('.', '_')}_steps4.csv")))
                        [-1]["val_loss"]) for lr in ("0.005", "0.01")}
    best = min(finals, key=finals.get)
    assert runs == sorted(["dense_LAMB_0_005_steps4.csv", "dense_LAMB_0_01_steps4.csv",
                           f"dense_LAMB_{best.replace('.', '_')}_seed1_steps4.csv"])
    table = (tmp_path / "convergence.md").read_text()
    assert "best lr per method by final validation loss at seed 0" in table
    assert f"| dense LAMB | {best} |" in table


# ---------------------------------------------------------------------------- analytic model
def test_model_runs_and_predicts_sensible_orderings(tmp_path):
    osu = tmp_path / "osu.csv"
    with open(osu, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["method", "payload_dtype", "ratio", "log2", "elements", "encode_s",
                                           "decode_s", "copy_GBps"])
        w.writeheader()
        # 0.1 * 2^20 * 10 bytes moved in 0.01 s = 1.05e8 B/s against a copy at 5 GB/s (1e10 B/s read + write)
        w.writerow({"method": "masked", "payload_dtype": "float16", "ratio": "0.1", "log2": "20",
                    "elements": str(2**20), "encode_s": "0.005", "decode_s": "0.005", "copy_GBps": "5"})
    cl = tmp_path / "cluster.csv"
    with open(cl, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["ok", "method", "link", "ranks", "elements", "comm_s"])
        w.writeheader()
        # ideal: 2 (4-1)/4 * 4 * 2^20 bytes at 1 Gbit/s = 0.0503 s; measured 0.1006 s -> eta 0.5
        w.writerow({"ok": "1", "method": "dense", "link": "1gbit", "ranks": "4", "elements": str(2**20),
                    "comm_s": str(2 * 6 * 2**20 * 8 / 1e9)})
    out_csv = tmp_path / "model.csv"
    proc = subprocess.run([sys.executable, "benchmarks/model.py", "--osu", str(osu), "--cluster", str(cl),
                           "--out", str(out_csv)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "eta = 0.50" in proc.stdout and "enc_eff = 0.010" in proc.stdout
    rows = list(csv.DictReader(open(out_csv)))
    assert len(rows) == 2 * 2 * 8 * 3
    for r in rows:
        assert 0 < float(r["efficiency"]) <= 1
    get = {(r["model"], r["link_gbit"], r["workers"], r["method"]): float(r["efficiency"]) for r in rows}
    for model in ("BERT-Large", "BERT-XL"):
        for link in ("10", "100"):
            # SLAMB moves ~6% of dense's bytes: never less efficient than dense LAMB
            assert get[(model, link, "1024", "SLAMB")] >= get[(model, link, "1024", "dense LAMB")]
            # efficiency falls with the number of workers (fixed global batch)
            assert get[(model, link, "1024", "dense LAMB")] < get[(model, link, "8", "dense LAMB")]
    assert (tmp_path / "model.png").stat().st_size > 1000


# ---------------------------------------------------------------------------- emulated cluster
def _netns_ok():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None or shutil.which("ping") is None:
        return False
    name = f"sbtprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


needs_netns = pytest.mark.skipif(not _netns_ok(), reason="needs root, iproute2 (ip netns, tc) and ping")


def _names():
    pid = os.getpid() % 10000  # unique per pytest process; the harness refuses if either is taken
    return f"sbt{pid}", f"10.213.{50 + pid % 200}.0/24"


def _ours(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-"))


@needs_netns
def test_cluster_builds_pings_and_tears_down():
    prefix, subnet = _names()
    p = subprocess.Popen([sys.executable, CLUSTER, "check", "--nodes", "2", "--rate", "1gbit", "--prefix", prefix,
                          "--subnet", subnet, "--hold", "3"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.time() + 60
        while "ping ok" not in line and time.time() < deadline:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                break
        assert "ping ok" in line, p.stderr.read()
        assert _ours(prefix) == sorted([f"{prefix}-n0", f"{prefix}-n1", f"{prefix}-br"])
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert _ours(prefix) == []


@needs_netns
def test_cluster_tears_down_on_sigterm():
    prefix, subnet = _names()
    p = subprocess.Popen([sys.executable, CLUSTER, "check", "--nodes", "2", "--prefix", prefix, "--subnet", subnet,
                          "--hold", "120"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "ping ok" in p.stdout.readline() + p.stdout.readline()
        assert len(_ours(prefix)) == 3
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) != 0
    finally:
        if p.poll() is None:
            p.kill()
    assert _ours(prefix) == []


@needs_netns
def test_cluster_refuses_taken_names_and_subnet_and_leaves_them_alone():
    prefix, subnet = _names()
    taken = f"{prefix}-n1"
    subprocess.run(["ip", "netns", "add", taken], check=True)
    try:
        proc = subprocess.run([sys.executable, CLUSTER, "check", "--nodes", "2", "--prefix", prefix,
                               "--subnet", subnet], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3 and "refusing" in proc.stderr and taken in proc.stderr
        assert _ours(prefix) == [taken]  # the namespace that was not ours is still there, nothing else
        # the subnet in use in another namespace (here: the one we just made) is refused too
        net = subnet.rsplit(".", 1)[0]
        subprocess.run(["ip", "-n", taken, "link", "add", "d0", "type", "veth", "peer", "name", "d1"], check=True)
        subprocess.run(["ip", "-n", taken, "addr", "add", f"{net}.77/24", "dev", "d0"], check=True)
        proc = subprocess.run([sys.executable, CLUSTER, "check", "--nodes", "2", "--prefix", prefix + "x",
                               "--subnet", subnet], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3 and "subnet" in proc.stderr, proc.stderr
        assert _ours(prefix + "x") == []
    finally:
        subprocess.run(["ip", "netns", "del", taken], capture_output=True)


@needs_netns
def test_cluster_runs_an_mpi_job_over_tcp():
    prefix, subnet = _names()
    proc = subprocess.run([sys.executable, CLUSTER, "run", "--nodes", "2", "--rate", "1gbit", "--prefix", prefix,
                           "--subnet", subnet, "--timeout", "180", "--", sys.executable, CLUSTER, "loop",
                           "--method", "slamb", "--log2", "16", "--steps", "2", "--warmup", "1", "--matmul-dim", "64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "RESULT " in proc.stdout
    assert '"ranks": 2' in proc.stdout
    # every timed step's bytes went through the emulated links
    assert '"nic_tx_bytes_per_node_per_step": NaN' not in proc.stdout
    assert _ours(prefix) == []


# ---------------------------------------------------------------------------- BERT-Large scale check (1 layer)
@pytest.mark.skipif(not _have_horovod(), reason="horovod.torch is not installed")
def test_scale_one_layer_two_steps_table_and_ratio():
    out = mpirun(2, "benchmarks/scale.py", "--layers", "1", "--steps", "2", timeout=600)
    assert "parameters: 45,428,736 in 23 tensors" in out  # embeddings + 1 encoder layer + pooler
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| step | param sync |"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = {}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(cols, cells))
    assert set(rows) == {"1", "2"}
    assert rows["1"]["param sync"] == "yes" and rows["2"]["param sync"] == "no"
    # step 2: the fp16 masked momentum exchange only, ~0.05 of a dense fp32 allreduce
    assert 0 < float(rows["2"]["payload / dense fp32"]) < 0.2
    # step 1 carries the periodic parameter sync (a full fp32 allreduce) on top
    assert float(rows["1"]["payload / dense fp32"]) > 1.0
    assert rows["1"]["identical params on all ranks"] == "yes"
    for r in rows.values():  # every byte handed to Horovod during a step is in opt.step_traffic()
        assert r["bytes seen by Horovod MB"] == r["payload MB"]
    assert "Steady state over one cycle of H = 100 steps" in out


# ---------------------------------------------------------------------------- optimizer benchmark
def test_optimizer_benchmark_time_and_memory(tmp_path):
    """benchmarks/optimizer.py on a tiny model: every arm is timed and measured in its own
    process, and the CSV holds the ratios (no value is asserted: times belong to benchmarks)."""
    arms = "adamw-foreach,adamw,slamb-core" + (",slamb-adapter" if _have_horovod() else "")
    out_csv = tmp_path / "optimizer.csv"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "optimizer.py"), "--layers", "2",
                           "--width", "256", "--reps", "3", "--steps", "2", "--arms", arms + ",onebit-core-p2",
                           "--out", str(out_csv)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out_csv)))
    for kind in ("memory", "time"):
        got = {r["arm"]: r for r in rows if r["kind"] == kind}
        # the 2-rank 1-bit LAMB arm is measured for memory only
        assert set(got) == set(arms.split(",")) | ({"onebit-core-p2"} if kind == "memory" else set()), (kind, got)
        assert float(got["adamw-foreach"]["ratio"]) == 1.0
        assert all(float(r["value"]) > 0 for r in got.values())
    assert all(r["params"] == str(2 * (256 * 256 + 256)) for r in rows)


# ---------------------------------------------------------------------------- collectives per step
@pytest.mark.parametrize("tensors", [30, 100])
def test_slamb_on_torch_distributed_makes_three_collectives_per_step(tensors):
    """benchmarks/collectives.py under torchrun: after the first step, 3 allreduces per step (the
    payloads fused into one, a flag, the agreement) on the plain path, under DDP's hook, and with
    clipping after backward(), whatever the number of tensors."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out = subprocess.run(["timeout", "240", torchrun, "--nproc_per_node", "2", "benchmarks/collectives.py",
                          "--tensors", str(tensors), "--steps", "5"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if "calls per step" in l]
    assert [l.split(":")[0] for l in lines] == ["plain", "ddp", "clip"], out.stdout
    for line in lines:
        per = [int(v) for v in line.split("[")[1].rstrip("]").split(",")]
        assert per[1:] == [3] * 4, line


def test_ddp_step_benchmark_times_every_arm_against_stock_ddp(tmp_path):
    """benchmarks/ddp_step.py under torchrun (a tiny model, one repeat): a row per arm, the
    baseline's ratio 1, the table printed. Nothing timed is asserted."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    csv_path = tmp_path / "ddp_step.csv"
    out = subprocess.run(["timeout", "240", torchrun, "--nproc_per_node", "2", "benchmarks/ddp_step.py",
                          "--repeats", "1", "--steps", "2", "--warmup", "1", "--d-model", "32",
                          "--out", str(csv_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(csv_path)))
    assert [r["arm"] for r in rows] == ["ddp_lamb", "ddp_adamw", "hook_fp32", "hook_fp16", "hook_flat"]
    assert float(rows[0]["ratio_to_ddp_lamb"]) == 1.0 and all(float(r["step_ms"]) > 0 for r in rows)
    assert "| hook_fp16 |" in out.stdout


@pytest.mark.parametrize("framework", ["lightning", "trainer"])
def test_integrations_benchmark_runs_every_arm(framework, tmp_path):
    """benchmarks/integrations.py under torchrun (one repeat of 3 steps): a row per arm, the
    compressed arms' bytes under the dense ones. Nothing timed is asserted."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    csv_path = tmp_path / "integrations.csv"
    out = subprocess.run(["timeout", "240", torchrun, "--nproc_per_node", "2", "benchmarks/integrations.py",
                          "--framework", framework, "--repeats", "1", "--steps", "3", "--warmup", "1",
                          "--tmp", str(tmp_path), "--out", str(csv_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(csv_path)))
    assert [r["arm"] for r in rows] == ["dense", "slamb", "topk"]
    assert all(0 < int(r["payload_bytes"]) < int(r["dense_bytes"]) for r in rows[1:])


# ---------------------------------------------------------------------------- peers (issue 27)
def test_peers_benchmark_table_with_an_allreduce_and_an_allgather_method(tmp_path):
    """benchmarks/peers.py at 2 ranks, 4 steps, one lr each, 8 sequences per rank (``--batch``,
    issue 45): dense AdamW (the baseline) and DeMo (an all-gather, whose wire grows with P): the
    CSV, its batch column and the runs' names, the table and the cost model's wire."""
    out_dir = tmp_path / "peers"
    proc = subprocess.run([sys.executable, "benchmarks/peers.py", "--methods", "adamw,demo", "--ranks", "2",
                           "--steps", "4", "--eval-every", "2", "--seeds", "0", "--grid-size", "1", "--batch", "8",
                           "--timeout", "240", "--out", str(out_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out_dir / "runs.csv")))
    assert sorted({r["method"] for r in rows}) == ["adamw", "demo"]
    # --batch reaches the workers' rows and names the runs (only when it is not the example's 16)
    assert {r["batch"] for r in rows} == {"8"}
    assert sorted(os.listdir(out_dir / "runs")) == ["adamw_0_002_seed0_batch8.csv", "adamw_0_002_seed0_batch8.csv.log",
                                                    "demo_0_001_seed0_batch8.csv", "demo_0_001_seed0_batch8.csv.log"]
    assert "--batch 8" in (out_dir / "peers.md").read_text()
    last = {r["method"]: r for r in rows if r["step"] == "4"}
    assert float(last["adamw"]["payload_vs_dense"]) == 1.0
    assert 0 < float(last["demo"]["payload_vs_dense"]) < 0.1
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in (out_dir / "peers.md").read_text().splitlines() if line.startswith("| adamw") or
             line.startswith("| demo")}
    demo = table["demo"]  # lr, loss, vs AdamW, payload, wire P=4, 64, 1024, ...
    pay, w4, w1024 = (float(demo[i].rstrip("%")) for i in (3, 4, 6))
    # an all-gather's wire per rank is (P - 1) payloads, a ring allreduce's 2 (P - 1) / P: P / 2 times
    # the payload's share; the table's payload is rounded to 0.01 points
    assert w4 == pytest.approx(pay * 4 / 2, abs=0.011)
    assert w1024 == pytest.approx(pay * 1024 / 2, abs=0.005 * 512 + 0.01)
    assert table["adamw"][6] == "100.00%"


def test_peers_benchmark_sparseloco_arms(tmp_path):
    """benchmarks/peers.py's SparseLoCo arms (issue 36) at 2 ranks, 4 steps, outer steps every 2:
    the all-gathered SparseLoCo, the shared-mask variant's allreduce and the shared top-k's
    broadcast and allreduce, their bytes and wire."""
    out_dir = tmp_path / "peers"
    methods = "sparseloco@2@64,sparseloco-shared@2@0.25,sparseloco-sharedtopk@2@64"
    proc = subprocess.run([sys.executable, "benchmarks/peers.py", "--methods", methods, "--ranks", "2", "--steps", "4",
                           "--eval-every", "2", "--seeds", "0", "--lr-grid", "0.004", "--timeout", "240",
                           "--out", str(out_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out_dir / "runs.csv")))
    assert {r["batch"] for r in rows} == {"16"}  # the default batch, not in the runs' names
    assert not any("batch" in f for f in os.listdir(out_dir / "runs"))
    last = {r["method"]: r for r in rows if r["step"] == "4"}
    assert sorted(last) == ["sparseloco-shared@2@0.25", "sparseloco-sharedtopk@2@64", "sparseloco@2@64"]
    n = int(last["sparseloco@2@64"]["params"])
    # two outer steps of ChunkTopK(N, 4096, 64, 2).nbytes each, against four dense float32 steps
    K = (n // 4096) * 64 + -(-64 * (n % 4096) // 4096)
    nbytes = 8 + -(-4 * -(-n // 4096) // 8) * 8 + -(-(-(-K * 14 // 8)) // 8) * 8
    assert float(last["sparseloco@2@64"]["payload_bytes"]) == 2 * nbytes
    # the shared top-k: the leader's K offsets of 12 bits behind an 8-byte header, K + 1 float16 values
    shared = 8 + -(-(-(-K * 12 // 8)) // 8) * 8 + (K + 1) * 2
    assert float(last["sparseloco-sharedtopk@2@64"]["payload_bytes"]) == 2 * shared
    assert 0 < float(last["sparseloco-shared@2@0.25"]["payload_vs_dense"]) < 0.1
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in (out_dir / "peers.md").read_text().splitlines() if line.startswith("| sparseloco")}
    for m, ratio in (("sparseloco@2@64", 4 / 2), ("sparseloco-shared@2@0.25", 1.0),
                     ("sparseloco-sharedtopk@2@64", (12 + 16 * 1.5) / 28 / 1.5)):
        pay, w4 = (float(table[m][i].rstrip("%")) for i in (3, 4))  # an all-gather's wire is P/2 payloads
        assert w4 == pytest.approx(pay * ratio, abs=0.011)
    # --reuse: the runs of a runs.csv count as done; the same table comes back with nothing launched
    again = subprocess.run([sys.executable, "benchmarks/peers.py", "--methods", methods, "--ranks", "2", "--steps", "4",
                            "--eval-every", "2", "--seeds", "0", "--lr-grid", "0.004", "--reuse",
                            str(out_dir / "runs.csv"), "--out", str(tmp_path / "again")], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and "[peers]" not in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert (tmp_path / "again" / "peers.md").read_text() == (out_dir / "peers.md").read_text()


# ---------------------------------------------------------------------------- lr table (issue 37)
def test_lr_table_quick_writes_csv_and_table(tmp_path):
    """benchmarks/lr_table.py --quick: one torchrun launch at 2 ranks, both models, one lr per
    method, 3 steps; a CSV row per run with SLAMB's step-1 and step-2 payload, and the table."""
    out_dir = tmp_path / "lr"
    proc = subprocess.run([sys.executable, "benchmarks/lr_table.py", "--quick", "--timeout", "240", "--out",
                           str(out_dir)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out_dir / "lr_table.csv")))
    assert sorted((r["model"], r["method"]) for r in rows) == sorted(
        (m, k) for m in ("gpt2", "lm") for k in ("adamw", "lamb", "slamb"))
    assert {int(r["params"]) for r in rows if r["model"] == "gpt2"} == {120576}
    assert all(r["ranks"] == "2" and r["steps"] == "3" and 0 < float(r["val_loss"]) < 6 for r in rows)
    gpt2 = next(r for r in rows if r["model"] == "gpt2" and r["method"] == "slamb")
    # ratio 0.1 on the tiny GPT-2: 0.205 of dense (its 4,096-element tensors go whole); step 1 adds the sync
    assert abs(float(gpt2["payload_step2"]) - 0.2053) < 0.001
    assert abs(float(gpt2["payload_step1"]) - 1 - float(gpt2["payload_step2"])) < 0.001
    table = (out_dir / "lr_table.md").read_text()
    assert "| lr | adamw | lamb | slamb |" in table and "**gpt2** (120,576 parameters)" in table
