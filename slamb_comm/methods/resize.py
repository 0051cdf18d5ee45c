"""A checkpoint of P ranks' states made into one rank's state of a job of P' ranks (docs/algorithm.md section 10).

:func:`resize` walks every old rank's state at once (the same structure on every rank: dicts,
lists, tuples, arrays, torch tensors, numbers) and builds the state of new rank ``rank`` of
``size``:

* **What is equal on every old rank is kept, bitwise**: the step count, the mask's seed and
  schedule, the freshness (the shared mask decides it, derived or stored), the options; the
  parameters right after a periodic sync.
* **Floating-point arrays that differ are averaged** over the old ranks, summed in float64
  and cast back: SLAMB's and 1-bit LAMB's moments m and v (a full momentum average, as a
  masked exchange with ratio 1 would make it), TopK's error buffers (each rank's unsent
  gradient mass: their mean keeps the mean of what is still to be sent, which is what the
  exchange's average would deliver), 1-bit LAMB's worker errors, and parameters saved between
  syncs (a periodic sync).
* **1-bit LAMB's server errors are re-chunked**: old rank r held the server error of chunk r of
  the padded buffer; concatenated in rank order they are one vector, which the exchange cuts
  anew into the P' chunks of its own padding when it loads it (exact: no error is lost or
  counted twice). The worker errors are averaged, then padded anew.
* **Anything else that differs** (integer arrays such as random-number-generator states, a
  rank number, strings) goes to new rank ``rank`` from old rank ``rank mod P``, with a warning
  naming it: there is no mean of those.

P' = P is not a resize: :func:`slamb_comm.methods.checkpoint.load` then returns each rank its own
state, bitwise. Nothing here communicates: every new rank reads every old rank's file and
computes the same means (the same float64 sums in the same order), so every rank's kept and
averaged values are bitwise equal.
"""

import logging
import sys

import numpy as np

__all__ = ["resize"]

_log = logging.getLogger("slamb_comm")

_ONEBIT_KEYS = {"worker_error", "server_error", "rank", "size", "padded", "digest"}


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "detach") and hasattr(x, "numpy")


def _to_numpy(x):
    return x.detach().cpu().numpy() if _is_torch(x) else x


def _like(x, a):
    """``a`` (NumPy) as the type of ``x`` (a torch tensor on its device and dtype, or NumPy)."""
    if _is_torch(x):
        torch = sys.modules["torch"]
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=x.device, dtype=x.dtype)
    return a


def _same(a, b):
    """Whether two leaves are equal, bitwise for arrays (NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError):
        return False


class _Leaf:
    """What the fold keeps of one leaf: old rank 0's value (kept if every rank's is equal), the
    float64 sum of a floating-point array or float, and the value of old rank ``src``."""

    __slots__ = ("first", "equal", "sum", "mine", "n")

    def __init__(self, v, numeric, src):
        self.first, self.equal, self.n = v, True, 1
        self.sum = np.asarray(numeric, np.float64).copy() if numeric is not None else None
        self.mine = v if src == 0 else None


class _OneBit:
    """The fold of 1-bit LAMB's exchange states: the worker errors' float64 sum, the server
    errors' chunks in rank order."""

    def __init__(self, v):
        self.digest, self.padded = v["digest"], int(v["padded"])
        self.have = v["worker_error"] is not None
        self.sum = np.asarray(_to_numpy(v["worker_error"]), np.float64).copy() if self.have else None
        self.dtype = None if not self.have else np.asarray(_to_numpy(v["worker_error"])).dtype
        self.chunks = [np.asarray(_to_numpy(v["server_error"])).copy()] if self.have else []


