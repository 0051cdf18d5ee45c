"""SLAMB's step tensor by tensor (docs/algorithm.md section 1): the CPU's path, and the pieces API.

Two parts that a :class:`~slamb_comm.methods.slamb.SlambRule` owns and hands its pieces API to, each on
the rule's public state and options: :class:`TensorwiseExchange` (per step: M_t's picks and counts,
:meth:`~TensorwiseExchange.accumulate` per tensor as its gradient arrives -- the adapters' hooks --, the
payload and :meth:`~TensorwiseExchange.exchange`) and :class:`TensorwiseUpdate` (:meth:`~TensorwiseUpdate.apply`:
per tensor the moments, the direction, the trust ratios and the update, in cache-sized blocks on the CPU).
:meth:`SlambRule.step` runs them in turn for lists of arrays and on the CPU; on a device, fused buffers
take :mod:`slamb_comm.device.slamb_step` instead. The state (``m``, ``v``, the freshness), the options and
the checkpoint format are the rule's.
"""

import math
from typing import Any, NamedTuple

import numpy as np

from .. import arrays as _arr
from ..wire.layout import views
from ..errors import LayoutError, NonFiniteError
from ..wire.masks import BLOCK

__all__ = ["TensorwiseExchange", "TensorwiseUpdate", "Scratch", "trust_ratio"]


class _TensorViews(NamedTuple):
    """One tensor's arrays during its commit: parameters, gradient, moments, freshness (None
    where derived), the direction ``w`` and a block of scratch, with M_t's picks and the blocks."""

    i: int
    x: Any
    g: Any
    m: Any
    v: Any
    f: Any
    w: Any
    tmp: Any
    picks: Any
    ranges: Any
    everything: bool


class _Commit(NamedTuple):
    """A tensor whose moments are committed and whose update is still to come (pass 1 done)."""

    tv: _TensorViews
    sums: tuple  # (||x||^2, ||w||^2, ||x_S||^2, ||w_S||^2) of this rank's piece
    s_u: float  # u = s_u w
    wd_w: float  # the weight decay on x inside w


class Scratch:
    """Reusable scratch arrays by name (one tensor's size at most: nothing of the model's size)."""

    def __init__(self):
        self._arrays = {}

    def get(self, xp, name, n, dtype):
        """A scratch array of at least ``n`` elements of ``dtype`` on ``xp`` (its first ``n`` returned)."""
        a = self._arrays.get(name)
        if a is None or a.size < n or a.dtype != dtype or _arr.namespace(a) is not xp:
            a = self._arrays[name] = xp.empty(n, dtype)
        return a[:n]

    def clear(self):
        self._arrays = {}


