"""Jobs for tests/test_fsdp_resize.py: HybridSLAMB's torch.distributed.checkpoint resumed at another replica
count (docs/algorithm.md sections 10 and 15.3), under torchrun (gloo, CPU).

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m tests.support.fsdp_resize_job four OUT_DIR
    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.support.fsdp_resize_job two OUT_DIR

``four`` (4 ranks): a 2 x 2 run saves DCP checkpoints right after the periodic sync of step 5 (``s5``)
and between syncs at step 7 (``s7``); resumes ``s5`` on the same mesh (bitwise the uninterrupted run)
and ``s7`` on 1 x 4. ``two`` (2 ranks, after ``four``): resumes ``s5`` and ``s7`` on 1 x 2 and ``s7`` on
2 x 1, saves the 1 x 2 run at step 9 (``g9`` through a torchtitan-like ``Stateful``, ``d9`` as
``opt.state_dict()`` itself) and resumes both on 2 x 1 (R 1 -> 2); then the refusals.
Every save writes each rank's own plain state (``saved.<tag>.<rank>.pt``), every resume each rank's
state as loaded (``loaded.<case>.<rank>.pt``), for the test to check against section 10's rule; each
rank writes ``OUT_DIR/<mode>.<rank>.json``.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh

from slamb_comm.adapters.torch.fsdp.state import PER_REPLICA
from slamb_comm.adapters.torch.tensors import local_of
from slamb_comm.errors import ConfigError, PeerError

from .fsdp_job import float_run, serve, train


def grid(R, S):
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    return mesh, mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()


def dump(model, opt, mesh, path):
    """This rank's own state (its pieces, plain tensors) and where its pieces start, to ``path``."""
    R, S, s = mesh.size(0), mesh.size(1), mesh["shard"].get_local_rank()
    sd = opt.state_dict()
    out = {"R": R, "S": S, "r": mesh["replicate"].get_local_rank(), "s": s, "steps": opt.steps_taken(), "state": {}}
    for i, (n, p) in enumerate(model.named_parameters()):
        st, n0 = sd["state"][i], p.shape[0]
        piece = {k: local_of(st[k])[0].clone() for k in PER_REPLICA}
        piece.update(param=p.to_local().detach().clone(), start=min(s * -(-n0 // S), n0), step=float(st["step"]))
        out["state"][n] = piece
    torch.save(out, path)


class OptimState:
    """The optimizer as torchtitan hands it to DCP: a ``Stateful`` whose state dict is the flattened
    ``get_optimizer_state_dict`` (keys ``state.<fqn>.exp_avg``); DCP calls its ``state_dict()`` itself."""

    FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.opt, options=self.FLAT)

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.opt, sd, options=self.FLAT)


def optim_entry(model, opt, how):
    """What DCP is handed for the optimizer: ``"nested"``, ``get_optimizer_state_dict``; ``"stateful"``,
    :class:`OptimState`; ``"direct"``, ``opt.state_dict()`` itself (keys by parameter index)."""
    if how == "stateful":
        return OptimState(model, opt)
    return opt.state_dict() if how == "direct" else get_optimizer_state_dict(model, opt)


def save(model, opt, mesh, out_dir, tag, how="nested"):
    dcp.save({"model": get_model_state_dict(model), "optim": optim_entry(model, opt, how)},
             checkpoint_id=os.path.join(out_dir, tag))
    dump(model, opt, mesh, os.path.join(out_dir, f"saved.{tag}.{dist.get_rank()}.pt"))


def resume(R, S, out_dir, tag, case, prepare=True, how="nested"):
    """A new model and optimizer on an R x S mesh (another mask seed: the checkpoint's must win) load
    checkpoint ``tag`` the way docs/algorithm.md section 15.3 says, the optimizer handed to DCP as ``how``
    says (:func:`optim_entry`); this rank's loaded state goes to a file."""
    mesh, r, s = grid(R, S)
    model, opt = float_run(mesh, 4)
    path = os.path.join(out_dir, tag)
    if prepare:
        opt.prepare_load(path)
    sd = {"model": get_model_state_dict(model), "optim": optim_entry(model, opt, how)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    if how == "nested":
        set_optimizer_state_dict(model, opt, sd["optim"])
    elif how == "direct":
        opt.load_state_dict(sd["optim"])
    dump(model, opt, mesh, os.path.join(out_dir, f"loaded.{case}.{dist.get_rank()}.pt"))
    return mesh, r, s, model, opt


def go_on(model, opt, r, s, steps=2):
    """Train ``steps`` more steps; whether every piece stays finite, and the step count."""
    t = opt.steps_taken()
    train(model, opt, range(t + 1, t + 1 + steps), r, s)
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    return {"finite": finite, "steps": opt.steps_taken(), "seed": int(opt.communicators[0].seed)}


def four(out_dir):
    """Save on 2 x 2; resume on 2 x 2 (bitwise) and on 1 x 4."""
    out = {}
    mesh, r, s = grid(2, 2)
    model, opt = float_run(mesh, 3)
    train(model, opt, range(1, 6), r, s)
    save(model, opt, mesh, out_dir, "s5")  # right after the periodic sync of step 5 (H = 4)
    train(model, opt, range(6, 8), r, s)
    save(model, opt, mesh, out_dir, "s7")  # between syncs
    train(model, opt, range(8, 9), r, s)

    _, r, s, mc, oc = resume(2, 2, out_dir, "s5", "2x2_s5")
    out["2x2_s5"] = go_on(mc, oc, r, s, steps=3)
    same = all(torch.equal(a.to_local(), c.to_local()) for a, c in zip(model.parameters(), mc.parameters()))
    m_same = all(torch.equal(opt.state[a]["exp_avg"], oc.state[c]["exp_avg"])
                 for a, c in zip(model.parameters(), mc.parameters()))
    out["2x2_s5"]["bitwise"] = bool(same and m_same)

    _, r, s, md, od = resume(1, 4, out_dir, "s7", "1x4_s7")
    out["1x4_s7"] = go_on(md, od, r, s)
    return out


def refusals(out_dir):
    """What is not supported: each error's message."""
    out = {}

    def refused(key, build):
        try:
            build()
        except ConfigError as e:
            out[key] = "ConfigError: " + str(e)
        except PeerError as e:
            out[key] = "PeerError: " + str(e)
        except dcp.CheckpointException as e:  # DCP's own (a BaseException), raised on every rank
            out[key] = "CheckpointException: " + str(e).strip().splitlines()[-1]
        else:
            out[key] = None

    def per_rank_file(only=None):  # a 2 x 2 rank's own plain state (17 of 33 rows) on 2 x 1 (whole tensors);
        mesh, _, _ = grid(2, 1)    # with only=k, on rank k alone (the others load their own state, which fits)
        model, opt = float_run(mesh, 4)
        mine = torch.load(os.path.join(out_dir, f"saved.s5.{dist.get_rank()}.pt"))["state"]
        sd = opt.state_dict()
        for i, (n, _p) in enumerate(model.named_parameters()):
            fits = only is not None and dist.get_rank() != only
            sd["state"][i].update({k: local_of(sd["state"][i][k])[0] if fits else mine[n][k] for k in PER_REPLICA})
        opt.load_state_dict(sd)

    def model_only():  # a checkpoint without the optimizer
        mesh, _, _ = grid(1, 2)
        model, opt = float_run(mesh, 4)
        path = os.path.join(out_dir, "model_only")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
        opt.prepare_load(path)

    refused("per_rank_file", per_rank_file)
    refused("per_rank_file_on_rank_1", lambda: per_rank_file(only=1))
    refused("model_only", model_only)
    refused("no_prepare", lambda: resume(1, 2, out_dir, "s5", "none", prepare=False))
    return out


def two(out_dir):
    """Resume on 1 x 2 and 2 x 1; save the 1 x 2 run from s7 at step 9 and resume that on 2 x 1 (R 1 -> 2);
    the refusals."""
    out = {}
    for R, S, tag in ((1, 2, "s5"), (2, 1, "s7"), (1, 2, "s7")):
        mesh, r, s, model, opt = resume(R, S, out_dir, tag, f"{R}x{S}_{tag}")
        out[f"{R}x{S}_{tag}"] = go_on(model, opt, r, s)
    save(model, opt, mesh, out_dir, "g9", how="stateful")  # torchtitan's way, both ends
    save(model, opt, mesh, out_dir, "d9", how="direct")  # dcp.save of opt.state_dict() itself
    _, r, s, model, opt = resume(2, 1, out_dir, "d9", "2x1_d9", how="direct")
    _, r, s, model, opt = resume(2, 1, out_dir, "g9", "2x1_g9", how="stateful")
    out["2x1_g9"] = go_on(model, opt, r, s)
    out["errors"] = refusals(out_dir)
    return out


JOBS = {"four": four, "two": two}


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    serve(mode, out_dir, lambda m: JOBS[m](out_dir))


if __name__ == "__main__":
    main()
