"""What every optimizer of the package counts, written once: :class:`StepLedger`.

Two records, kept the same way by SLAMB, 1-bit LAMB, DeMo, the top-k optimizers, DiLoCo and its
relatives and the DDP hook states:

* **Skipped steps.** A step with a NaN or Inf gradient on some rank is skipped on every rank alike.
  Where the core rule decided it, the rule counted it (``rule.skipped_steps``); where the adapter
  decided it (a distributed agreement before the rule ran), :meth:`StepLedger.skip` counts and logs
  it here. :meth:`StepLedger.skipped_steps` is their sum; the adapter never writes the rule's count.
* **Traffic.** :meth:`StepLedger.traffic` hands out the bytes of the steps since its last call: each
  exchange's :class:`slamb_comm.Stats` starts a new step, the records are summed, and, where the
  optimizer says how many steps it took, the dense reference of those steps is put beside them
  (one dense allreduce of every gradient per step, docs/algorithm.md section 4).
"""

import logging

from slamb_comm.wire.stats import Traffic, per_step

__all__ = ["StepLedger"]

_log = logging.getLogger("slamb_comm")


class StepLedger:
    """Skipped steps and traffic of one optimizer (see the module docstring).

    Args:
        what: the optimizer's name in the log ("SLAMB", "top-k", ...).
    """

    __slots__ = ("what", "skips", "counted")

    def __init__(self, what):
        self.what = what
        self.skips = 0  # steps the adapter skipped on every rank before a core rule ran
        self.counted = 0  # steps whose bytes traffic() handed out (its ``steps`` so far)

    def skip(self, err):
        """Count a step skipped on every rank (``err`` says why) and log it."""
        self.skips += 1
        _log.warning("slamb_comm: %s step skipped on every rank (%d so far): %s", self.what, self.skips, err)

    def skipped_steps(self, rules=()):
        """The steps skipped so far: those the core ``rules`` counted (the most of any, as every
        rule of an optimizer skips the same steps) and those :meth:`skip` counted."""
        return max((r.skipped_steps for r in rules), default=0) + self.skips

    def traffic(self, stats, dense_bytes=0, size=1, steps=None):
        """The bytes since the last call: the sum of every ``stats`` (a :class:`slamb_comm.Stats`
        each)'s new step, and start counting anew. ``steps``: the optimizer's steps so far (taken,
        or skipped on every rank after they sent); given, the dense reference of the steps since
        the last call is put beside the bytes (``dense_bytes`` per step on ``size`` ranks)."""
        total = Traffic()
        for s in stats:
            total = total + s.new_step()
        if steps is None:
            return total
        since, self.counted = max(steps - self.counted, 0), steps
        return per_step(total, dense_bytes, size, since)

    def restart(self, steps):
        """After a load: the steps so far are ``steps``; the next :meth:`traffic` counts from there."""
        self.counted = steps
