"""AdamW in float64, written out as torch computes it: the inner optimizer of the periodic
methods' reference tests (tests/test_periodic.py, mpi_tests/test_periodic.py)."""

import numpy as np


class Adam:
    """Decoupled weight decay, bias-corrected moments, on a list of float64 arrays in place."""

    def __init__(self, xs, lr=0.01, betas=(0.9, 0.999), eps=1e-8, wd=0.01):
        self.lr, self.b1, self.b2, self.eps, self.wd, self.t = lr, *betas, eps, wd, 0
        self.m = [np.zeros_like(x) for x in xs]
        self.v = [np.zeros_like(x) for x in xs]

    def step(self, xs, gs):
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for x, g, m, v in zip(xs, gs, self.m, self.v):
            x *= 1 - self.lr * self.wd
            m += (1 - self.b1) * (g - m)
            v *= self.b2
            v += (1 - self.b2) * g * g
            x -= self.lr / c1 * m / (np.sqrt(v) / np.sqrt(c2) + self.eps)
