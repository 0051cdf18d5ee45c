"""Jobs for tests/test_fsdp_topk_diloco.py: HybridTopK, DiLoCo and DesLoc on a model sharded by FSDP2,
under torchrun (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m tests.support.fsdp_topk_job topk+diloco 2 2 OUT_DIR

Modes (joined by '+', run in one launch), on an R x S mesh ("replicate", "shard"), the model sharded
by ``fully_shard(module, mesh=mesh["shard"])``, rank (r, s) training on its own batches (FSDP2
averages the gradient over the S ranks of replica r, its reduce-scatter):

* ``topk``: HybridTopK around SGD (momentum; TopK(0.25, dense_threshold=90), float32 values) and
  around AdamW (TopK(0.3), float64 values). Every rank runs alongside the dense float64 reference
  written out below: top-k with error feedback at R ranks *taken per piece* (each whole tensor cut
  into FSDP2's S row blocks, one error buffer per replica and piece, the always-dense rule on the
  whole shapes), the mean over the R replicas, then SGD / AdamW on the whole model; each replica's
  gradient is computed in float64 by autograd on a plain copy of the model (the mean over its S
  ranks' batches). Each rank compares its pieces with the reference at every step.
* ``diloco``: DiLoCo(AdamW, mesh=mesh, sync_interval=3) against DiLoCo written out at R ranks
  (R AdamW replicas, the Nesterov outer step every 3 steps).
* ``desloc``: DesLoc(AdamW, mesh=mesh, 2, 3, 4) against x, m, v averaged over the R replicas on
  their periods.
* ``nonfinite``: a NaN in one rank's gradient piece: every rank of the mesh skips the step (or
  raises NonFiniteError under on_nonfinite='raise'), nothing changed.
* ``errors``: the setups that are refused, with their messages.

Each rank writes ``OUT_DIR/<mode>.<rank>.json``.
"""

import math
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import slamb_comm
from slamb_comm.errors import ConfigError, NonFiniteError
from slamb_comm.adapters import torch as st
from slamb_comm.adapters.torch.fsdp.hybrid_topk import HybridTopK

from .adamw_reference import Adam  # AdamW in float64, written out as torch computes it
# the model (at S = 2 its 33-, 5- and 3-row weights are cut unevenly), its batches, its loss, its sharding
from .fsdp_job import batch, loss_of, make_model, serve, shard

torch.set_num_threads(1)
STEPS = 8
ADAMW = dict(lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)



def setup(R, S):
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    return mesh, mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()


# ---------------------------------------------------------------------------------------- the references
def bounds(shape, S):
    """FSDP2's Shard(0) pieces of a tensor of ``shape`` as element ranges of its row-major elements."""
    n0 = shape[0] if shape else 1
    c, inner = -(-n0 // S), math.prod(shape[1:])
    return [(min(s * c, n0) * inner, min((s + 1) * c, n0) * inner) for s in range(S)]


def grads_at(plain, xs, t, r, S):
    """Replica r's gradient at ``xs`` (whole float64 arrays): the mean over its S ranks' batches."""
    with torch.no_grad():
        for p, a in zip(plain.parameters(), xs):
            p.copy_(torch.from_numpy(a))
    plain.zero_grad()
    for s in range(S):
        (loss_of(plain, *batch(t, r, s)) / S).backward()
    return [p.grad.numpy().copy() for p in plain.parameters()]


class TopKPerPiece:
    """Top-k with error feedback at R ranks (docs/algorithm.md sections 2 and 15.1), each whole tensor
    cut into its S pieces: per replica r and piece, ``c = g_r + e_r``; the ``max(1, round(ratio n))``
    largest |c| of the piece (ties to the lower index; the whole piece where the always-dense rule,
    read on the whole shape, applies), cast to the wire's dtype; ``e_r = c - sent``; the result is
    the sum over r of what was sent, times 1/R."""

    def __init__(self, shapes, R, S, ratio, value_dtype, dense_threshold=None):
        self.shapes, self.R, self.S, self.ratio = shapes, R, S, ratio
        self.vdt, self.T = np.dtype(value_dtype), dense_threshold
        self.e = [[np.zeros(math.prod(sh)) for sh in shapes] for _ in range(R)]

    def mean(self, grads):
        out = [np.zeros(math.prod(sh)) for sh in self.shapes]
        for r in range(self.R):
            for i, sh in enumerate(self.shapes):
                g, e = grads[r][i].reshape(-1), self.e[r][i]
                dense = self.T is not None and (len(sh) <= 1 or math.prod(sh) < self.T)
                for a, b in bounds(sh, self.S):
                    n = b - a
                    if not n:
                        continue
                    c = g[a:b] + e[a:b]
                    k = n if dense else max(1, min(n, int(round(self.ratio * n))))
                    idx = np.sort(np.argsort(-np.abs(c), kind="stable")[:k])
                    sent = c[idx].astype(self.vdt).astype(np.float64)
                    e[a:b] = c
                    e[a + idx] -= sent
                    out[i][a + idx] += sent
        if self.R > 1:
            out = [o * (1.0 / self.R) for o in out]
        return [o.reshape(sh) for o, sh in zip(out, self.shapes)]


class SGD:
    """torch.optim.SGD(momentum=mu) written out: buf = g at the first step, then mu buf + g; x -= lr buf."""

    def __init__(self, xs, lr, momentum):
        self.lr, self.mu, self.buf = lr, momentum, None

    def step(self, xs, gs):
        if self.buf is None:
            self.buf = [g.copy() for g in gs]
        else:
            for b, g in zip(self.buf, gs):
                b *= self.mu
                b += g
        for x, b in zip(xs, self.buf):
            x -= self.lr * b


def adam_ref(xs):
    return Adam(xs, lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], wd=ADAMW["weight_decay"])


