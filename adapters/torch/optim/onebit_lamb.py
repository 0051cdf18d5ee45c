"""The 1-bit LAMB torch optimizer (:class:`OneBitLAMB`), on the core's :class:`slamb_comm.methods.onebit_lamb.OneBitLambRule`.

Alone it is 1-bit LAMB with P = 1; :mod:`..distributed.optimizer` turns it into 1-bit LAMB over all
ranks. It is a configuration of :class:`~.base.BucketedOptimizer` (buckets keyed by 1-bit LAMB's
options but lr, one Communicator and one OneBitLambRule each). docs/onebit_lamb.md has the math.
"""

import hashlib
import logging
from dataclasses import replace

import numpy as np
import torch

from slamb_comm.wire.layout import Layout
from slamb_comm.exchange.communicator import Communicator
from slamb_comm.errors import ConfigError, LayoutError, NonFiniteError
from slamb_comm.methods.onebit_lamb import OneBitLambRule

from ..params import param_changed, params_changed, run_closure
from ..tensors import Grads, Params, cuda_scope, tensor_of
from .base import BucketedOptimizer

__all__ = ["OneBitLAMB"]

_log = logging.getLogger("slamb_comm")


_ONEBIT_KEYS = ("freeze_step", "betas", "eps", "weight_decay", "c_max", "c_min", "coeff_beta",
                "factor_max", "factor_min", "factor_threshold", "bias_correction", "on_nonfinite")
_ONEBIT_PROBE = []  # a one-element LocalTransport communicator: the core checks options on it


def _onebit_knobs(g):
    """Group ``g``'s 1-bit LAMB options but lr, as the core keeps them (a bucket shares them)."""
    conv = {"freeze_step": int, "betas": lambda b: tuple(float(x) for x in b), "bias_correction": bool,
            "on_nonfinite": str}
    return tuple(conv.get(k, float)(g[k]) for k in _ONEBIT_KEYS)


def _host_flat(t, n, what):
    """A saved state tensor as a flat float64 NumPy array of ``n`` elements (exact for float32/64)."""
    a = torch.as_tensor(t).detach().reshape(-1)
    if a.numel() != n:
        raise LayoutError(f"saved {what} has {a.numel()} elements, expected {n}")
    return a.to(device="cpu", dtype=torch.float64).numpy()


