"""A dense, single-process reference of docs/algorithm.md section 1 for P simulated ranks.

Written from the formulas, in float64, one tensor at a time, with no code shared with
slamb_comm except the mask indices (the masks are tested on their own).
"""

import numpy as np


class ReferenceSlamb:
    def __init__(self, xs, offsets, lr, betas=(0.9, 0.999), eps=1e-6, wd=0.0, beta3=0.99, H=100,
                 c_min=0.01, c_max=1000.0):
        self.P = len(xs)
        self.x = [[a.astype(np.float64).copy() for a in x] for x in xs]  # [rank][tensor]
        self.m = [[np.zeros_like(a) for a in x] for x in self.x]
        self.v = [[np.zeros_like(a) for a in x] for x in self.x]
        self.f = [np.ones_like(a) for a in self.x[0]]
        self.offsets = offsets
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, wd
        self.b3, self.H, self.c_min, self.c_max = beta3, H, c_min, c_max
        self.t = 0

    def _trust(self, a, b):
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        return 1.0 if na == 0 or nb == 0 else float(np.clip(na / nb, self.c_min, self.c_max))

    def step(self, grads, fused_mask):
        """grads[rank][tensor]; fused_mask: positions of M_t in the fused buffer."""
        self.t += 1
        t, P = self.t, self.P
        for r in range(P):
            for i, g in enumerate(grads[r]):
                self.m[r][i] = self.b1 * self.m[r][i] + (1 - self.b1) * g
                self.v[r][i] = self.b2 * self.v[r][i] + (1 - self.b2) * g * g
        for i, f in enumerate(self.f):
            n = f.size
            local = fused_mask[(fused_mask >= self.offsets[i]) & (fused_mask < self.offsets[i] + n)] - self.offsets[i]
            sel = np.zeros(n, bool)
            sel[local] = True
            sel = sel.reshape(f.shape)
            mean = sum(self.m[r][i] for r in range(P)) / P
            for r in range(P):
                self.m[r][i][sel] = mean[sel]
            self.f[i] = self.b3 * f
            self.f[i][sel] = 1.0
            for r in range(P):
                x = self.x[r][i]
                u = (self.m[r][i] / (1 - self.b1**t)) / (np.sqrt(self.v[r][i] / (1 - self.b2**t)) + self.eps) + self.wd * x
                phi_s = self._trust(x[sel], u[sel])
                phi_a = self._trust(x[~sel], u[~sel])
                fr = self.f[i]
                self.x[r][i] = x - (self.lr * phi_s * fr + self.lr / np.sqrt(P) * phi_a * (1 - fr)) * u
        if (t - 1) % self.H == 0:
            for i in range(len(self.f)):
                mean = sum(self.x[r][i] for r in range(P)) / P
                for r in range(P):
                    self.x[r][i] = mean.copy()