def adamw(model):
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def piece_error(model, want, S, s):
    """max over tensors of max |this rank's piece - the reference's rows| / max |reference tensor|."""
    err = 0.0
    for p, w in zip(model.parameters(), want):
        mine = p.to_local().detach().numpy().reshape(-1)
        a, b = bounds(tuple(p.shape), S)[s]
        assert mine.size == b - a
        if mine.size:
            err = max(err, float(np.max(np.abs(mine - w.reshape(-1)[a:b])) / np.max(np.abs(w))))
    return err


# ---------------------------------------------------------------------------------------- the modes
def topk(R, S):
    mesh, r, s = setup(R, S)
    out = {"rank": dist.get_rank(), "r": r, "s": s}
    cases = {
        "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                slamb_comm.TopK(0.25, dense_threshold=90), lambda xs: SGD(xs, 0.05, 0.9), ("float32", 90)),
        "adamw": (adamw, slamb_comm.TopK(0.3, value_dtype="float64"), adam_ref, ("float64", None)),
    }
    for name, (inner, comp, ref_opt, (vdt, T)) in cases.items():
        model = shard(make_model(), mesh["shard"])
        opt = HybridTopK(inner(model), mesh, compression=comp, named_parameters=model.named_parameters())
        plain = make_model()
        x = [p.detach().numpy().copy() for p in plain.parameters()]
        ref, step = TopKPerPiece([a.shape for a in x], R, S, comp.ratio, vdt, T), ref_opt(x)
        worst, traffic = [], []
        for t in range(1, STEPS + 1):
            opt.zero_grad()
            loss_of(model, *batch(t, r, s)).backward()
            opt.step()
            step.step(x, ref.mean([grads_at(plain, x, t, q, S) for q in range(R)]))
            worst.append(piece_error(model, x, S, s))
            tr = opt.step_traffic()
            traffic.append([tr.payload_bytes, tr.dense_payload_bytes])
        out[name] = {"worst": worst, "traffic": traffic, "skipped": opt.skipped_steps}
    return out


