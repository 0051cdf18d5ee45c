"""docs/onebit_lamb.md section 1 written out densely in float64, for all P ranks in one process.

Used by tests/test_onebit_local.py and mpi_tests/test_onebit.py: every rank can compute every
rank's inputs from seeds and so the exchange's exact result, its own error buffers included.
Written from the page, not from slamb_comm.exchange.onebit: only NumPy is used.
"""

import math

import numpy as np


def padded(n, P):
    """N': the smallest multiple of P * lcm(P, 8) that is >= n (at least one multiple)."""
    q = P * (P * 8 // math.gcd(P, 8))
    return max(1, -(-n // q)) * q


def sgn(z):
    """+1 where z >= 0, else -1."""
    return np.where(z >= 0, 1.0, -1.0)


def exchange(xs, worker_errors=None, server_errors=None, scale_dtype=np.float64):
    """One call of the compressed allreduce.

    Args:
        xs: the P ranks' inputs (1-D, N elements each).
        worker_errors, server_errors: the P ranks' error buffers (N' and N'/P elements), or None
            for zeros.
        scale_dtype: the dtype the scales travel in (each scale is rounded to it once).

    Returns:
        (y, worker_errors, server_errors): y the result (N elements, the same on every rank), and
        the P ranks' new error buffers.
    """
    P, N = len(xs), xs[0].size
    Np = padded(N, P)
    nc = Np // P
    we = worker_errors if worker_errors is not None else [np.zeros(Np)] * P
    se = server_errors if server_errors is not None else [np.zeros(nc)] * P
    # 1-3: worker
    c = [np.concatenate([np.asarray(x, np.float64), np.zeros(Np - N)]) + e for x, e in zip(xs, we)]
    s = [float(np.asarray(math.sqrt(float(np.sum(ci * ci))) / math.sqrt(Np)).astype(scale_dtype)) for ci in c]
    new_we = [ci - si * sgn(ci) for ci, si in zip(c, s)]
    # 5-7, 9: server k of chunk k
    y = np.zeros(Np)
    new_se = []
    for k in range(P):
        u = np.zeros(nc)
        for j in range(P):
            u += sgn(c[j][k * nc : (k + 1) * nc]) * (s[j] * (1.0 / P))
        u += se[k]
        sig = float(np.asarray(math.sqrt(float(np.sum(u * u))) / math.sqrt(nc)).astype(scale_dtype))
        new_se.append(u - sig * sgn(u))
        y[k * nc : (k + 1) * nc] = sig * sgn(u)
    return y[:N], new_we, new_se


class OneBitLambReference:
    """docs/onebit_lamb.md section 2 with section 3's choices, all P ranks in one process, float64.

    ``step(x, grads)``: ``x`` the parameters (a list of 1-D per-tensor float64 arrays, the same
    on every rank, updated in place), ``grads`` the P ranks' gradients (a list over ranks of
    lists of per-tensor arrays, of any shape).
    """

    def __init__(self, sizes, P, lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, bias_correction=False):
        self.sizes, self.P = list(sizes), P
        self.lr, self.T0, self.betas, self.eps, self.wd = lr, freeze_step, betas, eps, weight_decay
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.fmax, self.fmin, self.th = factor_max, factor_min, factor_threshold
        self.bc = bias_correction
        T = len(self.sizes)
        self.m = [np.zeros(n) for n in self.sizes]
        self.v = [np.zeros(n) for n in self.sizes]
        self.f = None
        self.kappa, self.phi, self.gamma = [0.0] * T, [1.0] * T, None
        self.we = self.se = None
        self.t = 0

    def step(self, x, grads):
        self.t += 1
        t, (b1, b2), eps, wd = self.t, self.betas, self.eps, self.wd
        if t <= self.T0:
            for i, n in enumerate(self.sizes):
                g = np.mean([np.ravel(gr[i]) for gr in grads], axis=0)
                self.m[i] = b1 * self.m[i] + (1 - b1) * g
                self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                mh = self.m[i] / (1 - b1**t) if self.bc else self.m[i]
                vh = self.v[i] / (1 - b2**t) if self.bc else self.v[i]
                u = mh / (np.sqrt(vh) + eps)
                if wd > 0:
                    u = u + wd * x[i]
                xn, un = np.linalg.norm(x[i]), np.linalg.norm(u)
                c = min(max(xn / un, self.min_coeff), self.max_coeff) if xn != 0 and un != 0 else 1.0
                if c != 1.0:
                    self.kappa[i] = self.coeff_beta * self.kappa[i] + (1 - self.coeff_beta) * c
                x[i] -= self.lr * c * u
            if t == self.T0:
                self.f = [v.copy() for v in self.v]
            return
        if self.f is None:
            self.f = [v.copy() for v in self.v]
        m_last = [m.copy() for m in self.m]
        if self.gamma is None:
            rho = [np.linalg.norm(m) / np.sqrt(n) if n else 0.0 for m, n in zip(self.m, self.sizes)]
            nonempty = [r for r, n in zip(rho, self.sizes) if n]
            rbar = sum(nonempty) / len(nonempty) if nonempty else 0.0
            self.gamma = [rbar / r if r > 0 and rbar > 0 else 1.0 for r in rho]
        Ms = [np.concatenate([self.gamma[i] * (b1 * self.m[i] + (1 - b1) * np.ravel(gr[i]))
                              for i in range(len(self.sizes))])
              for gr in grads]
        if self.P > 1:
            y, self.we, self.se = exchange(Ms, self.we, self.se)
        else:
            y = Ms[0]
        o = 0
        for i, n in enumerate(self.sizes):
            seg, o = y[o : o + n], o + n
            if not n:
                continue
            self.m[i] = seg / self.gamma[i]
            ghat = (self.m[i] - b1 * m_last[i]) / (1 - b1)
            self.f[i] = b2 * self.f[i] + (1 - b2) * ghat * ghat
            c1 = 1 - b1**t if self.bc else 1.0
            cv = 1 - b2**self.T0 if self.bc else 1.0
            cf = 1 - b2**t if self.bc else 1.0
            d = np.sqrt(self.v[i] / cv) + eps
            u0 = (self.m[i] / c1) / d
            u = u0 + wd * x[i] if wd > 0 else u0
            factor = float(np.max(d / (np.sqrt(self.f[i] / cf) + eps)))
            if wd > 0:
                un = np.linalg.norm(u)
                w = min(1.0, np.linalg.norm(u0) / un) if un > 0 else 1.0
                factor = factor * w + (1 - w)
            factor = min(max(factor, self.fmin), self.fmax)
            factor = min(max(factor, self.phi[i] * (1 - self.th)), self.phi[i] * (1 + self.th))
            self.phi[i] = factor
            x[i] -= self.lr * self.kappa[i] * factor * u
