# mpirun -np 4 python examples/numpy_slamb.py
# (as root on a 2-core machine: bash scripts/mpirun.sh 4 600 python3 examples/numpy_slamb.py)
"""Train a NumPy MLP on scikit-learn's bundled digits with SLAMB over MPI -- no torch.

Every rank holds a replica of the model in one fused float32 buffer; each step it
computes the gradient of its own shard of the global batch and hands it to
:class:`slamb_comm.methods.slamb.SlambRule`, which exchanges a shared random tenth of the momentum
(one masked allreduce), keeps the rest locally, and averages the parameters every H
steps. Rank 0 prints loss, validation accuracy and bytes moved against dense LAMB.

``--ratio 1`` is LAMB driven by the mean gradient: the dense baseline.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

import slamb_comm as sc
from slamb_comm.methods.slamb import SlambRule

SIZES = [64, 512, 256, 10]


def load_digits_split(seed=0):
    """scikit-learn's digits (1,797 8x8 images, shipped with the package): train/val split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(y))
    x, y = x[perm], y[perm]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def init_params(seed=0):
    """Shapes and initial values of W1, b1, W2, b2, W3, b3 (the same on every rank)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        arrays.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32))
        arrays.append(np.zeros(fan_out, np.float32))
    return arrays


def forward_backward(params, x, y):
    """Cross-entropy loss and its gradients for a ReLU MLP (params: W1, b1, W2, b2, ...)."""
    acts = [x]
    h = x
    n_layers = len(params) // 2
    for i in range(n_layers):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < n_layers - 1:
            h = np.maximum(h, 0)
        acts.append(h)
    logits = acts[-1]
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    grads = [None] * len(params)
    d = p
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    for i in reversed(range(n_layers)):
        grads[2 * i] = acts[i].T @ d
        grads[2 * i + 1] = d.sum(axis=0)
        if i > 0:
            d = (d @ params[2 * i].T) * (acts[i] > 0)
    return loss, grads


def evaluate(params, x, y):
    loss, _ = forward_backward(params, x, y)
    h = x
    for i in range(len(params) // 2):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < len(params) // 2 - 1:
            h = np.maximum(h, 0)
    return loss, float((h.argmax(axis=1) == y).mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--beta3", type=float, default=0.9)
    ap.add_argument("--sync-interval", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--mask", default="cyclic", choices=["cyclic", "bernoulli", "topk"])
    ap.add_argument("--block", type=int, default=1, help="cyclic mask: runs of this many contiguous elements")
    ap.add_argument("--value-dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    P, me = world.size, world.rank
    if args.global_batch % P:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {P} ranks")
    (xtr, ytr), (xva, yva) = load_digits_split(args.seed)

    init = init_params(args.seed)
    layout = sc.Layout.from_arrays(init, names=["W1", "b1", "W2", "b2", "W3", "b3"])
    flat = np.concatenate([a.ravel() for a in init])  # the model lives in one fused buffer
    params = layout.views(flat)
    comm = sc.Communicator(sc.MPITransport(), layout, ratio=args.ratio, mask=args.mask, block=args.block,
                           value_dtype=args.value_dtype, seed=args.seed)
    opt = SlambRule(comm, lr=args.lr, weight_decay=args.weight_decay, beta3=args.beta3,
                sync_interval=args.sync_interval)
    gflat = np.empty_like(flat)
    gviews = layout.views(gflat)

    per_rank = args.global_batch // P
    dense_step = layout.total * layout.dtype.itemsize  # dense LAMB's fp32 allreduce of every gradient
    rng = np.random.default_rng(args.seed + 1)  # the same on every rank: shared batch order
    t0 = time.perf_counter()
    if me == 0:
        print(f"SLAMB on digits: {P} ranks, {layout.total} parameters ({sum(layout.dense)} of "
              f"{len(layout)} tensors always dense), ratio {args.ratio}, {args.value_dtype} payload, "
              f"beta3 {args.beta3}, H {args.sync_interval}, lr {args.lr}", flush=True)
    for t in range(1, args.steps + 1):
        batch = rng.choice(len(ytr), size=args.global_batch, replace=False)
        mine = batch[me * per_rank:(me + 1) * per_rank]
        loss, grads = forward_backward(params, xtr[mine], ytr[mine])
        for gv, g in zip(gviews, grads):
            gv[...] = g
        comm.stats.new_step()
        opt.step(flat, gflat)
        step_bytes = comm.stats.step
        if me == 0 and (t % args.log_every == 0 or t == 1):
            # against dense LAMB's one fp32 allreduce per step (a step that also syncs the parameters: 2 exchanges)
            print(f"step {t:4d}  loss {loss:.4f}  sent {step_bytes.payload_bytes} B, "
                  f"{step_bytes.payload_bytes / dense_step:.3f} of dense", flush=True)
    comm.sync(flat)  # average the replicas for evaluation
    val_loss, val_acc = evaluate(params, xva, yva)
    total = comm.stats.total
    if me == 0:
        print(f"done in {time.perf_counter() - t0:.1f} s: validation loss {val_loss:.4f}, accuracy {val_acc:.1%}")
        # Dense LAMB: one fp32 allreduce of every parameter per step, and no periodic sync.
        dense = args.steps * dense_step
        print(f"bytes handed to MPI per rank over {args.steps} steps: SLAMB {total.payload_bytes / 1e6:.2f} MB, "
              f"dense LAMB {dense / 1e6:.2f} MB -> {total.payload_bytes / dense:.1%} of dense "
              f"(momentum {comm.stats.by_kind['masked_allreduce'].payload_bytes / 1e6:.2f} MB, "
              f"periodic sync {comm.stats.by_kind.get('sync', sc.Traffic()).payload_bytes / 1e6:.2f} MB)")
    return val_loss, val_acc, total


if __name__ == "__main__":
    main()
