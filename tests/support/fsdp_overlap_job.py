"""Jobs for tests/test_fsdp_overlap.py: HybridSLAMB's exchange started during FSDP2's backward pass
(adapters/torch/fsdp/overlap.py), under torchrun (gloo, CPU ranks), on tests/support/fsdp_job.py's model.

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m tests.support.fsdp_overlap_job match+recipes 2 2 OUT

``match R S``: tests/support/fsdp_job.py's ``match`` (the float64 reference of SLAMB at R ranks, every step)
with the overlap on (``overlap=True``), and how each step exchanged. ``recipes``: each scenario
(what users do between backward() and step(), and around them) runs twice, with the overlap on and
off, from the same start: the parameters must be the same bits (two replicas: the sums are exact), and
each step's way of exchanging and masked bytes are reported. Each rank writes ``OUT/<mode>.<rank>.json``.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from slamb_comm.adapters import torch as st

from . import fsdp_job
from .fsdp_job import DENSE, H, OPTS, RATIO, batch, loss_of, make_model, shard  # noqa: E402

STEPS = 5  # steps 1 and 5 are periodic syncs (H = 4)


def match(R, S):
    """fsdp_job's match, recording each step's :class:`OverlapReport`."""
    reports, real = [], st.HybridSLAMB.step

    def recording_step(self, closure=None):
        out = real(self, closure)
        reports.append(self.overlap.last._asdict())
        return out

    st.HybridSLAMB.step = recording_step
    try:
        result = fsdp_job.match(R, S, overlap=True)
    finally:
        st.HybridSLAMB.step = real
    return {**result, "reports": reports}


class Run:
    """A float32 model sharded over the mesh's pieces, its HybridSLAMB, and per step how it exchanged."""

    def __init__(self, mesh, overlap, **kwargs):
        self.model = shard(make_model().float(), mesh["shard"])
        opts = dict(ratio=RATIO, sync_interval=H, dense_threshold=DENSE, seed=3, **OPTS)
        self.opt = st.HybridSLAMB(self.model, mesh, overlap=overlap, **{**opts, **kwargs})
        self.reports, self.masked, self.seen, self._sent = [], [], [], 0

    def step(self, closure=None):
        self.opt.step(closure)
        self.record()

    def record(self):
        """After a step: how it exchanged, and the masked bytes it sent."""
        self.reports.append(self.opt.overlap.last)
        kind = self.opt.communicators[0].stats.by_kind.get("masked_allreduce")
        sent = 0 if kind is None else kind.payload_bytes
        self.masked.append(sent - self._sent)
        self._sent = sent

    def pieces(self):
        return torch.cat([p.to_local().detach().reshape(-1) for p in self.model.parameters()]).clone()


def _loss(run, t, r, s, part=None, head=True):
    """Rank (r, s)'s loss at step t (``part``: half of its batch; ``head=False``: without the last
    layer, whose parameters then get no gradient on this rank)."""
    x, y = (a.float() for a in batch(t, r, s))
    if part is not None:
        x, y = x[3 * part: 3 * part + 3], y[3 * part: 3 * part + 3]
    if not head:
        m = run.model
        return m[3](m[2](m[1](m[0](x)))).pow(2).mean()
    return loss_of(run.model, x, y)


def plain(run, t, r, s, last):
    run.opt.zero_grad()
    _loss(run, t, r, s).backward()
    run.step()


def early(run, t, r, s, last):
    """A plain step that records, inside the backward pass, how many exchanges had started when
    autograd reached the Tanh after layer 2 (layer 4's done) and after layer 0 (layers 4 and 2 done)."""
    seen = {}

    def note(k):
        def hook(module, grad_output):
            seen.setdefault(k, run.opt.overlap.launched)  # returns None: the gradient is left as it is
        return hook

    hooks = [run.model[k].register_full_backward_pre_hook(note(k)) for k in (3, 1)]
    plain(run, t, r, s, last)
    for h in hooks:
        h.remove()
    run.seen.append([seen.get(3), seen.get(1)])


