"""DeMo's rule written out densely in float64 (docs/algorithm.md section 13): the reference of
tests/test_demo.py and mpi_tests/test_demo.py. The DCT-II is its defining sum, chunk by chunk."""

import math

import numpy as np


def dct_table(s):
    """T[u, n] = a_u cos(pi (2 n + 1) u / (2 s)), a_0 = sqrt(1/s), a_u = sqrt(2/s): the DCT-II, term by term."""
    t = np.empty((s, s))
    for u in range(s):
        a = math.sqrt((1.0 if u == 0 else 2.0) / s)
        for n in range(s):
            t[u, n] = a * math.cos(math.pi * (2 * n + 1) * u / (2 * s))
    return t


def ref_extract(m, s, k, vdtype):
    """q for one tensor: each s x s block (1-D: run of s) of the zero-padded tensor, its DCT-II
    ``C[u, v] = sum_a sum_b T[u, a] T[v, b] X[a, b]``, the k largest |C| (values rounded to
    ``vdtype``), their inverse ``X[a, b] = sum_u sum_v T[u, a] T[v, b] C[u, v]``, unpadded.
    Returns q and, per chunk, the set of kept indices (None where the k-th and (k+1)-th |C| tie:
    padding makes exact ties, e.g. a block of one real column; which one is kept changes no
    value of q on the tensor)."""
    t = dct_table(s)
    a = m.reshape(1, -1) if m.ndim <= 1 else m.reshape(m.shape[0], -1)
    r, c = a.shape
    one_d = m.ndim <= 1
    nr, nc = (1 if one_d else -(-r // s)), -(-c // s)
    pad = np.zeros((nr * (1 if one_d else s), nc * s))
    pad[:r, :c] = a
    out, kept = np.zeros_like(pad), []
    for i in range(nr):
        for j in range(nc):
            if one_d:
                x = pad[0, j * s : (j + 1) * s]
                coef = np.einsum("ua,a->u", t, x)
            else:
                x = pad[i * s : (i + 1) * s, j * s : (j + 1) * s]
                coef = np.einsum("ua,vb,ab->uv", t, t, x).ravel()
            kk = min(k, coef.size)
            sel = np.argsort(-np.abs(coef), kind="stable")[:kk]
            sparse = np.zeros_like(coef)
            sparse[sel] = coef[sel].astype(vdtype).astype(np.float64)
            mags = np.sort(np.abs(coef))[::-1]
            tie = kk < coef.size and mags[kk - 1] - mags[kk] <= 1e-9 * mags[0]
            kept.append(None if tie else set(sel.tolist()))
            if one_d:
                out[0, j * s : (j + 1) * s] = np.einsum("ua,u->a", t, sparse)
            else:
                out[i * s : (i + 1) * s, j * s : (j + 1) * s] = np.einsum("ua,vb,uv->ab", t, t, sparse.reshape(s, s))
    return out[:r, :c].reshape(m.shape), kept


class RefDeMo:
    """The rule for P ranks, densely: m_r = beta m_r + g_r; q_r = extract(m_r); m_r -= q_r;
    Q = mean_r q_r; x = (1 - lr wd) x - lr sign(Q)."""

    def __init__(self, x, P, lr, beta, wd, s, k, vdtype):
        self.x = [np.array(a, np.float64) for a in x]
        self.m = [[np.zeros_like(a) for a in self.x] for _ in range(P)]
        self.lr, self.beta, self.wd, self.s, self.k, self.vdtype = lr, beta, wd, s, k, vdtype

    def step(self, grads):
        qs = []
        for mr, gr in zip(self.m, grads):
            qr = []
            for i, g in enumerate(gr):
                mr[i] = self.beta * mr[i] + np.asarray(g, np.float64)
                q, _ = ref_extract(mr[i], self.s, self.k, self.vdtype)
                mr[i] = mr[i] - q
                qr.append(q)
            qs.append(qr)
        for i in range(len(self.x)):
            Q = sum(qr[i] for qr in qs) / len(qs)
            self.x[i] = (1.0 - self.lr * self.wd) * self.x[i] - self.lr * np.sign(Q)
