"""Jobs for tests/test_fsdp.py: HybridSLAMB on a model sharded by FSDP2, under torchrun (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m tests.support.fsdp_job match 2 2 OUT_DIR
    python -m torch.distributed.run --standalone --nproc_per_node 4 -m tests.support.fsdp_job match+errors 2 2 OUT_DIR

``recipes``: GradScaler, an inf on one rank, clip_grad_norm_, accumulation, bf16 autocast, each
against the run it must equal; ``resume``: per-rank state saved and loaded; ``no_teardown``: a script that ends without tearing anything down.
``match R S``: an R x S mesh; each rank (replica r, piece s) trains on its own batches; FSDP2
averages the gradient over the S ranks of a replica (its reduce-scatter) and HybridSLAMB exchanges
the momentum across the R replicas. Every rank runs the dense float64 reference of SLAMB at R
ranks on the whole (unsharded) model alongside (tests/support/slamb_reference.py, with each replica's
gradient computed in float64 by autograd on a plain copy of the model), and compares its pieces
with the reference's at every step. ``errors``: the setups HybridSLAMB refuses. Each rank writes
``OUT_DIR/<mode>.<rank>.json``.
"""

import io
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from slamb_comm.wire.layout import Layout
from slamb_comm.errors import ConfigError
from slamb_comm.wire.masks import CyclicMask
from slamb_comm.adapters import torch as st

from .slamb_reference import ReferenceSlamb

torch.set_num_threads(1)
STEPS, RATIO, H, DENSE = 9, 0.25, 4, 90
OPTS = dict(lr=0.02, weight_decay=0.01, beta3=0.9)


def make_model():
    torch.manual_seed(0)
    # weights of 264, 165 and 99 elements are compressible (DENSE = 90); the biases are always dense;
    # at S = 2 the 33-, 5- and 3-row weights are cut unevenly (17/16, 3/2, 2/1 rows)
    return torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).double()


def batch(t, r, s):
    g = torch.Generator().manual_seed(1000 * t + 10 * r + s)
    return torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def shard(model, mesh):
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def reference_grads(ref, plain, t, r, S):
    """Replica r's gradient at the reference's parameters: the mean over its S ranks' batches."""
    with torch.no_grad():
        for p, a in zip(plain.parameters(), ref.x[r]):
            p.copy_(torch.from_numpy(a))
    plain.zero_grad()
    for s in range(S):
        (loss_of(plain, *batch(t, r, s)) / S).backward()
    return [p.grad.numpy().copy() for p in plain.parameters()]


def match(R, S, sadamw=False, fused=None, overlap=False):
    """HybridSLAMB (HybridSAdamW: the trust ratios fixed at 1) against the reference at R ranks."""
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    rank = dist.get_rank()
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    model = shard(make_model(), mesh["shard"])
    kind = st.HybridSAdamW if sadamw else st.HybridSLAMB
    opt = kind(model, mesh, ratio=RATIO, sync_interval=H, dense_threshold=DENSE, seed=3, eps=1e-6, fused=fused,
               overlap=overlap, **OPTS)
    plain = make_model()
    x0 = [p.detach().numpy().copy() for p in plain.parameters()]
    whole = Layout([a.shape for a in x0], "float64", dense_threshold=DENSE)
    bounds = dict(c_min=1.0, c_max=1.0) if sadamw else {}
    ref = ReferenceSlamb([x0] * R, whole.offsets, H=H, wd=OPTS["weight_decay"], lr=OPTS["lr"], beta3=OPTS["beta3"],
                         **bounds)
    mask = CyclicMask(whole, RATIO, 3)
    worst, traffic = [], []
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(model, *batch(t, r, s)).backward()
        opt.step()
        ref.step([reference_grads(ref, plain, t, q, S) for q in range(R)], mask.select(t).index.astype(np.int64))
        err = 0.0
        for p, want in zip(model.parameters(), ref.x[r]):
            mine = p.to_local().detach().numpy()
            piece = want.reshape(-1)[_start(p, S, s): _start(p, S, s) + mine.size]
            if mine.size:
                err = max(err, float(np.max(np.abs(mine.reshape(-1) - piece)) / np.max(np.abs(want))))
        worst.append(err)
        tr = opt.step_traffic()
        traffic.append([tr.payload_bytes, tr.dense_payload_bytes])
    control = opt.communicators[0].stats.by_kind["control"]
    return {"rank": rank, "r": r, "s": s, "worst": worst, "traffic": traffic, "steps": opt.steps_taken(),
            "control": [control.calls, control.payload_bytes]}