def diloco(R, S, H=3, outer_lr=0.7, mu=0.9):
    mesh, r, s = setup(R, S)
    model = shard(make_model(), mesh["shard"])
    opt = st.DiLoCo(adamw(model), mesh=mesh, sync_interval=H, outer_lr=outer_lr, outer_momentum=mu, value_dtype=None)
    plain = make_model()
    x0 = [p.detach().numpy().copy() for p in plain.parameters()]
    xs = [[a.copy() for a in x0] for _ in range(R)]
    inner = [adam_ref(xs[q]) for q in range(R)]
    anchor, momentum = [a.copy() for a in x0], [np.zeros_like(a) for a in x0]
    worst = []
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(model, *batch(t, r, s)).backward()
        opt.step()
        for q in range(R):
            inner[q].step(xs[q], grads_at(plain, xs[q], t, q, S))
        if t % H == 0:  # DiLoCo's outer step, docs/algorithm.md section 12.1
            for i in range(len(anchor)):
                delta = sum(anchor[i] - xs[q][i] for q in range(R)) / R
                momentum[i] = mu * momentum[i] + delta
                anchor[i] = anchor[i] - outer_lr * (delta + mu * momentum[i])
                for q in range(R):
                    xs[q][i][...] = anchor[i]
        worst.append(piece_error(model, xs[r], S, s))
    return {"rank": dist.get_rank(), "worst": worst, "outer_steps": STEPS // H}


def desloc(R, S, Kx=2, Ku=3, Kv=4):
    mesh, r, s = setup(R, S)
    model = shard(make_model(), mesh["shard"])
    opt = st.DesLoc(adamw(model), mesh=mesh, sync_interval=Kx, moment1_interval=Ku, moment2_interval=Kv)
    plain = make_model()
    x0 = [p.detach().numpy().copy() for p in plain.parameters()]
    xs = [[a.copy() for a in x0] for _ in range(R)]
    inner = [adam_ref(xs[q]) for q in range(R)]
    worst = []
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(model, *batch(t, r, s)).backward()
        opt.step()
        for q in range(R):
            inner[q].step(xs[q], grads_at(plain, xs[q], t, q, S))
        for due, get in ((Kx, lambda q: xs[q]), (Ku, lambda q: inner[q].m), (Kv, lambda q: inner[q].v)):
            if t % due == 0:  # section 12.2: a plain mean over the replicas
                for i in range(len(x0)):
                    mean = sum(get(q)[i] for q in range(R)) / R
                    for q in range(R):
                        get(q)[i][...] = mean
        worst.append(piece_error(model, xs[r], S, s))
        # the moments too, piece by piece
        for p, m, v in zip(model.parameters(), inner[r].m, inner[r].v):
            state = opt.optimizer.state[p]
            worst[-1] = max(worst[-1], piece_error_of(state["exp_avg"], m, S, s),
                            piece_error_of(state["exp_avg_sq"], v, S, s))
    return {"rank": dist.get_rank(), "worst": worst}


def piece_error_of(dt, want, S, s):
    mine = dt.to_local().detach().numpy().reshape(-1)
    a, b = bounds(tuple(dt.shape), S)[s]
    scale = np.max(np.abs(want))
    return float(np.max(np.abs(mine - want.reshape(-1)[a:b])) / scale) if mine.size and scale else 0.0


def nonfinite(R, S):
    """A NaN in the first parameter's gradient piece of rank (R - 1, 0) at step 2."""
    mesh, r, s = setup(R, S)
    out = {"rank": dist.get_rank()}
    for mode in ("skip", "raise"):
        model = shard(make_model(), mesh["shard"])
        opt = HybridTopK(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), mesh,
                         compression=slamb_comm.TopK(0.25, on_nonfinite=mode))
        res = {}
        for t in (1, 2, 3):
            opt.zero_grad()
            loss_of(model, *batch(t, r, s)).backward()
            if t == 2 and (r, s) == (R - 1, 0):
                first = next(iter(model.parameters()))
                first.grad.to_local().view(-1)[0] = float("nan")
            before = [p.to_local().detach().clone() for p in model.parameters()]
            errs = [None if c.residual is None else c.residual.copy() for c in opt.communicators]
            try:
                opt.step()
                res[t] = "ok"
            except NonFiniteError as e:
                res[t] = "NonFiniteError: " + str(e)
            res[f"{t}.unchanged"] = (all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
                                     and all(_same(e, c.residual) for e, c in zip(errs, opt.communicators)))
            if t == 1:
                continue
            if t == 2:
                res["nan_grads"] = all(bool(torch.isnan(p.grad.to_local()).all()) for p in model.parameters()) \
                    if mode == "skip" else None
        res["skipped"] = opt.skipped_steps
        out[mode] = res
    return out


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def errors(R, S):
    mesh, _, _ = setup(R, S)
    flat = init_device_mesh("cpu", (R * S,), mesh_dim_names=("shard",))
    out = {}

    def refused(key, build):
        try:
            build()
        except ConfigError as e:
            out[key] = str(e)
        else:
            out[key] = None

    refused("topk_pure_fsdp", lambda: HybridTopK(adamw(shard(make_model(), flat)), flat))
    refused("topk_whole_mesh", lambda: HybridTopK(adamw(shard(make_model(), mesh)), mesh))
    refused("topk_unsharded", lambda: HybridTopK(adamw(make_model()), mesh))
    refused("topk_not_topk", lambda: HybridTopK(adamw(shard(make_model(), mesh["shard"])), mesh, compression=0.1))
    refused("diloco_pure_fsdp", lambda: st.DiLoCo(adamw(shard(make_model(), flat)), mesh=flat))
    refused("diloco_no_mesh", lambda: st.DiLoCo(adamw(shard(make_model(), mesh["shard"]))))
    refused("diloco_both", lambda: st.DiLoCo(adamw(shard(make_model(), mesh["shard"])), dist.group.WORLD, mesh=mesh))
    refused("desloc_whole_mesh", lambda: st.DesLoc(adamw(shard(make_model(), mesh)), mesh=mesh))
    return out


def main():
    mode, R, S, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    run = {"topk": topk, "diloco": diloco, "desloc": desloc, "nonfinite": nonfinite, "errors": errors}
    serve(mode, out_dir, lambda m: run[m](R, S))


if __name__ == "__main__":
    main()
