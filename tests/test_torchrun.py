"""torch.distributed jobs launched as their users launch them: ``torchrun`` (through
tests/support/launch.py, with an outer timeout), CPU processes on gloo.

The exchanges themselves are compared with the dense references in
mpi_tests/test_torch_dist.py and mpi_tests/test_recipes.py; here: the DDP example runs and
reports its bytes, a resumed run in new processes is bitwise the uninterrupted one, the AMP
recipe with an inf on one rank under the real launcher, and a rank that raises ends the job.
"""

import time

import pytest

from tests.support.launch import torchrun  # noqa: E402

pytest.importorskip("torch")


@pytest.mark.parametrize("mode", ["slamb", "topk"])
def test_ddp_example_runs_and_reports_the_bytes_saved(mode):
    proc = torchrun(2, "examples/ddp_slamb.py", "--steps", "12", "--mode", mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    line = next(l for l in out.splitlines() if l.startswith("ranks 2: 12 steps"))
    saved = float(line.split("bytes, ")[1].split("%")[0])
    assert 30 < saved < 100, line  # sparse: well under DDP's dense allreduce even with the step-1 sync


RESUME = """
import sys, torch, torch.distributed as dist
from slamb_comm.adapters import torch as st
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
start, stop, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# another mask seed when resuming: the checkpoint's must win
opt = st.DistributedOptimizer(st.SLAMB(ddp.parameters(), lr=0.01, ratio=0.25, dense_threshold=100, sync_interval=4,
                                       seed=11 if start == 0 else 12), named_parameters=model.named_parameters())
ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
if start:
    saved = torch.load(f"{path}.{rank}")  # every rank its own state: SLAMB's moments are per rank
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
for t in range(start + 1, stop + 1):
    g = torch.Generator().manual_seed(1000 * t + rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.{rank}")
"""


def test_resume_in_new_processes_is_bitwise(tmp_path):
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    whole = torchrun(2, str(script), "0", "7", str(tmp_path / "a"))
    assert whole.returncode == 0, (whole.stdout + whole.stderr)[-3000:]
    first = torchrun(2, str(script), "0", "3", str(tmp_path / "b"))
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    second = torchrun(2, str(script), "3", "7", str(tmp_path / "b"))
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    import torch

    for rank in (0, 1):
        a = torch.load(tmp_path / f"a.{rank}")["model"]
        b = torch.load(tmp_path / f"b.{rank}")["model"]
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank}: the resumed run differs"


FAILING = """
import torch, torch.distributed as dist
from slamb_comm.adapters import torch as st
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = st.DistributedOptimizer(st.SLAMB(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
for t in range(1, 10000):
    if t == 3 and dist.get_rank() == 1:
        raise RuntimeError("failing on purpose")
    opt.zero_grad()
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
"""


def test_a_rank_that_raises_ends_the_job(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    t0 = time.monotonic()
    proc = torchrun(2, str(script), timeout=120)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124, 137), out[-3000:]  # failed, and not by the outer timeout
    assert "failing on purpose" in out, out[-3000:]
    assert elapsed < 90, f"the job took {elapsed:.0f} s to end"


AMP = """
import torch, torch.distributed as dist
from slamb_comm.adapters import torch as st
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()


def run(poison):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = st.DistributedOptimizer(st.SLAMB(ddp.parameters(), lr=0.01, ratio=0.25, dense_threshold=100),
                                  named_parameters=model.named_parameters())
    ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    for t in range(1, 7):
        if t == 2 and not poison:
            continue  # the reference: the same run without step 2
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        if t == 2 and rank == size - 1:
            x[0, 0] = float("inf")

        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(ddp(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), scales, int(opt.state[model[0].weight]["step"])


x, scales, steps = run(True)
ref, _, ref_steps = run(False)
everyone = [None] * size
dist.all_gather_object(everyone, (scales, steps))
assert all(s == everyone[0] for s in everyone), everyone
assert scales[1] == 512.0 and steps == ref_steps == 5, (scales, steps, ref_steps)
assert torch.equal(x, ref), (x - ref).abs().max()
print(f"rank {rank}: AMP OK, scales {scales}", flush=True)
"""