class TensorwiseExchange:
    """The exchange half of a :class:`~slamb_comm.methods.slamb.SlambRule`'s tensor-by-tensor step, per
    open step: M_t's picks and counts, this rank's payload and the exchange (see the module docstring)."""

    def __init__(self, rule):
        self.rule = rule
        self.layout, self.comm = rule.layout, rule.comm
        self._counts = self._starts = None
        self.reset()

    def begin(self, t):
        """Step ``t`` was opened: M_t's counts (the cyclic mask keeps them per chunk)."""
        self.reset()
        if self.comm.mask.kind == "topk":
            self._counts = None
        else:
            counts = self.comm.mask.counts(t)  # the cyclic mask's: one list per chunk
            if counts is not self._counts:
                self._counts, self._starts = counts, _starts(counts)

    def reset(self):
        """Forget the open step's picks, payload and checks (a step ended or was abandoned)."""
        self._bad_tensors = {}
        self._payload = None
        self._picks = {}
        self._rot = {}
        self._local = {}

    def open_t(self):
        """The open step (RuntimeError where none is)."""
        t = self.rule.t_open
        if t is None:
            raise RuntimeError("no step is open: call begin_step() first")
        return t

    def counts(self):
        """Per tensor, the number of its elements in M_t of the open step (the payload layout;
        not known before :meth:`exchange` for the topk mask)."""
        self.open_t()
        if self._counts is None:
            raise RuntimeError("the topk mask's counts are known only after exchange()")
        return list(self._counts)

    def picks(self, i, xp=np):
        """M_t of the open step within tensor ``i`` (a :class:`~slamb_comm.wire.picks.Picks`)."""
        t = self.open_t()
        p = self._picks.get(i)
        if p is None:
            mask = self.comm.mask
            if mask.kind == "topk":
                raise RuntimeError("the topk mask's picks are known only after exchange()")
            if mask.kind == "cyclic":
                # the rotations (one byte per group of C units) are hashed once per step and kept
                # until the commit; the positions are derived from them at each use
                if i not in self._rot:
                    self._rot[i] = mask.rotations(i, xp)
                return mask.picks(t, i, xp, self._rot[i])
            p = self._picks[i] = mask.picks(t, i, xp)  # bernoulli: drawn once per step
        return p

    def _check(self, xp, g):
        """Whether the gradient (a range of it) is bad: a NaN or Inf, or an element whose square
        overflows v (``|g| >= sqrt(max)`` of the dtype; docs/algorithm.md section 9). A host
        bool on the CPU, a 0-d device array on a GPU."""
        if g.size == 0:
            return False
        if xp is not np:
            return ~xp.isfinite(xp.dot(g, g))
        with np.errstate(over="ignore", invalid="ignore"):
            sq = np.dot(g, g)  # one BLAS pass: NaN and Inf survive it
            if np.isfinite(sq):
                return False
            # the sum of squares overflowed: bad only if one element's square does (as the fused
            # step decides), not when finite squares add up past the dtype's max (rare: one more pass)
            return not bool(np.isfinite(np.square(g)).all())

    def accumulate(self, i, g_i, out=None):
        """Take tensor ``i``'s gradient for the open step (nothing is committed yet).

        Writes this rank's new momentum on M_t of tensor ``i`` (``b1 m + (1-b1) g`` at the
        picked positions, in payload order) into ``out`` (an array of ``counts()[i]``
        elements, any float dtype, e.g. the caller's own allreduce buffer) or into the
        step's payload. For the topk mask it picks the tensor's top-k instead (the payload
        follows in :meth:`exchange`). Returns whether this gradient is bad (a bool on the
        CPU, a 0-d array on a GPU): NaN/Inf, or too large for v.
        """
        self.open_t()
        lay = self.layout
        g = _arr.as_array(g_i)
        xp = _arr.namespace(g)
        n = lay.sizes[i]
        if g.size != n:
            raise LayoutError(f"gradient of tensor {lay.names[i]!r} has {g.size} elements, expected {n}")
        g = g.reshape(-1)
        with _arr.device_scope(g):
            self.rule.place(g)
            o = lay.offsets[i]
            m = self.rule.m[o : o + n]
            if self.comm.mask.kind == "topk":
                bad = self._check(xp, g)
                if i in lay.compressible:
                    mn = self.rule.scratch.get(xp, "u", n, lay.dtype)
                    self._moment1(xp, m, g, mn)
                    self._local[i] = self.comm.mask.pick(i, mn)
            else:
                picks = self.picks(i, xp)
                if out is None:
                    if self._payload is None:
                        self._payload = xp.empty(self._starts[-1] + 1, self.comm.value_dtype)
                    s = self._starts[i]
                    out = self._payload[s : s + picks.count]
                bad = self._gather(xp, picks, m, g, out, check=True)
        self._bad_tensors[i] = bad
        return bad

    def _moment1(self, xp, m, g, out):
        """``out = b1 m + (1-b1) g`` (the new momentum, not committed), blocked on the CPU."""
        b1 = self.rule.betas[0]
        dt = self.layout.dtype.type
        lim = self.limit(xp) or m.size
        for lo in range(0, m.size, lim):
            hi = min(lo + lim, m.size)
            o = out[lo:hi]
            xp.multiply(m[lo:hi], dt(b1), out=o)
            tmp = self.rule.scratch.get(xp, "tmp", hi - lo, self.layout.dtype)
            xp.multiply(g[lo:hi], dt(1.0 - b1), out=tmp)
            o += tmp

    def _gather(self, xp, picks, m, g, out, check=False):
        """``out = b1 m[M_t] + (1 - b1) g[M_t]`` for one tensor, in payload order, in the same
        blocked pass as the gradient's check (``check``: return whether it is bad)."""
        dt = self.layout.dtype
        b1, c1 = dt.type(self.rule.betas[0]), dt.type(1.0 - self.rule.betas[0])
        bad = False
        for r in picks.ranges(self.limit(xp)):
            if check:
                gb = g[r[0] : r[1]]
                bad = (bad or self._check(xp, gb)) if xp is np else (bad | self._check(xp, gb))
            a, b = picks.span(r)
            if b == a:
                continue
            tm = picks.take(m, r, self.rule.scratch.get(xp, "ta", b - a, dt))
            tg = picks.take(g, r, self.rule.scratch.get(xp, "tb", b - a, dt))
            tm *= b1
            tg *= c1
            tm += tg
            _arr.cast_into(out[a:b], tm)  # float16 payloads: not NumPy's element-wise cast
        return bad

    def exchange(self, grads=None):
        """The momentum exchange of the open step: one allreduce of the payload (every tensor's
        M_t entries and a status word) and one host read. For the topk mask it first forms the
        union of the ranks' picks (one more host read) and gathers the payload from ``grads``
        (the same gradients as given to :meth:`accumulate`).

        Raises NonFiniteError on every rank if any rank's gradients are bad; the step is then
        aborted and no state changes.
        """
        t = self.open_t()
        xp = self.rule.xp or np
        m = self.rule.m
        with _arr.device_scope(m if m is not None else np.zeros(0)):
            self._exchange(t, xp, grads)

    def _exchange(self, t, xp, grads):
        lay, comm = self.layout, self.comm
        try:
            if comm.mask.kind == "topk":
                sel = comm.mask.union(xp, self._local, comm.transport)
                self._picks = dict(enumerate(sel.picks))
                self._counts, self._starts = sel.counts, _starts(sel.counts)
                self._payload = xp.empty(self._starts[-1] + 1, comm.value_dtype)
                gv = views(lay, grads)
                for i, (p, s, c) in enumerate(zip(sel.picks, sel.starts, sel.counts)):
                    o = lay.offsets[i]
                    self._gather(xp, p, self.rule.m[o : o + lay.sizes[i]], gv[i], self._payload[s : s + c])
            elif self._payload is None:
                self._payload = xp.zeros(self._starts[-1] + 1, comm.value_dtype)  # no tensor accumulated
            buf = self._payload
            bad = False  # any tensor's gradient bad (the latest accumulate of each tensor counts)
            for b in self._bad_tensors.values():
                bad = (bad or bool(b)) if xp is np else (bad | b)
            comm.reduce_checked(buf, None, bad, f"SLAMB momentum exchange at step {t}",
                                spans=(self._starts[:-1], self._counts))
        except NonFiniteError as e:
            names = [lay.names[i] for i, b in self._bad_tensors.items() if bool(b)]
            self.rule.abort_step()
            if not names:
                raise
            raise NonFiniteError(f"{e} (this rank: non-finite gradient in {names})", e.ranks, names) from None
        except Exception:
            self.rule.abort_step()
            raise
        comm.record_masked_allreduce(buf.size * buf.dtype.itemsize, buf.size - 1)

    def means(self, means):
        """Per tensor, the summed (after :meth:`exchange`) or averaged (the caller's ``means``)
        payload values of M_t, and the scale that makes them means."""
        lay = self.layout
        if means is None:
            if self._payload is None:
                raise RuntimeError("no exchanged values: call exchange() or pass means=")
            buf = self._payload
            return [buf[s : s + c] for s, c in zip(self._starts, self._counts)], 1.0 / self.comm.size
        if len(means) != len(lay):
            raise LayoutError(f"got {len(means)} exchanged arrays, expected {len(lay)}")
        return [_arr.as_array(a).reshape(-1) for a in means], 1.0

    @staticmethod
    def limit(xp):
        """The block of a pass: cache-sized on the CPU, the whole tensor on a device."""
        return BLOCK if xp is np else None



