"""A long SLAMB run: 10,000 steps, no memory growth, replicas bitwise equal after every sync.

Marked slow: `bash scripts/mpirun.sh 2 1200 python3 -m pytest -q --with-mpi -m slow mpi_tests/test_long_run.py`
(scripts/test.sh runs it too, once, at 2 ranks).
"""

import resource

import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from slamb_comm.methods.slamb import SlambRule


def rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


@pytest.mark.mpi
@pytest.mark.slow
def test_ten_thousand_steps_no_growth_and_bitwise_syncs():
    world = MPI.COMM_WORLD
    me = world.rank
    shapes = [(100, 120), (120,), (40, 50)]
    rng = np.random.default_rng(me)
    x = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    comm = sc.Communicator(sc.MPITransport(), x, ratio=0.1, value_dtype="float16", seed=1)
    opt = SlambRule(comm, lr=1e-3, weight_decay=0.01, beta3=0.9, sync_interval=100)
    target = [np.full(s, 0.5, np.float32) for s in shapes]
    grads = [np.empty(s, np.float32) for s in shapes]
    steps, syncs, mem = 10_000, 0, {}
    for t in range(1, steps + 1):
        for g, a, b in zip(grads, x, target):
            np.subtract(a, b, out=g)
            g += 0.1 * rng.standard_normal(g.shape).astype(np.float32)
        comm.stats.new_step()
        opt.step(x, grads)
        if (t - 1) % 100 == 0:
            flat = np.concatenate([a.ravel() for a in x])
            everyone = world.allgather(flat)
            assert all(np.array_equal(e, everyone[0]) for e in everyone), f"replicas differ after the sync of step {t}"
            syncs += 1
        if t in (1000, steps):
            mem[t] = rss_mb()
    assert syncs == 100
    assert opt.t == steps and opt.skipped_steps == 0
    growth = mem[steps] - mem[1000]
    print(f"rank {me}: RSS {mem[1000]:.1f} MB at step 1000, {mem[steps]:.1f} MB at step {steps} (+{growth:.2f} MB)")
    assert growth < 2.0, f"memory grew by {growth:.1f} MB between step 1000 and {steps}"
    # and it learned: the mean of the replicas is close to the target
    assert max(float(np.abs(a - b).mean()) for a, b in zip(x, target)) < 0.05
