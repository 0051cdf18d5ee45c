"""DeMo over MPI (the core, MPITransport) and over a gloo group (the torch adapter), against the
dense float64 reference of docs/algorithm.md section 13 written out below, at every step:

    bash scripts/mpirun.sh N 300 python3 -m pytest -q --with-mpi mpi_tests/test_demo.py   (N = 1, 2, 4)

Every rank starts from the same parameters and gets gradients of its own; the reference keeps
every rank's momentum, so it knows what each rank sends. After each step the replicas must be
bitwise equal (every rank applies the sign of the same decoded mean).
"""


import numpy as np
import pytest
from mpi4py import MPI

import slamb_comm as sc
from slamb_comm.methods.demo import DeMo

pytestmark = pytest.mark.mpi

SHAPES = [(20, 13), (7,), (3, 4, 5), (16, 16), (), (9, 1)]
S, K, LR, BETA, WD = 8, 5, 0.01, 0.9, 0.05


from tests.support.demo_reference import RefDeMo  # noqa: E402  (the dense float64 reference)


def reference(x, P, lr, wd, vdtype):
    return RefDeMo(x, P, lr, BETA, wd, S, K, vdtype)


def start_params(dtype=np.float64):
    rng = np.random.default_rng(2024)  # the same on every rank
    return [np.asarray(rng.standard_normal(s), dtype) for s in SHAPES]


def rank_grads(r, t, x):
    """Rank r's gradient at step t: depends on the parameters and on (r, t)."""
    rng = np.random.default_rng([17, r, t])
    return [np.asarray(0.3 * a + rng.standard_normal(a.shape)) for a in x]


def same_everywhere(flat):
    everyone = MPI.COMM_WORLD.allgather(flat)
    return all(np.array_equal(e, everyone[0]) for e in everyone)


# ----------------------------------------------------------------------------- the core over MPI
@pytest.mark.parametrize("vd", ["float64", "float32", "float16"])
@pytest.mark.parametrize("fused", [False, True])
def test_core_rule_matches_the_reference_every_step(vd, fused):
    world = MPI.COMM_WORLD
    P, me = world.size, world.rank
    x = start_params()
    opt = DeMo(sc.MPITransport(), x, lr=LR, beta=BETA, weight_decay=WD, chunk=S, topk=K, value_dtype=vd)
    ref = reference(x, P, LR, WD, vd)
    flat = np.concatenate([a.ravel() for a in x])
    mine = opt.layout.views(flat) if fused else x
    for t in range(1, 11):
        g = [rank_grads(r, t, ref.x) for r in range(P)]
        assert opt.step(flat if fused else x, np.concatenate([a.ravel() for a in g[me]]) if fused else g[me])
        ref.step(g)
        for a, want in zip(mine, ref.x):
            np.testing.assert_allclose(a, want, rtol=0, atol=1e-12, err_msg=f"step {t}")
        np.testing.assert_allclose(opt.m[:-1], np.concatenate([a.ravel() for a in ref.m[me]]), rtol=0, atol=1e-12)
        assert same_everywhere(np.concatenate([a.ravel() for a in mine])), f"step {t}: replicas differ"
        tr = opt.stats.last
        assert tr.payload_bytes == opt.codec.nbytes and tr.wire_bytes == (P - 1) * opt.codec.nbytes


def test_core_non_finite_on_one_rank_skips_everywhere():
    world = MPI.COMM_WORLD
    P, me = world.size, world.rank
    x = start_params()
    opt = DeMo(sc.MPITransport(), x, lr=LR, chunk=S, topk=K)
    opt.step(x, rank_grads(me, 1, x))
    before, m = [a.copy() for a in x], opt.m.copy()
    g = rank_grads(me, 2, x)
    if me == P - 1:
        g[3][2, 2] = np.inf
    assert opt.step(x, g) is False
    assert opt.skipped_steps == 1 and opt.t == 1 and np.array_equal(opt.m, m)
    assert all(np.array_equal(a, b) for a, b in zip(x, before))
    assert opt.step(x, rank_grads(me, 3, x)) and opt.t == 2 and same_everywhere(np.concatenate([a.ravel() for a in x]))


def test_core_bad_input_on_one_rank_raises_everywhere():
    world = MPI.COMM_WORLD
    P, me = world.size, world.rank
    x = start_params()
    opt = DeMo(sc.MPITransport(), x, chunk=S, topk=K)
    g = rank_grads(me, 1, x)
    if me == P - 1:
        g = g[:-1]
    with pytest.raises(sc.LayoutError if me == P - 1 else sc.PeerError):
        opt.step(x, g)
    assert opt.t == 0 and (opt.m is None or not opt.m.any())  # nothing changed (m may exist, as zeros)
    other_k = K + (1 if me == P - 1 and P > 1 else 0)
    if P > 1:
        with pytest.raises(sc.LayoutMismatchError):
            DeMo(sc.MPITransport(), x, chunk=S, topk=other_k)


# ----------------------------------------------------------------------------- the torch adapter over gloo
@pytest.mark.parametrize("vd", ["float32", "float16"])
def test_torch_demo_matches_the_reference_every_step(gloo, vd):
    torch = pytest.importorskip("torch")
    from slamb_comm.adapters.torch import DeMo as TorchDeMo

    world = MPI.COMM_WORLD
    P, me = world.size, world.rank
    x = start_params()
    ps = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in x]
    opt = TorchDeMo([{"params": ps[:3], "lr": 0.02, "weight_decay": 0.1}, {"params": ps[3:]}], lr=LR, momentum=BETA,
                    chunk=S, topk=K, value_dtype=vd)
    refs = [reference(x[:3], P, 0.02, 0.1, vd), reference(x[3:], P, LR, 0.0, vd)]
    for t in range(1, 9):
        g = [rank_grads(r, t, refs[0].x + refs[1].x) for r in range(P)]
        for p, gi in zip(ps, g[me]):
            p.grad = torch.from_numpy(gi)
        opt.step()
        refs[0].step([gr[:3] for gr in g])
        refs[1].step([gr[3:] for gr in g])
        for p, want in zip(ps, refs[0].x + refs[1].x):
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=0, atol=1e-12, err_msg=f"step {t}")
        assert same_everywhere(torch.cat([p.detach().reshape(-1) for p in ps]).numpy()), f"step {t}: replicas differ"
        tr = opt.step_traffic()
        assert tr.calls == 1 and tr.wire_bytes == (P - 1) * tr.payload_bytes


def test_torch_float32_model_replicas_stay_equal(gloo):
    torch = pytest.importorskip("torch")
    from slamb_comm.adapters.torch import DeMo as TorchDeMo

    world = MPI.COMM_WORLD
    torch.manual_seed(0)  # the same model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    opt = TorchDeMo(net.parameters(), lr=1e-2, chunk=16, topk=8, weight_decay=0.01)
    gen = torch.Generator().manual_seed(100 + world.rank)  # each rank its own data
    for t in range(6):
        data = torch.randn(8, 24, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(data[0]), data[1]).backward()
        opt.step()
        assert same_everywhere(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()), f"step {t}"
    assert opt._core.t == 6
