"""Checks collected on every rank of an MPI test and asserted together (after the test's last
collective, so a failed check never leaves another rank waiting), ``call`` to catch a
collective's exception for checking on every rank, and the transports that carry device
(CuPy) buffers, by name."""

import numpy as np
from mpi4py import MPI

import slamb_comm as sc

WORLD = MPI.COMM_WORLD
ME = WORLD.rank


def call(fn, *args, **kw):
    """Run a collective call; return (result, exception) instead of raising."""
    try:
        return fn(*args, **kw), None
    except Exception as e:  # noqa: BLE001 -- we check the type afterwards, on every rank
        return None, e


class Checks:
    """Collect failures; :meth:`done` raises on every rank if any rank had one. ``RTOL``/``ATOL``:
    :meth:`close`'s default tolerances (a subclass sets its own). ``chk(cond, msg)`` is
    ``chk.true(cond, msg)``."""

    RTOL, ATOL = 1e-6, 1e-6

    def __init__(self):
        self.failures = []

    def true(self, cond, msg):
        if not bool(cond):
            self.failures.append(f"rank {ME}: {msg}")

    __call__ = true

    def equal(self, a, b, msg):
        a, b = np.asarray(a), np.asarray(b)
        ok = a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        if not ok:
            self.failures.append(f"rank {ME}: {msg}: not equal ({self._diff(a, b)})")

    def close(self, a, b, msg, rtol=None, atol=None):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rtol, atol = self.RTOL if rtol is None else rtol, self.ATOL if atol is None else atol
        if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=atol):
            self.failures.append(f"rank {ME}: {msg}: not close ({self._diff(a, b)})")

    def within(self, got, want, bound, msg):
        """|got - want| <= bound, element-wise."""
        err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        if not np.all(err <= bound):
            i = int(np.argmax(err - bound))
            self.failures.append(f"rank {ME}: {msg}: error {err[i]:.3g} > bound {np.broadcast_to(bound, err.shape)[i]:.3g} at {i}")

    def raised(self, err, exc, msg, ranks=None):
        if not isinstance(err, exc):
            self.failures.append(f"rank {ME}: {msg}: expected {exc.__name__}, got {err!r}")
        elif ranks is not None and tuple(err.ranks) != tuple(ranks):
            self.failures.append(f"rank {ME}: {msg}: {exc.__name__}.ranks == {err.ranks}, expected {tuple(ranks)}")

    @staticmethod
    def _diff(a, b):
        if a.shape != b.shape:
            return f"shapes {a.shape} vs {b.shape}"
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        d = np.where(np.isnan(d), np.inf, d)
        return f"max |diff| {d.max():.3g} at {int(d.argmax())}, {int(np.count_nonzero(d))} differ" if d.size else "empty"

    def done(self):
        failures = [f for fs in WORLD.allgather(self.failures) for f in fs]
        assert not failures, "\n".join(failures[:30])


#: the transports for CuPy buffers: MPI staged through the host, CUDA-aware MPI, NCCL
DEVICE_TRANSPORTS = ["mpi-staged", "mpi-direct", "nccl"]


def device_transport(kind):
    """A transport of :data:`DEVICE_TRANSPORTS` by name."""
    if kind == "mpi-staged":
        return sc.MPITransport(cuda_aware=False)
    if kind == "mpi-direct":
        return sc.MPITransport(cuda_aware=True)
    return sc.NCCLTransport(abort_on_exception=False)
