"""Byte and time statistics of exchanges (docs/algorithm.md section 4).

Payload = the bytes a rank hands to the collective. Wire bytes estimate what crosses
each rank's link: ``2 (P - 1) / P * payload`` for a ring allreduce, ``(P - 1) * payload``
for an allgather and ``(P - 1) / P * payload`` for an all-to-all. Every record also
carries what the dense exchange of the same arrays (an allreduce of the full buffer in its
own dtype) would have moved, so ``ratio`` reads directly as "fraction of dense" for one
exchange.

A *step* is measured against one definition, everywhere (:func:`per_step`): the dense
data-parallel step, one ring allreduce of every gradient, once per optimizer step -- also on
steps where a method sends twice (SLAMB's sync steps) or nothing (DiLoCo between averages).
Every optimizer's ``step_traffic()`` reports that.
"""

import contextlib
from dataclasses import dataclass, fields, replace

__all__ = ["Traffic", "Stats", "allreduce_wire", "allgather_wire", "alltoall_wire", "broadcast_wire", "per_step"]


def allreduce_wire(payload, size):
    """Bytes a ring allreduce puts on each rank's link."""
    return 2.0 * (size - 1) / size * payload if size > 1 else 0.0


def allgather_wire(payload, size):
    """Bytes an allgather puts on each rank's link."""
    return float((size - 1) * payload)


def broadcast_wire(payload, size):
    """Bytes a pipelined (ring or chain) broadcast puts on each rank's link: the payload once."""
    return float(payload) if size > 1 else 0.0


def alltoall_wire(payload, size):
    """Bytes an all-to-all puts on each rank's link (``payload`` counts the block a rank keeps)."""
    return (size - 1) / size * payload if size > 1 else 0.0


def per_step(traffic, dense_bytes, size, steps=1):
    """``traffic`` (what ``steps`` optimizer steps sent) against the dense reference of a step:
    one ring allreduce of ``dense_bytes`` (every gradient) on ``size`` ranks, counted once per
    step whatever the method sent (docs/algorithm.md section 4)."""
    dense = int(dense_bytes) * int(steps)
    return replace(traffic, dense_payload_bytes=dense, dense_wire_bytes=allreduce_wire(dense, size))


@dataclass
class Traffic:
    """Additive totals of one or more exchanges."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    dense_payload_bytes: int = 0
    dense_wire_bytes: float = 0.0
    elements_sent: int = 0
    elements_total: int = 0
    encode_s: float = 0.0
    comm_s: float = 0.0
    decode_s: float = 0.0

    def __add__(self, other):
        return Traffic(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other):
        return Traffic(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @classmethod
    def one_call(cls, *, payload_bytes, wire_bytes, dense_bytes, size, elements_sent, elements_total, encode_s=0.0,
                 comm_s=0.0, decode_s=0.0):
        """One exchange's record: ``payload_bytes`` handed to the collectives and ``wire_bytes`` on
        this rank's link, against a dense allreduce of ``dense_bytes`` over ``size`` ranks
        (docs/algorithm.md section 4)."""
        return cls(calls=1, payload_bytes=payload_bytes, wire_bytes=wire_bytes, dense_payload_bytes=dense_bytes,
                   dense_wire_bytes=allreduce_wire(dense_bytes, size), elements_sent=elements_sent,
                   elements_total=elements_total, encode_s=encode_s, comm_s=comm_s, decode_s=decode_s)

    @property
    def ratio(self):
        """Payload bytes as a fraction of the dense exchange's payload."""
        return self.payload_bytes / self.dense_payload_bytes if self.dense_payload_bytes else 0.0

    @property
    def wire_ratio(self):
        """Wire bytes as a fraction of the dense exchange's wire bytes."""
        return self.wire_bytes / self.dense_wire_bytes if self.dense_wire_bytes else 0.0

    def as_dict(self):
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["ratio"] = self.ratio
        d["wire_ratio"] = self.wire_ratio
        return d


class Stats:
    """Running statistics of one communicator.

    Attributes:
        last: the most recent exchange (a :class:`Traffic` with ``calls == 1``).
        step: everything since the last :meth:`new_step` call.
        total: everything since construction.
        by_kind: totals per exchange kind ('masked_allreduce', 'sparse_allgather', 'sync').

    Constant memory: no per-call history is kept, so a run of any length does not grow.
    """

    def __init__(self):
        self.last = Traffic()
        self.step = Traffic()
        self.total = Traffic()
        self.by_kind = {}

    def record(self, kind, t):
        """Add one exchange's :class:`Traffic` ``t`` under ``kind`` (public: an adapter that runs an
        exchange itself, e.g. from gradient hooks, records it here so the numbers stay complete)."""
        self.last = t
        self.step = self.step + t
        self.total = self.total + t
        self.by_kind[kind] = self.by_kind.get(kind, Traffic()) + t

    @contextlib.contextmanager
    def failed(self, kind, traffic):
        """Around the part of an exchange that may raise after its collectives ran (a NaN or a
        peer's bad input found in the status words): if it raises, ``traffic()`` is recorded
        first, so bytes that crossed the network for a step every rank then skipped still count."""
        try:
            yield
        except BaseException:
            self.record(kind, traffic())
            raise

    def new_step(self):
        """Start a new step: :attr:`step` restarts from zero; returns the finished step's totals."""
        done, self.step = self.step, Traffic()
        return done

    def summary(self):
        t = self.total
        return (
            f"{t.calls} exchanges, payload {t.payload_bytes / 1e6:.3f} MB vs dense {t.dense_payload_bytes / 1e6:.3f} MB "
            f"({t.ratio:.2%} of dense); wire {t.wire_bytes / 1e6:.3f} MB vs {t.dense_wire_bytes / 1e6:.3f} MB; "
            f"encode {t.encode_s * 1e3:.1f} ms, comm {t.comm_s * 1e3:.1f} ms, decode {t.decode_s * 1e3:.1f} ms"
        )