def _start(p, S, s):
    n0 = p.shape[0]
    c = -(-n0 // S)
    return min(s * c, n0) * int(np.prod(p.shape[1:]))


def errors(R, S):
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    out = {}

    def refused(key, build):
        try:
            build()
        except ConfigError as e:
            out[key] = str(e)
        else:
            out[key] = None

    refused("plain_slamb", lambda: st.SLAMB(shard(make_model(), mesh["shard"]).parameters()))
    refused("whole_mesh", lambda: st.HybridSLAMB(shard(make_model(), mesh), mesh))
    flat = init_device_mesh("cpu", (R * S,), mesh_dim_names=("shard",))
    refused("pure_fsdp", lambda: st.HybridSLAMB(shard(make_model(), flat), flat))
    refused("unsharded", lambda: st.HybridSLAMB(make_model(), mesh))
    refused("no_model", lambda: st.HybridSLAMB(shard(make_model(), mesh["shard"]).parameters(), mesh))
    return out


def float_run(mesh, seed=3):
    """A float32 model sharded over ``mesh["shard"]`` and its HybridSLAMB (mask seed ``seed``)."""
    model = shard(make_model().float(), mesh["shard"])
    return model, st.HybridSLAMB(model, mesh, ratio=RATIO, sync_interval=H, dense_threshold=DENSE, seed=seed, **OPTS)


def train(model, opt, steps, r, s):
    for t in steps:
        opt.zero_grad()
        loss_of(model, *(a.float() for a in batch(t, r, s))).backward()
        opt.step()


def recipes(R, S):
    """What users do between backward() and step(), each against the run it must equal."""
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    last = dist.get_rank() == dist.get_world_size() - 1

    def pieces(model):
        return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).clone()

    def loss_at(model, t, poison=False, part=None):
        x, y = (a.float() for a in batch(t, r, s))
        if part is not None:
            x, y = x[3 * part: 3 * part + 3], y[3 * part: 3 * part + 3]
        loss = loss_of(model, x, y)
        return loss * float("inf") if poison else loss

    def plain(model, opt, t, poison=False):
        opt.zero_grad()
        loss_at(model, t, poison).backward()
        opt.step()

    def scaled(model, opt, amp, t, poison=False, clip=None):
        opt.zero_grad()
        amp.scale(loss_at(model, t, poison)).backward()
        amp.unscale_(opt)
        norm = None if clip is None else float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        amp.step(opt)
        amp.update()
        return norm

    out = {}
    (ma, oa), (mb, ob) = float_run(mesh), float_run(mesh)
    amp = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for t in range(1, 6):
        plain(ma, oa, t)
        scaled(mb, ob, amp, t)
    out["scaler_bitwise"], out["scale"] = bool(torch.equal(pieces(ma), pieces(mb))), amp.get_scale()

    # an inf in the last rank's loss at step 3, under the scaler with unscale_ and clip_grad_norm_:
    # every rank skips and halves alike; the run equals the run without step 3
    (mc, oc), (md, od) = float_run(mesh), float_run(mesh)
    amp_c, amp_d, norms = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0), []
    for t in range(1, 6):
        norms.append(scaled(mc, oc, amp_c, t, poison=last and t == 3, clip=0.05))
        if t != 3:
            scaled(md, od, amp_d, t, clip=0.05)
            whole = sum(float((p.grad.full_tensor().double() ** 2).sum()) for p in md.parameters()) ** 0.5
            out.setdefault("clipped_norms", []).append(whole)
    out["inf_bitwise"] = bool(torch.equal(pieces(mc), pieces(md)))
    out["inf_scales"], out["inf_steps"] = [amp_c.get_scale(), amp_d.get_scale()], [oc.steps_taken(), od.steps_taken()]
    out["inf_norm_at_3"] = norms[2]

    # the same inf without a scaler: the optimizer skips the step on every rank
    (me_, oe) = float_run(mesh)
    for t in range(1, 5):
        plain(me_, oe, t, poison=last and t == 3)
    out["skipped"], out["steps_no_scaler"] = oe.skipped_steps, oe.steps_taken()

    # accumulation: two micro-batches, FSDP2's reduce-scatter only after the second, against one batch
    (mf, of), (mg, og) = float_run(mesh), float_run(mesh)
    for t in range(1, 5):
        of.zero_grad()
        for part in (0, 1):
            mf.set_requires_gradient_sync(part == 1)
            (loss_at(mf, t, part=part) / 2).backward()
        of.step()
        plain(mg, og, t)
    out["accumulation_diff"] = float((pieces(mf) - pieces(mg)).abs().max() / pieces(mg).abs().max())

    # bf16 autocast: it trains, and the periodic sync leaves the replicas equal
    mh, oh = float_run(mesh)
    losses = []
    for t in range(1, H + 2):
        oh.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_at(mh, t)
        loss.backward()
        oh.step()
        losses.append(float(loss.detach()))
    mine = pieces(mh)
    everyone = [torch.zeros_like(mine) for _ in range(R)]
    dist.all_gather(everyone, mine, group=mesh["replicate"].get_group())
    out["bf16_finite"] = all(np.isfinite(losses)) and bool(torch.isfinite(mine).all())
    out["bf16_replicas_equal"] = all(bool(torch.equal(e, everyone[0])) for e in everyone)
    return out