class OneBitLAMB(BucketedOptimizer):
    r"""1-bit LAMB (Li et al., HiPC 2022; DeepSpeed's ``OnebitLamb``) as a ``torch.optim.Optimizer``.

    The math is docs/onebit_lamb.md section 2 with section 3's choices, computed by
    :class:`slamb_comm.methods.onebit_lamb.OneBitLambRule` on each bucket's fused flat buffers: for
    ``freeze_step`` steps LAMB on the gradient averaged over the ranks (one dense allreduce per
    step), then v frozen and each rank's momentum averaged by the error-compensated 1-bit
    exchange (signs, one scale per rank and chunk), the LAMB coefficient frozen and rescaled by
    a bounded factor. Alone (no ``DistributedOptimizer``) it is that rule with P = 1 (no
    exchange; with ``bias_correction=True`` and ``freeze_step`` beyond the run, exactly
    docs/algorithm.md's LAMB). Wrapped by :func:`DistributedOptimizer` (torch.distributed) or
    :func:`slamb_comm.adapters.horovod.DistributedOptimizer` it runs over all P ranks of the
    group. The exchange happens inside ``step()``, after the backward pass (no overlap with
    it); ``synchronize()`` only agrees on the step (one small allgather), and ``p.grad`` stays
    each rank's own gradient (clipping between ``synchronize()`` and ``step()`` clips it).

    Args:
        params: parameters or parameter groups; every option can be set per group. ``lr`` is
            read at every step (lr schedulers work); the other options may change between
            steps too, alike for all groups of a bucket and on every rank.
        lr, freeze_step, betas, eps, weight_decay, c_max, c_min, coeff_beta,
        factor_max, factor_min, factor_threshold, bias_correction: as
            :class:`slamb_comm.methods.onebit_lamb.OneBitLambRule` (DeepSpeed's defaults, and its names but
            for the trust ratio's bounds, ``c_max``/``c_min`` as SLAMB's, which DeepSpeed calls
            ``max_coeff``/``min_coeff``; ``bias_correction=False`` is DeepSpeed's rule).
        on_nonfinite: ``'skip'`` (default): a step with a NaN/Inf gradient on any rank is
            skipped on every rank (logged, counted in :attr:`skipped_steps`); ``'raise'``:
            every rank raises :class:`slamb_comm.NonFiniteError`. Either way nothing changes.
        transport, names: what :func:`~slamb_comm.adapters.torch.DistributedOptimizer` passes
            (the ranks' transport; ``id(parameter) -> name``); leave them out in one process.

    Buckets: trainable parameters are fused per (device, compute dtype, options but ``lr``,
    step count); each bucket has its own exchange, momentum scaling (γ̄ is over the bucket's
    tensors; DeepSpeed takes it over all) and error buffers, and groups sharing a bucket must
    have the same ``lr`` at each step (ConfigError). Parameters with ``requires_grad=False``
    at construction are not optimised.

    State: per parameter ``step`` (a float32 tensor), ``exp_avg``, ``exp_avg_sq`` and
    ``exp_avg_sq_fresh`` (live views into the core's fused buffers, float32 -- float64 for
    float64 parameters; the fresh second moment is zeros until the end of the warm-up),
    ``lamb_coeff_freeze``, ``last_factor`` and ``scaling_coeff`` (Python floats; γ is 0.0
    until the first compression step); when P > 1, the first parameter of each bucket also
    holds the bucket's exchange state: ``worker_error`` (N' elements), ``server_error`` (N'/P)
    and their ``exchange_rank`` / ``exchange_size``. Every rank's error buffers are its own:
    ``state_dict()`` / ``load_state_dict()`` round-trip exactly, so a run resumed with each
    rank loading **its own** saved state is bitwise the run that was interrupted (as for
    :mod:`slamb_comm.methods.checkpoint`). Error buffers saved by another rank or for another P (e.g.
    after Horovod's idiom: rank 0 loads, ``hvd.broadcast_optimizer_state``) are reset to zero
    with a warning, as DeepSpeed does on every load: a valid run, not bitwise the interrupted
    one.

    Failures: a gradient that is ``None`` on a rank counts as zero there (the core fuses every
    tensor of a bucket); a bucket whose parameters have no gradient on any rank does not step.
    A parameter whose shape or dtype changed after construction raises LayoutError on its rank
    and PeerError on the others (nothing changes anywhere); ranks that disagree on options,
    ``lr`` or step count raise ConfigError on every rank. With several buckets every gradient
    is checked for NaN/Inf before any bucket steps (one more pass over them), so a skipped step
    skips every bucket.

    Data types: float32/float64 parameters are updated in place; float16/bfloat16 parameters
    through float32 copies (a whole bucket's at once, during the step), cast back.
    """

    what = "OneBitLAMB"

    def __init__(self, params, lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 c_max=10.0, c_min=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, bias_correction=False, on_nonfinite="skip", *, transport=None, names=None):
        defaults = dict(lr=lr, freeze_step=freeze_step, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        c_max=c_max, c_min=c_min, coeff_beta=coeff_beta, factor_max=factor_max,
                        factor_min=factor_min, factor_threshold=factor_threshold,
                        bias_correction=bias_correction, on_nonfinite=on_nonfinite)
        self._published = {}  # param -> the torch state entries publish wrote (to see outside changes)
        super().__init__(params, defaults, transport=transport, names=names)

    # ------------------------------------------------------------------ the configuration
    def check_group(self, g):
        """ConfigError naming the first of group ``g``'s options out of its range (the core checks them)."""
        if not (isinstance(g["lr"], (int, float)) and g["lr"] >= 0):
            raise ConfigError(f"lr must be a number >= 0, got {g['lr']!r}")
        if not _ONEBIT_PROBE:
            _ONEBIT_PROBE.append(Communicator(None, Layout([(1,)], np.float32), ratio=1.0, seed=0))
        OneBitLambRule(_ONEBIT_PROBE[0], lr=g["lr"], **{k: g[k] for k in _ONEBIT_KEYS})  # ConfigError if out of range

    def knobs(self, group):
        """1-bit LAMB's options but lr, as the core keeps them (a bucket shares them)."""
        return _onebit_knobs(group)

    def build_bucket(self, bucket, transport):
        """One Communicator and one core OneBitLambRule over ``bucket``'s fused layout (collective
        when distributed)."""
        e = bucket
        e.comm = Communicator(transport, Layout([tuple(p.shape) for p in e.params], e.np_dtype, names=e.names),
                              ratio=1.0, seed=0)
        e.rule = OneBitLambRule(e.comm, lr=float(e.groups[0]["lr"]), **dict(zip(_ONEBIT_KEYS, e.key.knobs)))

    def import_state(self, e, raw):
        """Load ``raw`` (param -> saved state dict) into bucket ``e`` exactly; fresh state if empty."""
        r, lay, ex = e.rule, e.comm.layout, e.rule.exchange
        have = [p for p in e.params if "exp_avg" in raw.get(p, ())]
        missing = [n for p, n in zip(e.params, e.names) if "exp_avg" not in raw.get(p, ())]
        t = 0
        if have:
            steps = {int(float(raw[p]["step"])) for p in have}
            if len(steps) != 1 or (missing and steps != {0}):
                raise ValueError(f"the OneBitLAMB state to load mixes step counts {sorted(steps)} in one bucket"
                                 + (f" or lacks parameter(s) {missing[:5]}" if missing else ""))
            t = steps.pop()
        m, v, f = (np.zeros(lay.total, e.np_dtype) for _ in range(3))
        segments = lay.segments()
        for p in have:
            o, n = segments[e.index[p]]
            m[o:o + n] = _host_flat(raw[p]["exp_avg"], n, "exp_avg")
            v[o:o + n] = _host_flat(raw[p]["exp_avg_sq"], n, "exp_avg_sq")
            fresh = raw[p].get("exp_avg_sq_fresh")  # the core's f = v where it has none
            f[o:o + n] = v[o:o + n] if fresh is None else _host_flat(fresh, n, "exp_avg_sq_fresh")
        st = [raw.get(p, {}) for p in e.params]
        gamma = [float(s.get("scaling_coeff", 0.0)) for s in st]
        state = {"step": t, "m": m, "v": v, "f": f, "skipped_steps": r.skipped_steps,
                 "kappa": [float(s.get("lamb_coeff_freeze", 0.0)) for s in st],
                 "phi": [float(s.get("last_factor", 1.0)) for s in st],
                 "gamma": None if not any(gamma) else [g or 1.0 for g in gamma],
                 "exchange": dict(ex.state_dict(), worker_error=None, server_error=None)}
        if e.comm.size > 1:  # error buffers always exist (zeros until the first exchange): same keys everywhere
            src = st[0]
            mine = ("worker_error" in src and int(src.get("exchange_rank", -1)) == ex.rank
                    and int(src.get("exchange_size", -1)) == ex.size)
            if not mine and t > r.freeze_step:
                _log.warning("slamb_comm: OneBitLAMB bucket %s: the state loaded holds no 1-bit error buffers of this "
                             "rank (%d of %d): they restart from zero. A valid run, not bitwise the interrupted one; "
                             "load every rank's own state for that.", e.names[0], ex.rank, ex.size)
            state["exchange"].update(
                worker_error=_host_flat(src["worker_error"], ex.padded, "worker_error") if mine
                else np.zeros(ex.padded, ex.acc_dtype),
                server_error=_host_flat(src["server_error"], ex.chunk, "server_error") if mine
                else np.zeros(ex.chunk, ex.acc_dtype))
        r.load_state_dict(state)
        with cuda_scope(e.params[0].device):  # m, v, f on the parameters' device, to publish views of
            r.place(torch.empty(0, dtype=e.dtype, device=e.params[0].device))
        self.publish(e)

    def publish(self, e):
        """Point each parameter's torch state at the core's state (views of m, v, f and the error
        buffers; the per-tensor numbers as Python floats, which torch's load keeps exactly)."""
        r, lay, ex = e.rule, e.comm.layout, e.rule.exchange
        for i, (p, (o, n), shape) in enumerate(zip(e.params, lay.segments(), lay.shapes)):
            st = self.state[p]
            st["step"] = torch.tensor(float(r.t))
            st["exp_avg"] = tensor_of(r.m[o:o + n]).view(shape)
            st["exp_avg_sq"] = tensor_of(r.v[o:o + n]).view(shape)
            st["exp_avg_sq_fresh"] = tensor_of(r.f[o:o + n]).view(shape)
            st["lamb_coeff_freeze"] = float(r.kappa[i])
            st["last_factor"] = float(r.phi[i])
            st["scaling_coeff"] = 0.0 if r.gamma is None else float(r.gamma[i])
            if i == 0 and ex.worker_error is not None:
                st["worker_error"] = tensor_of(ex.worker_error)
                st["server_error"] = tensor_of(ex.server_error)
                st["exchange_rank"], st["exchange_size"] = ex.rank, ex.size
            self._published[p] = dict(st)

    # ------------------------------------------------------------------ before a step
    def pull(self, e):
        """Before a step: re-import bucket ``e`` if its torch state was replaced since the last
        step (``hvd.broadcast_optimizer_state`` writes the tensors in place and replaces the
        numbers), and apply the groups' options to the core. Returns whether it was replaced."""
        was_replaced = False
        for p in e.params:
            st, pub = self.state[p], self._published.get(p, {})
            if st.keys() != pub.keys() or any(st[k] is not v for k, v in pub.items()) \
                    or int(float(st["step"])) != e.rule.t:
                if self.transport is not None and int(float(st.get("step", 0))) != e.rule.t:
                    _log.warning("slamb_comm: OneBitLAMB state of bucket %s was replaced from outside (e.g. "
                                 "hvd.broadcast_optimizer_state after rank 0 loaded a checkpoint): this rank "
                                 "continues from it, at step %d", e.names[0], int(float(st.get("step", 0))))
                self.import_state(e, {q: self.state[q] for q in e.params})
                was_replaced = True
                break
        knobs = _onebit_knobs(e.groups[0])
        if any(_onebit_knobs(g) != knobs for g in e.groups[1:]):
            raise ConfigError("parameter groups that share a OneBitLAMB bucket now disagree on an option other than "
                              "lr; change it for every group at once")
        if knobs != e.key.knobs:
            self.check_group(e.groups[0])
            for k, val in zip(_ONEBIT_KEYS, knobs):
                setattr(e.rule, k, val)
            e.key = replace(e.key, knobs=knobs)
        return was_replaced

    @staticmethod
    def bucket_lr(e):
        """Bucket ``e``'s learning rate now; ConfigError if its groups ask for different ones."""
        lrs = {float(g["lr"]) for g in e.groups}
        if len(lrs) != 1:
            raise ConfigError(f"parameter groups that share a OneBitLAMB bucket ask for different lr {sorted(lrs)}")
        return lrs.pop()

    # ------------------------------------------------------------------ the step
    def step_status(self):
        """This rank's view of the step before anything changes: its first problem (a parameter,
        the set of parameters or a bucket's groups changed), whether a gradient is not finite
        (checked only with several buckets, so that they skip together; one bucket's core checks
        its own), and per bucket whether it has a gradient and a fingerprint of its options, lr
        and step count."""
        problem = params_changed(self, self.params_built)
        buckets = self.buckets
        bad, have, prints = False, [], []
        for e in buckets:
            lr = None
            try:
                self.pull(e)
                lr = self.bucket_lr(e)
            except ValueError as err:  # ConfigError, LayoutError, a mixed state
                problem = problem or err
            for i, p in enumerate(e.params):
                problem = problem or param_changed(p, e.names[i], e.comm.layout.shapes[i], e.dtype)
            grads = [p.grad for p in e.params if p.grad is not None]
            have.append(bool(grads))
            if len(buckets) > 1 and grads and problem is None and not bad:
                bad = not bool(torch.stack([torch.isfinite(g.to_dense() if g.is_sparse else g).all()
                                            for g in grads]).all())
            h = hashlib.blake2b(repr((e.key.dtype, e.key.knobs, e.key.age, lr, e.rule.t)).encode(), digest_size=6).digest()
            prints.append(float(int.from_bytes(h, "big")))  # < 2**48: exact in a float64
        return problem, bad, have, prints

    def apply_step(self, nonfinite, have):
        """Step every bucket that has a gradient on some rank, unless some rank's is not finite."""
        if nonfinite:
            err = NonFiniteError(f"OneBitLAMB: non-finite gradient (NaN/Inf) on rank(s) {list(nonfinite)}; the step "
                                 "was skipped on every rank and nothing was changed", nonfinite)
            if any(e.rule.on_nonfinite == "raise" for e in self.buckets):
                raise err
            self.ledger.skip(err)
            return
        for e, h in zip(self.buckets, have):
            if not h:  # no gradient on any rank: the bucket does not step
                continue
            x, g, n = Params(e), Grads(e), len(e.params)
            xs = [x[i] for i in range(n)]
            with cuda_scope(e.params[0].device):
                e.rule.step(xs, [g[i] for i in range(n)], lr=self.bucket_lr(e))
            for i in range(n):
                x.written(i)
            self.publish(e)

    @torch.no_grad()
    def step(self, closure=None):
        """One 1-bit LAMB step of every bucket (in a single process: P = 1)."""
        loss = run_closure(closure)
        problem, bad, have, _ = self.step_status()
        if problem is not None:
            raise problem
        self.apply_step([0] if bad else [], have)
        return loss