class TensorwiseUpdate:
    """The update half of a :class:`~slamb_comm.methods.slamb.SlambRule`'s tensor-by-tensor step (see the
    module docstring), on the rule's state and its :class:`TensorwiseExchange` ``exchange``'s picks."""

    def __init__(self, rule, exchange):
        self.rule, self.exchange = rule, exchange
        self.layout, self.comm = rule.layout, rule.comm

    def apply(self, x, grads, means=None, lr=None, weight_decay=None, written=None, skip=()):
        """Finish the open step on parameters ``x`` (in place) with the gradients ``grads``.

        ``x`` and ``grads``: fused buffers, lists of arrays shaped like the layout, or lazily
        read sequences (see :meth:`slamb_comm.Communicator._take`). ``means``: per tensor, the
        averaged payload of :meth:`accumulate` (when the caller did its own averaging), or
        ``None`` after :meth:`exchange`. Commits the moments, then per tensor the direction,
        the trust ratios and the update; then the periodic sync after steps with
        ``(t - 1) % H == 0``. ``written(i)`` is called once tensor i of ``x`` is final.

        ``skip``: tensors that had no gradient on any rank at this step (the caller's agreement).
        They are left exactly as they are (docs/algorithm.md section 1, "Parameters without a
        gradient"): no moment decay, no update, freshness unchanged. With the cyclic mask such
        a tensor's freshness is stored from then on (4 bytes per element of that tensor), since
        it no longer follows the schedule.
        """
        t = self.exchange.open_t()
        lay, comm = self.layout, self.comm
        lr = self.rule.lr if lr is None else self.rule.per_tensor(lr, "lr")
        wd = self.rule.weight_decay if weight_decay is None else self.rule.per_tensor(weight_decay, "weight_decay")
        xv, gv = views(lay, x), views(lay, grads)
        means, scale = self.exchange.means(means)
        F = [self.rule.beta3 ** s for s in comm.mask.staleness(t)] if self.rule.derived else None
        sync = (t - 1) % self.rule.sync_interval == 0 and comm.size > 1
        bad = False  # whether some updated parameter is not finite, from the update's own pass on sync steps
        opened = []  # sharded tensors: every tensor's moments first, then the whole tensors' norms, then the updates
        for i, xi, gi in self._inputs(lay, xv, gv, written, skip):
            xp = _arr.namespace(xi)
            with _arr.device_scope(xi):
                c = self._commit(xp, i, xi, gi, means[i], scale, t, wd[i])
                if self.rule.shard_group is not None:
                    opened.append(c)
                    continue
                fin = self._move(xp, c, t, c.sums, lr[i], F, sync)
            if sync:
                bad = (bad or not bool(fin)) if xp is np else (bad | ~fin)
            if written is not None:
                written(i)
        for c, sums in zip(opened, self._whole_sums(opened)):
            xp = _arr.namespace(c.tv.x)
            with _arr.device_scope(c.tv.x):  # the scratch w held the last tensor's: w formed again, range by range
                fin = self._move(xp, c, t, sums, lr[c.tv.i], F, sync, again=True)
            if sync:
                bad = (bad or not bool(fin)) if xp is np else (bad | ~fin)
            if written is not None:
                written(c.tv.i)
        self.rule.end_step(t)  # before the sync, which may raise (then on every rank alike)
        if sync:
            comm.sync(x, written=written, bad=bad)
        return x

    def _inputs(self, lay, xv, gv, written, skip):
        """``(i, x_i, g_i)`` of the tensors this step updates, checked; empty and skipped tensors are
        reported ``written`` at once (a skipped one keeps its freshness, see :meth:`apply`)."""
        for i in range(len(lay)):
            n = lay.sizes[i]
            if n == 0:
                if written is not None:
                    written(i)
                continue
            xi, gi = xv[i], gv[i]
            xp = _arr.namespace(xi)
            self.rule.place(xi)
            if xi.dtype != lay.dtype or xi.size != n:
                raise LayoutError(f"parameter {lay.names[i]!r}: {xi.size} {xi.dtype.name}, "
                                  f"expected {n} {lay.dtype.name}")
            if i in skip:
                self._keep_skipped(xp, i, xi)
                if written is not None:
                    written(i)
                continue
            yield i, xi, gi

    def _whole_sums(self, opened):
        """Sharded tensors: each opened tensor's four squared norms summed over the shard group
        (one allreduce of 4 floats per tensor of the layout; a rank holding no piece of a tensor
        sends zeros), as ``(||x||^2, ||w||^2, ||x_S||^2, ||w_S||^2)`` of the whole tensor."""
        group = self.rule.shard_group
        if group is None:
            return []
        if self.rule.c_min == self.rule.c_max:  # the trust ratios are fixed (SAdamW): the norms are not needed
            return [c.sums for c in opened]
        xp = self.rule.xp or np
        sums = xp.zeros((len(self.layout), 4), np.float64)
        for c in opened:
            sums[c.tv.i] = xp.stack([xp.asarray(v, np.float64) for v in c.sums]) if xp is not np else c.sums
        group.allreduce(sums.reshape(-1))
        if xp is np:
            return [tuple(float(v) for v in sums[c.tv.i]) for c in opened]
        return [tuple(sums[c.tv.i, k] for k in range(4)) for c in opened]

    def _keep_skipped(self, xp, i, like):
        """Tensor ``i`` had no gradient on any rank: with derived freshness, store its f as it
        was after step t - 1 (it leaves the mask's schedule from now on)."""
        if self.rule.derived and self.rule.state.stored(i) is None:
            with _arr.device_scope(like):
                self.rule.state.keep(i, self.rule.freshness(i))

    def _commit(self, xp, i, x, g, mean, scale, t, wd):
        """Pass 1 of tensor i (:meth:`_moments_pass`): its moments committed, the direction in the
        scratch w, its squared norms. Returns the :class:`_Commit` that :meth:`_move` finishes.

        The direction is kept as ``w = m / (sqrt(v) + eps sqrt(1-b2^t)) + (wd / s) x`` with
        ``u = s w`` and ``s = sqrt(1-b2^t) / (1-b1^t)``: the same u as the formula (exact
        algebra, two fewer passes); s enters the trust ratios' norms and the update's
        coefficients instead."""
        lay = self.layout
        o, n = lay.offsets[i], lay.sizes[i]
        picks = self.exchange.picks(i, xp)
        ranges = picks.ranges(self.exchange.limit(xp))
        block = max(r[1] - r[0] for r in ranges)
        tv = _TensorViews(i=i, x=x, g=g, m=self.rule.m[o : o + n], v=self.rule.v[o : o + n],
                          f=self.rule.state.stored(i),
                          w=self.rule.scratch.get(xp, "u", n, lay.dtype), tmp=self.rule.scratch.get(xp, "tmp", block, lay.dtype),
                          picks=picks, ranges=ranges, everything=picks.kind == "all")
        b1, b2 = self.rule.betas
        s_u = math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        sums = self._moments_pass(xp, tv, mean, scale, t, wd / s_u)
        return _Commit(tv=tv, sums=sums, s_u=s_u, wd_w=wd / s_u)

    def _move(self, xp, c, t, sums, lr, F, check=False, again=False):
        """Pass 2 of a committed tensor: the trust ratios from the squared norms ``sums`` (the
        piece's own, or the whole tensor's when sharded), then the update of x (with ``check``:
        returns whether the updated tensor is finite, from the update's pass). ``again``: the
        scratch w no longer holds this tensor's direction (sharded tensors: every tensor's
        moments came first); the update pass forms it again from m, v and x, range by range."""
        xx, ww, xs, ws = sums
        s2 = c.s_u * c.s_u
        phi_s, phi_a = self._ratios(xp, (xx, ww * s2, xs, ws * s2))
        # x -= (lr phi_S f + lr / sqrt(P) phi_A (1 - f)) u, with u = s w
        rate_s, rate_a = lr * c.s_u * phi_s, lr * c.s_u / math.sqrt(self.comm.size) * phi_a
        return self._update_pass(xp, c.tv, t, rate_s, rate_a, F, check, c.wd_w if again else None)

    def _direction(self, xp, tv, lo, hi, wb, c_eps, c_wd):
        """``wb = m / (sqrt(v) + eps') + wd' x`` on elements lo..hi of tensor ``tv`` (the same
        operations as :meth:`_moments_pass`, so the same bits); returns ``wb``."""
        xp.sqrt(tv.v[lo:hi], out=wb)
        wb += c_eps
        xp.divide(tv.m[lo:hi], wb, out=wb)
        if c_wd:
            tmp = tv.tmp[: hi - lo]
            xp.multiply(tv.x[lo:hi], c_wd, out=tmp)
            xp.add(wb, tmp, out=wb)
        return wb

    def _moments_pass(self, xp, tv, mean, scale, t, wd_w):
        """Pass 1 over tensor ``tv``: the moments (in place: the exchange succeeded), M_t's means,
        the freshness, the direction w (weight decay ``wd_w`` on x) and the squared norms
        ``(||x||^2, ||w||^2, ||x_S||^2, ||w_S||^2)`` (host floats on the CPU, 0-d arrays on a GPU)."""
        dtype = self.layout.dtype
        dt = dtype.type
        b1, b2 = self.rule.betas
        m, v, g, x, w, f, picks = tv.m, tv.v, tv.g, tv.x, tv.w, tv.f, tv.picks
        wide = np.promote_types(mean.dtype, dtype)
        c_b1, c_1b1, c_b2, c_1b2 = dt(b1), dt(1.0 - b1), dt(b2), dt(1.0 - b2)
        c_eps, c_wd, c_b3 = dt(self.rule.eps * math.sqrt(1.0 - b2**t)), dt(wd_w), dt(self.rule.beta3)
        mul = xp.multiply
        xx = ww = xs = ws = 0.0
        for r in tv.ranges:
            lo, hi = r[0], r[1]
            mb, vb, gb, xb, wb = m[lo:hi], v[lo:hi], g[lo:hi], x[lo:hi], w[lo:hi]
            tmp = tv.tmp[: hi - lo]
            mul(gb, c_1b1, out=tmp)
            mb *= c_b1
            mb += tmp
            mul(gb, gb, out=tmp)
            tmp *= c_1b2
            vb *= c_b2
            vb += tmp
            a, b = picks.span(r)
            if b > a:
                vals = _arr.cast(mean[a:b], wide)
                if scale != 1.0:
                    vals *= vals.dtype.type(scale)
                picks.put(m, r, vals)
            if f is not None and not tv.everything:
                f[lo:hi] *= c_b3
                picks.put(f, r, 1)
            self._direction(xp, tv, lo, hi, wb, c_eps, c_wd)
            xx = xx + _sumsq(xp, xb)
            ww = ww + _sumsq(xp, wb)
            if not tv.everything and b > a:
                xs = xs + _sumsq(xp, picks.take(x, r, self.rule.scratch.get(xp, "ta", b - a, dtype)))
                ws = ws + _sumsq(xp, picks.take(w, r, self.rule.scratch.get(xp, "tb", b - a, dtype)))
        return (xx, ww, xx, ww) if tv.everything else (xx, ww, xs, ws)

    def _update_pass(self, xp, tv, t, rate_s, rate_a, F, check, wd_w=None):
        """Pass 2 over tensor ``tv``: ``x -= (rate_S f + rate_A (1 - f)) w``, with the freshness
        f stored, derived from the mask's schedule (a table of C coefficients, ``F``), or from
        two masks just after a ratio change. With ``check``: whether the updated x is finite. With
        ``wd_w`` (not None): w is formed again range by range (:meth:`_direction`, weight decay
        ``wd_w``) in the scratch just before it is read, while that range is in cache."""
        dtype = self.layout.dtype
        mul, w, f, picks, mask = xp.multiply, tv.w, tv.f, tv.picks, self.comm.mask
        if wd_w is not None:
            dt = dtype.type
            again = (dt(self.rule.eps * math.sqrt(1.0 - self.rule.betas[1] ** t)), dt(wd_w))
        moving = f is None and not tv.everything and not mask.settled(t)  # just after a ratio change
        if tv.everything:
            coef = _scalar(xp, rate_s, dtype)
        elif f is None and not moving:  # derived freshness: a table of C coefficients, one per chunk
            if xp is np:
                table = np.array([rate_s * q + rate_a * (1.0 - q) for q in F], dtype)
            else:
                Fd = xp.asarray(np.asarray(F, np.float64))
                table = (rate_s * Fd + rate_a * (1.0 - Fd)).astype(dtype)
            table = xp.concatenate((table, table))
        elif f is not None:
            cs, ca = _scalar(xp, rate_s, dtype), _scalar(xp, rate_a, dtype)
        finite = True
        for r in tv.ranges:
            lo, hi = r[0], r[1]
            tmp = tv.tmp[: hi - lo]
            wr = w[lo:hi] if wd_w is None else self._direction(xp, tv, lo, hi, w[lo:hi], *again)
            if tv.everything:
                mul(wr, coef, out=tmp)
            elif moving:  # derived freshness from two masks: built per range (a few steps per change)
                fr = mask.freshness(tv.i, t, self.rule.beta3, lo, hi, xp)
                fr *= rate_s - rate_a
                fr += rate_a
                mul(fr.astype(dtype), wr, out=tmp)
            elif f is None:
                picks.scale(table, r, wr, tmp)
            else:
                fb = f[lo:hi]
                tmp2 = self.rule.scratch.get(xp, "tmp2", hi - lo, dtype)
                mul(fb, cs, out=tmp)
                xp.subtract(dtype.type(1), fb, out=tmp2)
                tmp2 *= ca
                tmp += tmp2
                tmp *= wr
            xb = tv.x[lo:hi]
            xb -= tmp
            if check:
                sq = _sumsq(xp, xb)
                finite = (finite and math.isfinite(sq)) if xp is np else (finite & xp.isfinite(sq))
        return finite

    def _ratios(self, xp, sums):
        """``(phi_S, phi_A)`` from the four squared norms: host floats on the CPU, 0-d arrays
        on a GPU (no host read)."""
        xx, uu, xs, us = sums
        xa, ua = (max(xx - xs, 0.0), max(uu - us, 0.0)) if xp is np else (xp.maximum(xx - xs, 0.0),
                                                                           xp.maximum(uu - us, 0.0))
        sqrt = math.sqrt if xp is np else xp.sqrt
        return (trust_ratio(sqrt(xs), sqrt(us), self.rule.c_min, self.rule.c_max, xp),
                trust_ratio(sqrt(xa), sqrt(ua), self.rule.c_min, self.rule.c_max, xp))


