"""Dense references of docs/algorithm.md sections 1 and 2 for the torch adapters' MPI tests, with the
small model and the seeded per-rank data they share (no collective here: the tests bring their
framework's, Horovod's or torch.distributed's).

Every rank can recompute every rank's gradient from the seeded data (``grads_at``), so a test
runs the references for all P ranks in one process: :class:`RefSlamb` (section 1, float64) and
:class:`RefTopK` (section 2, float32 like the wire, with the wrapped torch optimizer stepping a
twin model on the mean).
"""

import math

import numpy as np
import torch

import slamb_comm

D_IN, D_OUT, BATCH = 6, 3, 16
# weights 6x32=192 and 24x3=72 are below the threshold (always dense), 32x32 and 32x24 are
# compressible, the biases are 1-D (always dense).
THRESHOLD = 300


def make_model(seed=0):
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 24), torch.nn.Tanh(), torch.nn.Linear(24, D_OUT))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.4)
    return model


SHAPES = [tuple(p.shape) for p in make_model(0).parameters()]
SIZES = [int(np.prod(s)) for s in SHAPES]
STARTS = np.concatenate([[0], np.cumsum(SIZES)]).astype(int)
N_ALL = int(STARTS[-1])


def batch(rank, step, salt=0):
    g = torch.Generator().manual_seed(100003 * salt + 1009 * step + rank)
    x = torch.randn(BATCH, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, D_OUT, generator=g, dtype=torch.float64)
    return x.float(), y.float()


def loss_of(model, rank, step, salt=0):
    x, y = batch(rank, step, salt)
    return torch.nn.functional.mse_loss(model(x), y)


def flat_params(model):
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])


def flat_of(tensors):
    return np.concatenate([torch.as_tensor(t).detach().double().reshape(-1).numpy() for t in tensors])


def set_flat(model, flat):
    with torch.no_grad():
        for p, a, n in zip(model.parameters(), STARTS, SIZES):
            p.copy_(torch.from_numpy(np.asarray(flat[a:a + n]).reshape(p.shape)).to(p.dtype))


def grads_at(flat_x, rank, step, salt=0):
    """Rank ``rank``'s gradient (every tensor, float32 computation, as float64) at ``flat_x``."""
    model = make_model(0)
    set_flat(model, flat_x)
    loss_of(model, rank, step, salt).backward()
    return np.concatenate([p.grad.reshape(-1).double().numpy() for p in model.parameters()])


def close(a, b, rtol=2e-4, atol=2e-5):
    return np.allclose(a, b, rtol=rtol, atol=atol)


def maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


class RefSlamb:
    """docs/algorithm.md section 1, densely, in float64, for ``rows`` simulated ranks over the tensors
    ``shapes`` (one SLAMB bucket). ``P`` is the number of ranks of the exchange (the divisor of the
    momentum mean and the ``lr / sqrt(P)`` of stale elements). ``step(..., active=rows)``: only
    those rows step (a joined rank contributes zeros to the mean; the periodic sync averages the
    rows that step). ``m0, v0, t0, f0``: a state to start from."""

    def __init__(self, x0, shapes, P, lr, betas=(0.9, 0.999), eps=1e-6, wd=0.0, beta3=0.99, H=100, rows=None,
                 m0=None, v0=None, t0=0, f0=None, c_min=0.01, c_max=1000.0):
        self.P = P
        self.rows = P if rows is None else rows
        self.sizes = [int(np.prod(s)) for s in shapes]
        self.starts = np.cumsum([0] + self.sizes[:-1])
        n = sum(self.sizes)
        x0 = np.asarray(x0, np.float64)
        self.x = np.tile(x0, (self.rows, 1)) if x0.ndim == 1 else x0.copy()
        self.m = np.zeros((self.rows, n)) if m0 is None else np.tile(np.asarray(m0, np.float64), (self.rows, 1))
        self.v = np.zeros((self.rows, n)) if v0 is None else np.tile(np.asarray(v0, np.float64), (self.rows, 1))
        self.f = np.ones(n) if f0 is None else np.asarray(f0, np.float64).copy()
        self.t = t0
        self.lr, self.b1, self.b2, self.eps, self.b3, self.H = lr, betas[0], betas[1], eps, beta3, H
        self.wd, self.c_min, self.c_max = wd, c_min, c_max

    def _per_layer(self, a):
        return np.sqrt(np.add.reduceat(a, self.starts))

    def _phi(self, xn, un):
        ok = (xn > 0) & (un > 0)
        return np.where(ok, np.clip(xn / np.where(ok, un, 1.0), self.c_min, self.c_max), 1.0)

    def step(self, grads, mask, active=None, skip=()):
        """``skip``: tensors without a gradient on any rank at this step, left exactly as they are
        (no moment decay, no update, freshness unchanged); they still count in the periodic sync."""
        active = list(range(self.rows)) if active is None else list(active)
        self.t = t = self.t + 1
        b1, b2 = self.b1, self.b2
        keep = np.ones(self.m.shape[1], bool)
        for i in skip:
            keep[self.starts[i]:self.starts[i] + self.sizes[i]] = False
        mask = np.asarray(mask)[keep[np.asarray(mask)]] if len(mask) else np.asarray(mask, int)
        for r in active:                                             # 1. local moments
            self.m[r][keep] = b1 * self.m[r][keep] + (1 - b1) * grads[r][keep]
            self.v[r][keep] = b2 * self.v[r][keep] + (1 - b2) * grads[r][keep] * grads[r][keep]
        mean = sum(self.m[r][mask] for r in active) / self.P         # 3. masked momentum mean
        for r in active:
            self.m[r][mask] = mean
        self.f[keep] = self.b3 * self.f[keep]                        # 4. freshness
        self.f[mask] = 1.0
        fresh = self.f == 1.0
        for r in active:
            mhat, vhat = self.m[r] / (1 - b1 ** t), self.v[r] / (1 - b2 ** t)
            u = mhat / (np.sqrt(vhat) + self.eps) + self.wd * self.x[r]  # 5. Adam direction
            x2, u2 = self.x[r] ** 2, u ** 2                          # 6. trust ratios on S and A
            phi_s = np.repeat(self._phi(self._per_layer(x2 * fresh), self._per_layer(u2 * fresh)), self.sizes)
            phi_a = np.repeat(self._phi(self._per_layer(x2 * ~fresh), self._per_layer(u2 * ~fresh)), self.sizes)
            rate = self.lr * phi_s * self.f + self.lr / math.sqrt(self.P) * phi_a * (1 - self.f)
            self.x[r][keep] = (self.x[r] - rate * u)[keep]           # 7. element-wise update
        if (t - 1) % self.H == 0:                                    # 8. periodic sync (the ranks stepping)
            xm = sum(self.x[r] for r in active) / len(active)
            for r in active:
                self.x[r] = xm.copy()