def scaled_and_clipped(run, t, r, s, last):
    """GradScaler.unscale_ and clip_grad_norm_ between backward() and step()."""
    amp = getattr(run, "amp", None) or torch.amp.GradScaler("cpu", init_scale=1024.0)
    run.amp = amp
    run.opt.zero_grad()
    amp.scale(_loss(run, t, r, s)).backward()
    amp.unscale_(run.opt)
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 0.05)
    amp.step(run.opt)
    amp.update()
    run.record()


def clip_no_op(run, t, r, s, last):
    """clip_grad_norm_ with a bound no gradient reaches: it multiplies by 1, nothing changes."""
    run.opt.zero_grad()
    _loss(run, t, r, s).backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1e9)
    run.step()


def accumulate_no_sync(run, t, r, s, last):
    """Two micro-batches, FSDP2's gradient sync off for the first (one reducing backward pass)."""
    run.opt.zero_grad()
    for part in (0, 1):
        run.model.set_requires_gradient_sync(part == 1)
        (_loss(run, t, r, s, part=part) / 2).backward()
    run.step()


def accumulate_synced(run, t, r, s, last):
    """Two micro-batches with FSDP2's sync on for both: the second adds into the gradients."""
    run.opt.zero_grad()
    for part in (0, 1):
        (_loss(run, t, r, s, part=part) / 2).backward()
    run.step()


def inf_on_one_rank(run, t, r, s, last):
    """An inf in the last rank's loss at step 3, no scaler: every rank skips that step."""
    run.opt.zero_grad()
    loss = _loss(run, t, r, s)
    (loss * float("inf") if last and t == 3 else loss).backward()
    run.step()


def no_gradient_somewhere(run, t, r, s, last):
    """Replica 1 leaves out the last layer at steps 2 and 3 (its parameters get no gradient there,
    and count as zero); every rank leaves it out at step 4 (it is left exactly as it is)."""
    run.opt.zero_grad()
    _loss(run, t, r, s, head=not (t == 4 or (r == 1 and t in (2, 3)))).backward()
    run.step()


SCENARIOS = {"early": (early, {}), "scaled_and_clipped": (scaled_and_clipped, {}), "clip_no_op": (clip_no_op, {}),
             "accumulate_no_sync": (accumulate_no_sync, {}), "accumulate_synced": (accumulate_synced, {}),
             "inf_on_one_rank": (inf_on_one_rank, {}), "no_gradient_somewhere": (no_gradient_somewhere, {}),
             "float16_payload": (plain, {"value_dtype": "float16"})}


def recipes(R, S):
    """Every scenario with the overlap on and off: same bits, and how each step exchanged."""
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    last = dist.get_rank() == dist.get_world_size() - 1
    out = {}
    for name, (recipe, kwargs) in SCENARIOS.items():
        on, off = Run(mesh, True, **kwargs), Run(mesh, False, **kwargs)
        for run in (on, off):
            for t in range(1, STEPS + 1):
                recipe(run, t, r, s, last)
        out[name] = {"bitwise": bool(torch.equal(on.pieces(), off.pieces())),
                     "modes": [x.mode for x in on.reports], "applied": [x.applied for x in on.reports],
                     "fell_back": [x.fell_back for x in on.reports], "early": [x.early for x in on.reports],
                     "masked_on": on.masked, "masked_off": off.masked, "seen_in_backward": on.seen,
                     "steps": [on.opt.steps_taken(), off.opt.steps_taken()],
                     "skipped": [on.opt.skipped_steps, off.opt.skipped_steps]}
    return out


JOBS = {"match": match, "recipes": recipes}


def main():
    mode, R, S, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    fsdp_job.serve(mode, out_dir, lambda m: JOBS[m](R, S))


if __name__ == "__main__":
    main()