def trust_ratio(xn, un, c_min, c_max, xp=np):
    """A layer's trust ratio ``clamp(||x|| / ||u||, c_min, c_max)``, 1 where either norm is 0
    (SLAMB's phi_S and phi_A, 1-bit LAMB's coefficient; ``slamb_trust_ratio`` in the kernels).
    Host floats with ``xp`` NumPy, else 0-d device arrays (no host read)."""
    if xp is np:
        return min(max(xn / un, c_min), c_max) if xn > 0 and un > 0 else 1.0
    ok = (xn > 0) & (un > 0)
    return xp.where(ok, xp.clip(xn / xp.where(ok, un, 1.0), c_min, c_max), 1.0)


def _starts(counts):
    """Where each tensor's values start in the payload, and its end: ``[0, c0, c0 + c1, ...]`` (host
    integers, no Python-level step per tensor)."""
    return [0] + np.cumsum(np.asarray(counts, np.int64)).tolist()


def _sumsq(xp, a):
    """``sum(a * a)``: on the CPU BLAS's dot of one cache block (float32 blocks agree with a
    float64 sum to about 1e-7) summed over blocks in float64, a host float; on a GPU in
    float64, a 0-d array."""
    if xp is np:
        return float(np.dot(a, a))
    return xp.sum(xp.square(a, dtype=np.float64))


def _scalar(xp, value, dtype):
    """A coefficient as a scalar of ``dtype`` (host) or a 0-d array of it (device)."""
    if isinstance(value, float):
        return dtype.type(value)
    return value.astype(dtype)