class _Fold:
    """Old ranks' states folded in one at a time (only one old state in memory at once)."""

    def __init__(self, old_size, size, rank):
        self.P, self.size, self.rank = old_size, size, rank
        self.src = rank % old_size
        self.report = {"kept": 0, "averaged": [], "rechunked": [], "taken": []}

    @staticmethod
    def _numeric(v):
        if isinstance(v, np.ndarray) or _is_torch(v):
            a = np.asarray(_to_numpy(v))
            return a if a.dtype.kind == "f" else None
        return float(v) if isinstance(v, float) else None

    def start(self, v, path=""):
        if isinstance(v, dict):
            if _ONEBIT_KEYS <= set(v):
                return _OneBit(v)
            return type(v)((k, self.start(x, f"{path}.{k}" if path else str(k))) for k, x in v.items())
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(self.start(x, f"{path}[{i}]") for i, x in enumerate(v))
        return _Leaf(v, self._numeric(v), self.src)

    def add(self, acc, v, r, path=""):
        """Fold old rank ``r``'s state ``v`` into ``acc``."""
        if isinstance(acc, _OneBit):
            if (v["worker_error"] is not None) != acc.have:
                raise ValueError(f"{path}: some old ranks have 1-bit errors, others none")
            if acc.have:
                acc.sum += np.asarray(_to_numpy(v["worker_error"]))
                acc.chunks.append(np.asarray(_to_numpy(v["server_error"])).copy())
            return
        if isinstance(acc, dict):
            if not isinstance(v, dict) or list(v) != list(acc):
                raise ValueError(f"{path or 'the state'}: old rank {r}'s state differs in its keys from rank 0's")
            for k in acc:
                self.add(acc[k], v[k], r, f"{path}.{k}" if path else str(k))
            return
        if isinstance(acc, (list, tuple)):
            if type(v) is not type(acc) or len(v) != len(acc):
                raise ValueError(f"{path}: old rank {r}'s state differs in length from rank 0's")
            for i, (a, x) in enumerate(zip(acc, v)):
                self.add(a, x, r, f"{path}[{i}]")
            return
        leaf = acc
        if r == self.src:
            leaf.mine = v
        if leaf.equal and not _same(_to_numpy(leaf.first), _to_numpy(v)):
            leaf.equal = False
        num = self._numeric(v)
        if leaf.sum is not None and num is not None and np.shape(num) == leaf.sum.shape:
            leaf.sum += num
            leaf.n += 1
        else:
            leaf.sum = None

    def finish(self, acc, path=""):
        if isinstance(acc, _OneBit):
            self.report["rechunked"].append(path)
            return {
                "resized_from": self.P, "old_digest": acc.digest, "old_padded": acc.padded,
                "rank": self.rank, "size": self.size,
                "worker_error_full": (acc.sum / self.P).astype(acc.dtype) if acc.have else None,
                "server_error_full": np.concatenate(acc.chunks) if acc.have else None,
            }
        if isinstance(acc, dict):
            return type(acc)((k, self.finish(x, f"{path}.{k}" if path else str(k))) for k, x in acc.items())
        if isinstance(acc, (list, tuple)):
            return type(acc)(self.finish(x, f"{path}[{i}]") for i, x in enumerate(acc))
        if acc.equal:
            self.report["kept"] += 1
            return acc.first
        if acc.sum is not None and acc.n == self.P:
            self.report["averaged"].append(path)
            mean = acc.sum * (1.0 / self.P)
            if isinstance(acc.first, float):
                return float(mean)
            return _like(acc.first, mean.astype(np.asarray(_to_numpy(acc.first)).dtype))
        self.report["taken"].append(path)
        return acc.mine


def resize(states, size, rank, old_size=None):
    """New rank ``rank`` of ``size``'s state from the old ranks' states, in old rank order:
    ``states`` a list, or with ``old_size`` any iterable (a generator reading one file at a time:
    only one old state is then in memory at once, besides the float64 sums). Returns ``(state,
    report)``; ``report`` counts the kept entries and names the averaged, re-chunked and taken
    ones. Logs what it did, and a warning for what it took from one old rank.

    Raises:
        ValueError: the old ranks' states differ in structure (keys or lengths), or their
            number is not ``old_size``.
    """
    if old_size is None:
        states = list(states)
        old_size = len(states)
    P = int(old_size)
    fold = _Fold(P, size, rank)
    acc, n = None, 0
    for r, v in enumerate(states):
        if r == 0:
            acc = fold.start(v)
        else:
            fold.add(acc, v, r)
        n = r + 1
    if n != P or P < 1:
        raise ValueError(f"expected {P} old states, got {n}")
    state = fold.finish(acc)
    rep = fold.report
    _log.info("slamb_comm: checkpoint of %d ranks resized for rank %d of %d: %d entries kept, averaged %s%s",
              P, rank, size, rep["kept"], rep["averaged"][:8] or "nothing",
              f", 1-bit exchange state re-chunked at {rep['rechunked']}" if rep["rechunked"] else "")
    if rep["taken"]:
        _log.warning("slamb_comm: checkpoint resize %d -> %d ranks: %s differ per rank and have no mean; rank %d "
                     "took old rank %d's", P, size, rep["taken"][:8], rank, rank % P)
    return state, rep
