"""CuPy / CUDA tests: the same exchanges on NumPy and CuPy inputs give the same results.

Skipped, with the reason, where CuPy is not installed or no CUDA device is visible.
In the spirit of CuPy's ``numpy_cupy_allclose``: each test body runs once with ``xp =
numpy`` and once with ``xp = cupy``, and the two results are compared.
"""

import numpy as np
import pytest

import slamb_comm as sc

cp = pytest.importorskip("cupy", reason="CuPy is not installed: GPU tests skipped")


def _device_count():
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 -- no driver, no device: the same answer
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_device_count() == 0, reason="no CUDA device visible: GPU tests skipped"),
]

SHAPES = [(100, 120), (50,), (100, 120)]
TOTAL = 24050


def arrays(xp, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [xp.asarray(rng.standard_normal(s).astype(dtype)) for s in SHAPES]


def host_flat(arrs):
    return np.concatenate([sc.arrays.to_host(a).ravel() for a in arrs])


def run_exchanges(xp, transport_factory, mask, vdt, steps=4):
    """Run every exchange on xp arrays; return host copies of everything they produced."""
    comm = sc.Communicator(transport_factory(), arrays(xp, 0), ratio=0.1, mask=mask, value_dtype=vdt, seed=31)
    out = {"masked": [], "idx": [], "sparse": [], "residual": [], "sync": []}
    for step in range(1, steps + 1):
        x = arrays(xp, 100 + step)
        _, idx = comm.masked_allreduce(x if step % 2 else xp.concatenate([a.ravel() for a in x]), step)
        if step % 2:
            out["masked"].append(host_flat(x))
        out["idx"].append(np.sort(sc.arrays.to_host(idx)))
        g = arrays(xp, 200 + step)
        res = comm.sparse_allgather(g)
        out["sparse"].append(host_flat(res))
        out["residual"].append(sc.arrays.to_host(comm.residual).copy())
        s = arrays(xp, 300 + step)
        comm.sync(s)
        out["sync"].append(host_flat(s))
    out["payload"] = comm.stats.total.payload_bytes
    return out


def compare(a, b, rtol=1e-6, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        if k == "payload":
            assert a[k] == b[k]
            continue
        for x, y in zip(a[k], b[k]):
            if k == "idx":
                assert np.array_equal(x, y), k
            else:
                np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=k)


def _mpi_transport():
    return sc.MPITransport(cuda_aware=False)  # staging through host memory


@pytest.mark.parametrize("mask", ["cyclic", "bernoulli", "topk"])
@pytest.mark.parametrize("vdt", ["float32", "float16"])
def test_local_transport_numpy_vs_cupy(mask, vdt):
    a = run_exchanges(np, sc.LocalTransport, mask, vdt)
    b = run_exchanges(cp, sc.LocalTransport, mask, vdt)
    compare(a, b)


@pytest.mark.parametrize("mask", ["cyclic", "topk"])
def test_mpi_transport_staged_numpy_vs_cupy(mask):
    pytest.importorskip("mpi4py")
    a = run_exchanges(np, _mpi_transport, mask, "float32")
    b = run_exchanges(cp, _mpi_transport, mask, "float32")
    compare(a, b)


def test_residual_and_results_live_on_the_device():
    comm = sc.Communicator(None, arrays(cp, 0), ratio=0.1)
    g = arrays(cp, 1)
    res = comm.sparse_allgather(g)
    assert all(isinstance(r, cp.ndarray) for r in res)
    assert isinstance(comm.residual, cp.ndarray)
    x = arrays(cp, 2)
    _, idx = comm.masked_allreduce(x, 1)
    assert isinstance(idx, cp.ndarray)
    assert all(isinstance(a, cp.ndarray) for a in x)


def test_mixed_numpy_cupy_raises_type_error():
    comm = sc.Communicator(None, arrays(np, 0), ratio=0.1)
    mixed = [cp.asarray(np.zeros((100, 120), np.float32)), np.zeros(50, np.float32), np.zeros((100, 120), np.float32)]
    for op in (lambda x: comm.masked_allreduce(x, 1), comm.sparse_allgather, comm.sync):
        with pytest.raises(TypeError):
            op(mixed)
    with pytest.raises(TypeError):
        sc.arrays.namespace(np.zeros(3), cp.zeros(3))


def test_state_library_mismatch_raises_type_error():
    comm = sc.Communicator(None, arrays(np, 0), ratio=0.1)
    comm.sparse_allgather(arrays(np, 1))  # the residual now lives in NumPy
    with pytest.raises(TypeError):
        comm.sparse_allgather(cp.asarray(host_flat(arrays(np, 2))))


def test_non_finite_on_device_changes_nothing():
    comm = sc.Communicator(None, arrays(cp, 0), ratio=0.1)
    comm.sparse_allgather(arrays(cp, 1))
    res = comm.residual.copy()
    x = arrays(cp, 2)
    x[1][3] = cp.nan
    before = [a.copy() for a in x]
    for op in (lambda v: comm.masked_allreduce(v, 1), comm.sparse_allgather, comm.sync):
        with pytest.raises(sc.NonFiniteError):
            op(x)
        for a, b in zip(x, before):
            assert cp.array_equal(a, b, equal_nan=True)
        assert cp.array_equal(comm.residual, res)


def test_as_array_of_cuda_torch_tensor_is_cupy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA: cannot make a CUDA tensor")
    t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    a = sc.arrays.as_array(t)
    assert isinstance(a, cp.ndarray)
    assert a.data.ptr == t.data_ptr()  # zero copy
    a[0, 0] = 42
    torch.cuda.synchronize()
    assert t[0, 0].item() == 42
    # and a Communicator updates CUDA tensors in place
    ts = [torch.randn(100, 120, device="cuda"), torch.randn(50, device="cuda"), torch.randn(100, 120, device="cuda")]
    comm = sc.Communicator(None, ts, ratio=0.1, value_dtype="float16")
    ref = [x.clone() for x in ts]
    _, idx = comm.masked_allreduce(ts, 1)
    got = torch.cat([x.reshape(-1) for x in ts]).cpu().numpy()
    want = torch.cat([x.reshape(-1) for x in ref]).cpu().numpy()
    i = cp.asnumpy(idx).astype(np.int64)
    assert np.array_equal(got[i], want[i].astype(np.float16).astype(np.float32))


def test_nccl_transport_single_rank():
    pytest.importorskip("mpi4py")
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception:  # noqa: BLE001
        pytest.skip("CuPy was built without NCCL")
    a = run_exchanges(np, sc.LocalTransport, "cyclic", "float32", steps=2)
    b = run_exchanges(cp, sc.NCCLTransport, "cyclic", "float32", steps=2)
    compare(a, b)


def test_torch_slamb_on_cuda_flat_matches_cpu_tensor_by_tensor():
    """The torch SLAMB on CUDA parameters takes its default there, flat buffers (the core's
    whole-buffer step on CuPy views of the torch memory); on the CPU, tensor by tensor. Six steps
    on the same gradients, a periodic sync (H = 3) included, agree to float32 rounding, as
    amplified by Adam's division by sqrt(v): CuPy's kernels contract ``a * m + b * g`` into a
    fused multiply-add, so m differs by an ulp (measured on an H100: m within 1.2e-7, x within
    3e-5 after 6 steps of lr 0.02 on another layout; NumPy's two paths differ by 5e-7)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from slamb_comm.adapters.torch import SLAMB

    g = torch.Generator().manual_seed(0)
    shapes = [(100, 120), (50,), (64, 64)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(6)]

    def run(device, fused):
        ps = [torch.nn.Parameter(x.clone().to(device)) for x in init]
        opt = SLAMB(ps, lr=1e-2, ratio=0.25, dense_threshold=64, seed=3, fused=fused, sync_interval=3)
        for gs in grads:
            for p, gg in zip(ps, gs):
                p.grad = gg.to(device)
            opt.step()
        return opt, [p.detach().cpu() for p in ps]

    opt_gpu, gpu = run("cuda", None)
    assert all(e.flat is not None for e in opt_gpu.buckets)
    _, cpu = run("cpu", False)
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)  # the updates moved x by up to 6 * lr = 0.06