def resume(R, S):
    """Every rank saves its own pieces' model and optimizer state at step 3; a new model and optimizer
    (another mask seed: the checkpoint's must win) load them and go on: bitwise the uninterrupted run."""
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()

    (ma, oa), (mb, ob) = float_run(mesh, 3), float_run(mesh, 3)
    train(ma, oa, range(1, 8), r, s)
    train(mb, ob, range(1, 4), r, s)
    buf = io.BytesIO()  # what torch.save(..., f"ckpt.{rank}.pt") writes
    torch.save({"model": {n: p.to_local().detach() for n, p in mb.named_parameters()}, "opt": ob.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    mc, oc = float_run(mesh, 4)
    with torch.no_grad():
        for n, p in mc.named_parameters():
            p.to_local().copy_(saved["model"][n])
    oc.load_state_dict(saved["opt"])
    train(mc, oc, range(4, 8), r, s)
    same = all(torch.equal(a.to_local(), c.to_local()) for a, c in zip(ma.parameters(), mc.parameters()))
    return {"bitwise": bool(same), "steps": oc.steps_taken(), "seed": int(oc.communicators[0].seed)}


def dcp_resume(R, S, out_dir):
    """torch.distributed.checkpoint of the sharded model and of HybridSLAMB's per-replica state, saved right
    after a periodic sync (step 5 with H = 4: the replicas' parameters are equal then), loaded into a new
    model and optimizer (another mask seed): bitwise the uninterrupted run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()

    path = os.path.join(out_dir, "dcp")
    (ma, oa), (mb, ob) = float_run(mesh, 3), float_run(mesh, 3)
    train(ma, oa, range(1, 9), r, s)
    train(mb, ob, range(1, 6), r, s)
    dcp.save({"model": get_model_state_dict(mb), "optim": get_optimizer_state_dict(mb, ob)}, checkpoint_id=path)
    mc, oc = float_run(mesh, 4)
    sd = {"model": get_model_state_dict(mc), "optim": get_optimizer_state_dict(mc, oc)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(mc, sd["model"])
    set_optimizer_state_dict(mc, oc, sd["optim"])
    train(mc, oc, range(6, 9), r, s)
    same = all(torch.equal(a.to_local(), c.to_local()) for a, c in zip(ma.parameters(), mc.parameters()))
    m_same = all(torch.equal(oa.state[a]["exp_avg"], oc.state[c]["exp_avg"]) for a, c in zip(ma.parameters(),
                                                                                           mc.parameters()))
    return {"bitwise": bool(same and m_same), "steps": oc.steps_taken(), "seed": int(oc.communicators[0].seed)}


def no_teardown(R, S):
    """Trains two steps and returns: the script ends without destroy_process_group()."""
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    model = shard(make_model(), mesh["shard"])
    opt = st.HybridSLAMB(model, mesh, ratio=RATIO, dense_threshold=DENSE)
    for t in (1, 2):
        opt.zero_grad()
        loss_of(model, *batch(t, r, s)).backward()
        opt.step()
    return {"steps": opt.steps_taken()}


def match_device(R, S):
    """``match`` with the core's arrays on the strict CuPy double (tests/support/strict_cupy.py: device arrays
    sharing the torch tensors' memory, as CuPy's DLPack import of CUDA tensors does) and ``fused=True``:
    the pieces step by the device kernels, read in place through tables of addresses. Also returns
    the last step's device operations, host-to-device copies and host reads."""
    from . import strict_cupy

    with strict_cupy.install(), strict_cupy.torch_bridge():
        strict_cupy.Device.current = 0
        counted = {}
        real_step = st.HybridSLAMB.step

        def counting_step(self, closure=None):
            with strict_cupy.counting() as c:
                out = real_step(self, closure)
            counted.update(launches=c.launches, h2d=c.h2d, syncs=c.syncs)
            return out

        st.HybridSLAMB.step = counting_step
        try:
            result = match(R, S, fused=True)
        finally:
            st.HybridSLAMB.step = real_step
    return {**result, **counted}


JOBS = {"match": match, "match_sadamw": lambda R, S: match(R, S, sadamw=True), "errors": errors, "recipes": recipes,
        "resume": resume, "no_teardown": no_teardown, "match_device": match_device}
NEEDS_DIR = {"dcp": dcp_resume}


def serve(mode, out_dir, run, teardown=True):
    """The body of every FSDP2 test job under torchrun: for each of ``mode``'s "+"-joined modes
    ("match+errors": both in one launch), ``run(m)``'s result goes to ``out_dir/m.RANK.json``;
    then a barrier and the tear-down (not with ``teardown=False``: a script that exits without)."""
    dist.init_process_group("gloo")
    for m in mode.split("+"):
        result = run(m)
        with open(os.path.join(out_dir, f"{m}.{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    if teardown:
        dist.barrier()
        dist.destroy_process_group()


def main():
    mode, R, S, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    serve(mode, out_dir, lambda m: NEEDS_DIR[m](R, S, out_dir) if m in NEEDS_DIR else JOBS[m](R, S),
          teardown=mode != "no_teardown")


if __name__ == "__main__":
    main()
