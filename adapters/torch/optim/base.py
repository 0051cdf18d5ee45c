"""The bucketed torch optimizer: :class:`BucketedOptimizer`, the base of SLAMB and 1-bit LAMB.

What is the same for every method whose core rule steps fused buckets of parameters lives here,
once: the buckets (built from the parameter groups, rebuilt keeping the state when groups are added
or a checkpoint's buckets differ), the import of a saved state and its export into torch's state,
``load_state_dict``, the steps taken, the skipped steps and the traffic (:class:`~.ledger.StepLedger`).
A method is a configuration of it: what keys a bucket (:meth:`BucketedOptimizer.knobs`), what core
rule steps it (:meth:`BucketedOptimizer.build_bucket`), how its state reads from and writes into
torch's (:meth:`BucketedOptimizer.import_state`, :meth:`BucketedOptimizer.publish`), and its
``step``. The distributed optimizers (:mod:`..distributed`) reach the buckets through these public
methods only.
"""

import torch

from slamb_comm.exchange.communicator import Communicator
from slamb_comm.exchange.transports import LocalTransport

from ..params import saved_state_by_param
from ..tensors import state_dtype
from ..transport import multi_rank_job
from .bucket import Bucket, BucketKey
from .ledger import StepLedger

__all__ = ["BucketedOptimizer"]


class BucketedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose trainable parameters are fused into buckets, one core rule
    per bucket (see the module docstring).

    Args:
        params, defaults: as ``torch.optim.Optimizer``'s; every group is checked by :meth:`check_group`.
        transport: the ranks' transport (what a distributed wrapper passes; None: one process).
        names: ``id(parameter) -> name`` (for errors and layouts; default ``group<i>.<j>``).
        build: build the buckets now (collective when distributed), or let the caller build them
            (:meth:`rebuild_buckets`).

    A configuration provides :meth:`check_group`, :meth:`knobs`, :meth:`build_bucket`,
    :meth:`import_state`, :meth:`publish` and ``step``; it may refine :meth:`settle` and
    :meth:`keeps_buckets`.
    """

    #: the method's name in messages and logs
    what = "optimizer"
    #: whether an invalid option found by the constructor in a job of several ranks waits (in
    #: :attr:`problem`) for the construction agreement of the distributed optimizer that wraps this one
    defers_problems = True

    def __init__(self, params, defaults, *, transport=None, names=None, build=True):
        #: this rank's invalid option (a ConfigError), kept by the constructor of a distributed optimizer, or of
        #: one to be wrapped in a job of several ranks: building the buckets raises it, distributed after the
        #: construction agreement, so that the other ranks raise PeerError naming this rank and the option
        self.problem = None
        self._constructing = transport is not None or (self.defers_problems and multi_rank_job())
        self._check(defaults)
        self._buckets = None  # before torch's constructor calls add_param_group
        self._built = []  # the buckets last built (their state is kept by the next build)
        super().__init__(params, defaults)
        self._constructing = False
        self.transport = transport
        self.names = names or {}
        self.ledger = StepLedger(self.what)
        #: the parameters (of every group, in order) when the buckets were last built
        self.params_built = []
        if build and (self.problem is None or transport is not None):  # alone: the problem waits for its first use
            self.rebuild_buckets()

    def _check(self, group):
        """:meth:`check_group`; during the construction of a distributed optimizer (or of one to be wrapped,
        in a job of several ranks) its error is kept in :attr:`problem` instead of raised."""
        try:
            self.check_group(group)
        except (ValueError, TypeError) as err:  # ConfigError, DTypeError, a value that is not a number
            if not self._constructing:
                raise
            self.problem = self.problem or err

    # ------------------------------------------------------------------ what a configuration provides
    def check_group(self, group):
        """ConfigError naming the first of ``group``'s options out of its range."""
        raise NotImplementedError

    def knobs(self, group):
        """The options of ``group`` that its parameters' bucket is keyed by (hashable)."""
        raise NotImplementedError

    def build_bucket(self, bucket, transport):
        """Give ``bucket`` its Communicator (``bucket.comm``) and core rule (``bucket.rule``) on
        ``transport`` (collective when distributed)."""
        raise NotImplementedError

    def import_state(self, bucket, raw):
        """Load ``raw`` (parameter -> its saved state dict) into ``bucket`` exactly (fresh state for a
        parameter missing there), then :meth:`publish` it."""
        raise NotImplementedError

    def publish(self, bucket):
        """Point each parameter's torch state at ``bucket``'s (views of the core's buffers)."""
        raise NotImplementedError

    def settle(self, bucket):
        """Whether ``bucket``'s last step, decided on the device, turned out skipped there (its torch
        state is then published again). None decide on the device by default."""
        return False

    def built(self, buckets):
        """Called when the buckets were (re)built: nothing by default."""

    def keeps_buckets(self, buckets, ages):
        """After ``load_state_dict``: whether the loaded groups and step counts (``ages``: parameter ->
        its saved step) still fit ``buckets``; else they are rebuilt."""
        return True

    # ------------------------------------------------------------------ the buckets
    @property
    def buckets(self):
        """The buckets (a list of :class:`~.bucket.Bucket`), built anew first if parameter groups
        were added since they were built (collective when distributed)."""
        if not isinstance(self._buckets, list):
            self.rebuild_buckets()
        return self._buckets

    @property
    def ready_buckets(self):
        """The buckets as built, or None while parameter groups added since wait for :attr:`buckets`
        to rebuild them (read without building: from a hook, say)."""
        return self._buckets if isinstance(self._buckets, list) else None

    def settled_buckets(self):
        """:attr:`buckets`, each told whether its last step was skipped on the device (:meth:`settle`)."""
        buckets = self.buckets
        for b in buckets:
            if self.settle(b):
                self.publish(b)
        return buckets

    def rebuild_buckets(self, ages=None):
        """Bucket the trainable parameters by (device, compute dtype, :meth:`knobs`, step count) and
        build each bucket's rule, keeping the state they have (``ages``: parameter -> its step count,
        by default read from that state). Collective when distributed: a :attr:`problem` of this rank is raised
        after the first bucket's construction agreement (its Communicator's), where the others learn of it."""
        if self.problem is not None:
            if self.transport is not None:
                Communicator(self.transport, [], problem=self.problem)  # raises it, the others PeerError
            raise self.problem
        saved = {p: dict(self.state[p]) for b in self._built for p in b.params}
        if ages is None:
            ages = {p: int(float(st["step"])) for p, st in saved.items()}
        transport = self.transport if self.transport is not None else LocalTransport()
        keyed = {}
        for gi, g in enumerate(self.param_groups):
            knobs = self.knobs(g)
            for j, p in enumerate(g["params"]):
                if not p.requires_grad:
                    continue
                # parameters that already have state at another step (added by add_param_group)
                # cannot share a bucket, whose step count is one
                key = BucketKey(str(p.device), str(state_dtype(p.dtype)), knobs, ages.get(p, 0))
                keyed.setdefault(key, []).append((p, g, self.names.get(id(p), f"group{gi}.{j}")))
        buckets = []
        for key, items in keyed.items():
            params, groups, names = ([it[k] for it in items] for k in range(3))
            b = Bucket(key, params, groups, names, state_dtype(params[0].dtype))
            self.build_bucket(b, transport)
            self.import_state(b, {p: saved[p] for p in params if p in saved})
            buckets.append(b)
        self._buckets = self._built = buckets
        self.params_built = [p for g in self.param_groups for p in g["params"]]
        self.built(buckets)

    def add_param_group(self, param_group):
        """Add a parameter group (options default to the constructor's); the buckets are rebuilt,
        keeping the existing state, when next used (collectively when distributed)."""
        super().add_param_group(param_group)
        self._check(self.param_groups[-1])
        if self._buckets is not None:
            self._buckets = "stale"

    def state_dict(self):
        """torch's ``state_dict()``, the buckets built (and settled) first, so that it holds every
        trainable parameter's state."""
        self.settled_buckets()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` output exactly (the state in its saved precision)."""
        raw = saved_state_by_param(self, state_dict)
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            self.check_group(g)
        buckets = self.buckets
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for b in buckets:  # torch's load made new group dicts: read options (an lr schedule's) from those
            b.groups = [group_of[p] for p in b.params]
        ages = {p: int(float(st["step"])) for p, st in raw.items() if "step" in st}
        if not self.keeps_buckets(buckets, ages):
            self.rebuild_buckets(ages)  # the checkpoint's buckets differ from ours
            buckets = self._buckets
        for b in buckets:
            self.import_state(b, {p: raw[p] for p in b.params if p in raw})
        self.ledger.restart(self.steps_so_far())

    # ------------------------------------------------------------------ statistics
    def steps_taken(self):
        """The steps its buckets have taken so far (the most of any bucket; 0 for a new optimizer)."""
        return max((b.rule.t for b in self.settled_buckets()), default=0)

    def steps_so_far(self):
        """Steps taken, or skipped on every rank (which still sent): what :meth:`step_traffic` counts."""
        return max((b.rule.t + b.rule.skipped_steps for b in self.buckets), default=0) + self.ledger.skips

    @property
    def skipped_steps(self):
        """Steps skipped (on every rank alike) for non-finite gradients, with ``on_nonfinite='skip'``."""
        return self.ledger.skipped_steps([b.rule for b in self.settled_buckets()])

    @property
    def communicators(self):
        """The :class:`slamb_comm.Communicator` of every parameter bucket (for statistics)."""
        return [b.comm for b in self.buckets]

    def step_traffic(self):
        """Bytes of every step since the last call (or since construction or the last
        ``load_state_dict``), summed over buckets, and start counting anew: a
        :class:`slamb_comm.Traffic` whose ``payload_bytes`` / ``dense_payload_bytes`` read as
        "these steps moved x of the y bytes a dense allreduce of the gradients would have" --
        one dense allreduce per step taken, also on a periodic sync step (docs/algorithm.md
        section 4). Called once per step, it is that step's bytes. The framework adapters call it
        at every step and keep the result (``last_traffic``), so under them read that instead."""
        comms = self.communicators
        dense = sum(c.layout.total * c.layout.dtype.itemsize for c in comms)
        size = comms[-1].size if comms else 1
        return self.ledger.traffic([c.stats for c in comms], dense, size, self.steps_so_far())
