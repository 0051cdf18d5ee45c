"""SLAMB's torch state, bucket by bucket: its import from a saved state, its export into torch's
state, and what a step finds written there from outside.

torch's ``state[p]`` holds live views into the core's fused buffers (``exp_avg``, ``exp_avg_sq``,
``freshness`` where stored), the bucket's step count as one tensor every parameter's state shares,
``mask_seed`` (a tensor, so that ``hvd.broadcast_optimizer_state`` writes it in place) and, after a
ratio change, ``mask_schedule``. :func:`load_bucket` reads a saved state into a bucket's rule,
:func:`publish_bucket` points torch's state at it (a constant number of Python calls where only the
step moved), :func:`replaced` sees a state written from outside (a broadcast), and
:func:`with_freshness` adds the derived freshness to a checkpoint.
"""

import itertools
import operator
from dataclasses import dataclass, replace

import torch

from .. import tensors

__all__ = ["Published", "load_bucket", "publish_bucket", "replaced", "with_freshness"]

_EXP_AVG = operator.methodcaller("get", "exp_avg")
_STEP = operator.methodcaller("get", "step")


@dataclass(frozen=True)
class Published:
    """What an engine's torch state was last pointed at (:func:`publish_bucket`)."""

    sign: tuple  # the mask's seed, its schedule, which tensors store their freshness
    state: object  # the optimizer's ``state`` mapping written into
    entries: tuple  # each parameter's state dict, as written
    exp_avgs: tuple  # the torch state's exp_avg views
    step: torch.Tensor  # the bucket's step count, one tensor that every parameter's state holds
    m: object  # the core's m and v the views are of
    v: object
    t: int  # the step count written

    def holds(self, state):
        """Whether ``state`` (the optimizer's) still holds what was written: the same mapping, and
        in each written dict the same ``exp_avg`` and ``step`` tensors (C-level passes, no Python
        call per parameter). A dict put in place of a parameter's whole state (``opt.state[p] =
        ...``) is not seen here; torch's ``load_state_dict``, the way to replace state, is."""
        return (state is self.state and all(map(operator.is_, map(_EXP_AVG, self.entries), self.exp_avgs))
                and all(map(operator.is_, map(_STEP, self.entries), itertools.repeat(self.step))))


def _schedule(e):
    """Bucket ``e``'s ratio changes that its cyclic mask still follows, as [[chunks, step], ...]
    (integers: a checkpoint keeps them exactly, where torch would cast a float tensor to the
    parameters' dtype); None if it has had none."""
    mask = e.comm.mask
    if "schedule" not in mask.state_dict():
        return None
    return [[m.num_chunks, m.origin] for m in mask.levels()]


def _stored(rule, n):
    """Which of the ``n`` tensors of ``rule`` store their freshness (a live view is published):
    every one or none with the bernoulli and topk masks, none with the cyclic mask unless a tensor
    once skipped a step (then per tensor: the only case that asks each tensor)."""
    if not n:
        return ()
    if not rule.derived:
        return ("all", rule.state.stored(0) is not None)
    if not rule.has_stored_freshness:
        return ()
    return tuple(rule.state.stored(i) is not None for i in range(n))


def load_bucket(e, raw):
    """Load ``raw`` (param -> saved state dict) into bucket ``e``'s rule exactly; fresh state if empty.
    The state is allocated on the parameters' device and filled tensor by tensor (no fused
    host copy of the model); a saved freshness is used only where it is stored (the
    bernoulli and topk masks: the cyclic mask derives it from the step and the seed)."""
    lay = e.comm.layout
    missing = [n for p, n in zip(e.params, e.names) if p not in raw or "exp_avg" not in raw[p]]
    have = [p for p in e.params if p in raw and "exp_avg" in raw[p]]
    step, comm_state = 0, e.comm.state_dict()
    if have:
        steps = {int(float(raw[p]["step"])) for p in have}
        if len(steps) != 1 or (missing and steps != {0}):
            raise ValueError(f"the SLAMB state to load mixes step counts {sorted(steps)} in one bucket"
                             + (f" or lacks parameter(s) {missing[:5]}" if missing else ""))
        step = steps.pop()
        comm_state["seed"] = int(raw[have[0]].get("mask_seed", comm_state["seed"]))
        sched = raw[have[0]].get("mask_schedule")
        if sched is not None and e.key.knobs.comm.mask == "cyclic":
            sched = [(int(c), int(o)) for c, o in torch.as_tensor(sched).tolist()]
            if sched[-1][0] != e.comm.mask.num_chunks:
                raise ValueError(f"the saved mask schedule (chunks, step) {sched} ends at {sched[-1][0]} chunks, "
                                 f"but the parameter group's ratio {e.comm.ratio} makes {e.comm.mask.num_chunks}")
            ratios = [1.0 / c for c, _ in sched[:-1]] + [e.comm.ratio]  # a cyclic mask's ratio is its C
            comm_state["mask"] = dict(comm_state["mask"], schedule=[(k, o) for k, (_, o) in zip(ratios, sched)])
    e.rule.load_state_dict({"step": step, "m": None, "v": None, "f": None, "comm": comm_state})
    with tensors.cuda_scope(e.params[0].device):
        e.rule.place(torch.empty(0, dtype=e.dtype, device=e.params[0].device))
    stored = not e.rule.derived
    for p, (o, n), shape in zip(have, [lay.segments()[e.index[p]] for p in have],
                                [lay.shapes[e.index[p]] for p in have]):
        views = [("exp_avg", e.rule.m[o:o + n]), ("exp_avg_sq", e.rule.v[o:o + n])]
        views += [("freshness", e.rule.state.stored(e.index[p]))] if stored else []
        for key, view in views:
            if key in raw[p]:
                tensors.tensor_of(view).view(shape).copy_(torch.as_tensor(raw[p][key]).detach())
        if not stored and "freshness" in raw[p]:  # a tensor that once skipped a step left the schedule
            i = e.index[p]
            saved = torch.as_tensor(raw[p]["freshness"]).detach().reshape(-1).to(e.dtype).cpu()
            if not torch.equal(saved, torch.from_numpy(e.rule.freshness(i).reshape(-1))):
                e.rule.state.keep(i, saved)
    e.published = None  # every entry anew (a broadcast may have written the step counts)


