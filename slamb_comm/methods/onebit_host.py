"""1-bit LAMB's step on NumPy arrays: :class:`OneBitHostStep`, a part that a
:class:`~slamb_comm.methods.onebit_lamb.OneBitLambRule` owns (its state and options are the rule's).
The warm-up is LAMB on the mean gradient; the compression stage exchanges the scaled momentum at 1 bit
per element and moves each tensor by its frozen LAMB coefficient times a bounded factor
(docs/onebit_lamb.md section 2). On a device the rule takes :mod:`slamb_comm.device.onebit_step` instead.
"""

import math

import numpy as np

from ..errors import NonFiniteError
from .tensorwise import trust_ratio

__all__ = ["OneBitHostStep"]


class OneBitHostStep:
    """The host step of the 1-bit LAMB rule ``rule`` (see the module docstring)."""

    def __init__(self, rule):
        self.rule = rule

    def warmup(self, xv, gv, lr):
        """The warm-up (docs/onebit_lamb.md section 2.2): LAMB on the mean gradient."""
        r = self.rule
        lay, comm = r.layout, r.comm
        dt = lay.dtype.type
        t = r.t + 1
        b1, b2 = r.betas
        # the mean gradient (the engine's dense allreduce in DeepSpeed); raises, changing nothing,
        # if any rank's gradient is not finite
        gbar = r.scratch(np, "g")
        for v, o, n in zip(gv, lay.offsets, lay.sizes):
            gbar[o : o + n] = v
        comm.sync(gbar)
        c1, c2, _ = r.corrections(t)
        sums = []
        for i, (o, n) in enumerate(lay.segments()):
            m, v, g, xi = r.m[o : o + n], r.v[o : o + n], gbar[o : o + n], xv[i]
            m *= dt(b1)
            m += dt(1.0 - b1) * g
            v *= dt(b2)
            v += dt(1.0 - b2) * (g * g)
            u = self._direction(i, c1, c2, xi)
            sums += [_sumsq(xi), _sumsq(u)]
            del u
        if t == r.freeze_step:
            r.f = r.v.copy()
        for i, (o, n) in enumerate(lay.segments()):
            xn, un = math.sqrt(sums[2 * i]), math.sqrt(sums[2 * i + 1])
            c = trust_ratio(xn, un, r.c_min, r.c_max)
            if c != 1.0:
                r.kappa[i] = r.coeff_beta * r.kappa[i] + (1.0 - r.coeff_beta) * c
            r.lamb_coeffs[i] = c
            if n:  # the direction again, as in the first pass (bitwise): no whole-model scratch for it
                xv[i] -= dt(lr * c) * self._direction(i, c1, c2, xv[i])
        r.t = t

    def _direction(self, i, c1, cv, xi):
        """Tensor ``i``'s direction ``m / (sqrt(v / cv) + eps) + weight_decay * xi``, a new
        array: computed in the first pass for the norms and again in the update pass with the
        same operations, so the two agree bit for bit."""
        r = self.rule
        o, n = r.layout.offsets[i], r.layout.sizes[i]
        dt = r.layout.dtype.type
        m, v = r.m[o : o + n], r.v[o : o + n]
        u = np.sqrt(v / dt(cv) if cv != 1.0 else v)
        u += dt(r.eps)
        np.divide(m / dt(c1) if c1 != 1.0 else m, u, out=u)
        if r.weight_decay > 0:
            u += dt(r.weight_decay) * xi
        return u

    def _scaling(self):
        """γ per tensor (first compression step): equal momentum RMS for every tensor."""
        r = self.rule
        lay = r.layout
        vals = [_sumsq(r.m[o : o + n]) for o, n in lay.segments()]
        rho = [math.sqrt(s) / math.sqrt(n) if n else 0.0 for s, n in zip(vals, lay.sizes)]
        nonempty = [r for r, n in zip(rho, lay.sizes) if n]
        rbar = sum(nonempty) / len(nonempty) if nonempty else 0.0
        return [rbar / r if r > 0 and rbar > 0 else 1.0 for r in rho]

    def compressed(self, xv, gv, lr):
        """The compression stage (docs/onebit_lamb.md section 2.3): the 1-bit exchange of the scaled momentum."""
        r = self.rule
        lay, comm = r.layout, r.comm
        dt = lay.dtype.type
        t = r.t + 1
        b1, b2 = r.betas
        gamma = r.gamma if r.gamma is not None else self._scaling()
        if r.f is None:  # freeze_step == 0: no warm-up, the fresh second moment starts from v
            r.f = r.v.copy()
        # this rank's scaled momentum, exchanged (m itself is untouched until the exchange succeeded)
        M = r.scratch(np, "g")
        for i, (o, n) in enumerate(lay.segments()):
            mi = M[o : o + n]
            np.multiply(r.m[o : o + n], dt(b1), out=mi)
            mi += dt(1.0 - b1) * gv[i]
            mi *= dt(gamma[i])
        if comm.size > 1:
            r.exchange.allreduce(M)
        elif not np.isfinite(np.sum(M, dtype=np.float64)):
            raise NonFiniteError(f"1-bit LAMB step {t}: non-finite gradient", (0,))
        r.gamma = gamma
        c1, cv, cf = r.corrections(t)
        eps, wd = dt(r.eps), dt(r.weight_decay)
        sums = []
        for i, (o, n) in enumerate(lay.segments()):
            if not n:
                continue
            mn, m, v, f, xi = M[o : o + n], r.m[o : o + n], r.v[o : o + n], r.f[o : o + n], xv[i]
            mn /= dt(gamma[i])
            ghat = mn - dt(b1) * m
            ghat /= dt(1.0 - b1)
            f *= dt(b2)
            f += dt(1.0 - b2) * (ghat * ghat)
            del ghat
            m[...] = mn
            d = np.sqrt(v / dt(cv) if cv != 1.0 else v)
            d += eps
            # the direction only for its norms (with weight decay); the update pass recomputes it
            u = np.divide(m / dt(c1) if c1 != 1.0 else m, d) if r.weight_decay > 0 else None
            df = np.sqrt(f / dt(cf) if cf != 1.0 else f)
            df += eps
            d /= df
            ratio = d.max()
            del d, df
            if u is not None:
                sums += [ratio, _sumsq(u)]
                u += wd * xi
                sums.append(_sumsq(u))
                del u
            else:
                sums.append(ratio)
        self._factors_and_update(xv, [float(v) for v in sums], lr, c1, cv)
        r.t = t

    def _factors_and_update(self, xv, vals, lr, c1, cv):
        """Steps 9-11 per tensor, from the host values ``vals`` of the moments pass (per tensor
        with elements: the largest ratio, then with weight decay ``||u0||²`` and ``||u||²``)."""
        r = self.rule
        dt = r.layout.dtype.type
        k = 0
        for i, n in enumerate(r.layout.sizes):
            if not n:
                continue
            factor = vals[k]
            k += 1
            if r.weight_decay > 0:
                u0n, un = math.sqrt(vals[k]), math.sqrt(vals[k + 1])
                k += 2
                w = min(1.0, u0n / un) if un > 0 else 1.0
                factor = factor * w + (1.0 - w)
            factor = _clamp(factor, r.factor_min, r.factor_max)
            last = r.phi[i]
            factor = _clamp(factor, last * (1.0 - r.factor_threshold), last * (1.0 + r.factor_threshold))
            r.phi[i] = factor
            coeff = r.kappa[i] * factor
            r.lamb_coeffs[i] = coeff
            xv[i] -= dt(lr * coeff) * self._direction(i, c1, cv, xv[i])


def _sumsq(a):
    return float(np.dot(a, a))


def _clamp(v, lo, hi):
    return min(max(v, lo), hi)