def replay_freshness(mask_of, steps, n, beta3):
    """The freshness after ``steps`` steps of the masks ``mask_of(t)`` (docs/algorithm.md
    section 1, step 4)."""
    f = np.ones(n)
    for t in range(1, steps + 1):
        f = beta3 * f
        f[np.asarray(mask_of(t))] = 1.0
    return f


def topk_counts(ratio, dense_threshold=None, shapes=SHAPES):
    """Per tensor, how many entries a rank sends: all of an always-dense tensor, else k_elems."""
    out = []
    for s in shapes:
        n = int(np.prod(s))
        dense = dense_threshold is not None and (len(s) <= 1 or n < dense_threshold)
        out.append(n if dense else slamb_comm.k_elems(ratio, n))
    return out


class RefTopK:
    """docs/algorithm.md section 2 for ``rows`` simulated ranks (float32 like the wire), and the wrapped
    torch optimizer stepping a twin model on the mean."""

    def __init__(self, twin, twin_opt, counts, rows):
        self.model, self.opt, self.counts = twin, twin_opt, counts
        self.errors = np.zeros((rows, N_ALL), np.float32)

    def x(self):
        return flat_params(self.model)

    def exchange(self, grads, P, active, tensors=None):
        """The mean over ``P`` ranks of the decoded top-k of the ``active`` rows (a rank outside
        ``active`` contributes zeros); ``tensors``: which tensors are exchanged (default all)."""
        tensors = [True] * len(SIZES) if tensors is None else tensors
        total = np.zeros(N_ALL, np.float32)
        for r in active:
            c = np.asarray(grads[r], np.float32) + self.errors[r]
            for i, (a, n, k) in enumerate(zip(STARTS, SIZES, self.counts)):
                if not tensors[i]:
                    continue
                seg = c[a:a + n]
                idx = np.argsort(-np.abs(seg), kind="stable")[:k]  # ties: the lower index
                dec = np.zeros(n, np.float32)
                dec[idx] = seg[idx]
                self.errors[r][a:a + n] = seg - dec
                total[a:a + n] += dec
        return total * np.float32(1.0 / P)

    def apply(self, mean, tensors=None):
        tensors = [True] * len(SIZES) if tensors is None else tensors
        for i, (p, a, n) in enumerate(zip(self.model.parameters(), STARTS, SIZES)):
            p.grad = torch.from_numpy(mean[a:a + n].reshape(p.shape).copy()) if tensors[i] else None
        self.opt.step()

    def local(self, grad):
        """The wrapped optimizer on a local gradient (no exchange)."""
        self.apply(np.asarray(grad, np.float32))


def topk_close(a, b):
    return np.allclose(a, b, rtol=1e-5, atol=1e-6)