def publish_bucket(e, state):
    """Point each parameter's torch state (in ``state``, the optimizer's) at bucket ``e``'s fused
    buffers (no copy). The freshness is a live view where it is stored; for the cyclic mask it is
    derived, and appears only in :func:`with_freshness`. The bucket's step count is one tensor, held
    by every parameter's state (``state_dict()`` shows it per parameter; ``torch.save`` stores it
    once): a step moves it with one in-place write, where nothing else changed (a constant number of Python calls)."""
    r = e.rule
    sched = _schedule(e)
    sign = (int(e.comm.seed), None if sched is None else tuple(map(tuple, sched)), _stored(r, len(e.params)))
    done = e.published
    if done is not None and done.sign == sign and done.m is r.m and done.v is r.v and done.holds(state):
        if done.t != r.t:  # the same views and options: only the step count moved (in place, as torch does)
            done.step.fill_(float(r.t))
            e.published = replace(done, t=r.t)
        return
    lay = e.comm.layout
    step = torch.tensor(float(r.t))
    for i, (p, (o, n), shape) in enumerate(zip(e.params, lay.segments(), lay.shapes)):
        st = state[p]
        st["step"] = step
        st["exp_avg"] = tensors.tensor_of(r.m[o:o + n]).view(shape)
        st["exp_avg_sq"] = tensors.tensor_of(r.v[o:o + n]).view(shape)
        f = r.state.stored(i)
        if f is None:
            st.pop("freshness", None)
        else:
            st["freshness"] = tensors.tensor_of(f).view(shape)
        # a tensor, so that hvd.broadcast_optimizer_state writes it in place like the moments
        st["mask_seed"] = torch.tensor(int(e.comm.seed), dtype=torch.int64)
        if sched is None:
            st.pop("mask_schedule", None)
        else:  # the cyclic mask's ratio changes that still decide its freshness: [(chunks, step)]
            st["mask_schedule"] = torch.tensor(sched, dtype=torch.int64)
    entries = tuple(state[p] for p in e.params)
    e.published = Published(sign, state, entries, tuple(map(_EXP_AVG, entries)), step, r.m, r.v, r.t)



def replaced(e, state):
    """Whether bucket ``e``'s torch state (in ``state``) was replaced since it was published:
    ``hvd.broadcast_optimizer_state`` overwrites the step and the seed (the moment tensors are live
    views), a load replaces the tensors."""
    st = state[e.params[0]]
    t, seed = int(float(st["step"])), int(st["mask_seed"])
    sched = st.get("mask_schedule")
    same_schedule = (None if sched is None else sched.tolist()) == _schedule(e)
    return t != e.rule.t or seed != e.comm.seed or not _same_views(e, st) or not same_schedule


def _same_views(e, st):
    """Whether ``st`` (the first parameter's state) still holds a view of bucket ``e``'s m: the
    tensor published (no conversion), else one at the same address."""
    r, done = e.rule, e.published
    if not r.m.size:
        return True
    views = st.get("exp_avg")
    if done is not None and done.m is r.m and views is done.exp_avgs[0]:
        return True
    return views is not None and views.data_ptr() == tensors.tensor_of(r.m[:1]).data_ptr()



def with_freshness(sd, param_groups, buckets):
    """``sd`` (torch's ``state_dict()`` of the optimizer with ``param_groups``) with each parameter's
    ``freshness`` where it is derived (the cyclic mask): a float32 CPU tensor built here, so a
    checkpoint shows every element's freshness; it is not needed to resume."""
    index = {}
    for g in param_groups:
        for p in g["params"]:
            index.setdefault(id(p), len(index))
    for e in buckets:
        if not e.rule.derived:
            continue
        for i, p in enumerate(e.params):
            k = index.get(id(p))
            if k in sd["state"] and e.rule.state.stored(i) is None:  # else a live view is there
                sd["state"][k] = dict(sd["state"][k], freshness=torch.from_numpy(e.rule.freshness(i)))
    return sd