def test_amp_with_an_inf_on_one_rank_under_torchrun(tmp_path):
    """GradScaler, unscale_, clip_grad_norm_, DDP + slamb_hook, an inf in rank 1's input at step 2:
    every rank skips step 2 and halves its scale alike, and the run ends bitwise where the same
    run without step 2 does (the script asserts it on every rank); no teardown at the end."""
    script = tmp_path / "amp.py"
    script.write_text(AMP)
    proc = torchrun(2, str(script))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("AMP OK") == 2, out[-3000:]


RESTART = """
import os, signal, sys, torch, torch.distributed as dist
from slamb_comm.methods import checkpoint
from slamb_comm.adapters import torch as st
st.init_process_group("gloo")  # each restart rendezvouses afresh
rank, size = dist.get_rank(), dist.get_world_size()
steps, every, path, kill_at = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = st.DistributedOptimizer(st.SLAMB(ddp.parameters(), lr=0.01, ratio=0.25, dense_threshold=100, sync_interval=4),
                              named_parameters=model.named_parameters())
ddp.register_comm_hook(st.SlambHookState(opt), st.slamb_hook)
transport, ckpt, start = st.TorchTransport(), os.path.join(path, "ckpt"), 0
if os.path.exists(os.path.join(ckpt, "MANIFEST.json")):  # a restart, or another number of workers
    state = checkpoint.load(ckpt, transport)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]
    print(f"rank {rank}: resumed at step {start} on {size} ranks", flush=True)
for t in range(start + 1, steps + 1):
    if t == kill_at and rank == size - 1 and not os.path.exists(os.path.join(path, "killed")):
        open(os.path.join(path, "killed"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-run
    g = torch.Generator().manual_seed(1000 * t + rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    if t % every == 0:
        checkpoint.save(ckpt, {"model": model.state_dict(), "opt": opt.state_dict(), "step": t}, transport)
torch.save(model.state_dict(), os.path.join(path, f"final.{rank}"))
"""


def test_torchrun_restart_after_a_lost_worker_is_bitwise_and_resizes(tmp_path):
    """docs/algorithm.md section 10 under torchrun: ``--max-restarts=1``, one worker SIGKILLs itself
    at step 8; the job restarts from the step-6 checkpoint and ends bitwise equal to an
    uninterrupted run of 2 workers. The same checkpoint then resumes on 1 and on 3 workers
    (resized: the per-rank states averaged) and trains on."""
    import torch

    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    proc = torchrun(2, str(script), "10", "3", str(whole), "0", flags=("--max-restarts=1",))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    proc = torchrun(2, str(script), "10", "3", str(cut), "8", flags=("--max-restarts=1",))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert (cut / "killed").exists() and "resumed at step 6 on 2 ranks" in out, out[-3000:]
    for rank in (0, 1):
        a, b = torch.load(whole / f"final.{rank}"), torch.load(cut / f"final.{rank}")
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank}: the restarted run differs"
    for n in (1, 3):  # the step-9 checkpoint on another number of workers
        run = tmp_path / f"on{n}"
        run.mkdir()
        import shutil

        shutil.copytree(cut / "ckpt", run / "ckpt")
        proc = torchrun(n, str(script), "13", "3", str(run), "0")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert f"resumed at step 9 on {n} ranks" in out, out[-3000:]
        finals = [torch.load(run / f"final.{r}") for r in range(n)]
        assert all(torch.isfinite(v).all() for f in finals for v in f.values())
        # the last step, 13, is a periodic sync (H = 4): the new replicas agree
        assert all(torch.equal(finals[0][k], f[k]) for f in finals for k in f), f"{n} workers differ after the sync"
