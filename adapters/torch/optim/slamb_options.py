"""The SLAMB torch optimizer's options: the checks of a parameter group's options
(:func:`check_group`), the records a bucket is keyed by (:func:`knobs_of`:
:class:`SlambKnobs` of :class:`RuleKnobs` and :class:`CommKnobs`), and what a bucket's groups ask of
its rule before a step (:func:`requested_ratio`, :func:`refresh_rule`)."""

from dataclasses import dataclass

from slamb_comm import arrays as _arr
from slamb_comm.wire.codecs import check_ratio
from slamb_comm.errors import ConfigError
from slamb_comm.wire.masks import check_block

__all__ = ["MASKS", "RuleKnobs", "CommKnobs", "SlambKnobs", "check_group", "knobs_of", "layout_knobs", "requested_ratio",
           "refresh_rule"]

MASKS = ("cyclic", "bernoulli", "topk")


@dataclass(frozen=True)
class RuleKnobs:
    """A parameter group's options of the update rule (the core's :class:`SlambRule`); they may
    change between steps, alike for the groups of a bucket."""

    betas: tuple
    eps: float
    beta3: float
    sync_interval: int
    c_min: float
    c_max: float
    on_nonfinite: str


@dataclass(frozen=True)
class CommKnobs:
    """A parameter group's options of the exchange (the core's ``Communicator``)."""

    ratio: float
    mask: str
    value_dtype: str
    dense_threshold: int
    block: int
    seed: object

    @property
    def fixed(self):
        """The options fixed at construction (the ratio may change; the seed comes from rank 0)."""
        return (self.mask, self.value_dtype, self.dense_threshold, self.block)


@dataclass(frozen=True)
class SlambKnobs:
    """A parameter group's SLAMB options but lr and weight decay (per group within a bucket)."""

    rule: RuleKnobs
    comm: CommKnobs


def check_group(g):
    """ConfigError naming the first of group ``g``'s SLAMB options out of its range."""
    if not (isinstance(g["lr"], (int, float)) and g["lr"] >= 0):
        raise ConfigError(f"lr must be a number >= 0, got {g['lr']!r}")
    b = g["betas"]
    if len(b) != 2 or not all(0.0 <= float(x) < 1.0 for x in b):
        raise ConfigError(f"betas must be two numbers in [0, 1), got {b!r}")
    if not float(g["eps"]) >= 0:
        raise ConfigError(f"eps must be >= 0, got {g['eps']!r}")
    if not float(g["weight_decay"]) >= 0:
        raise ConfigError(f"weight_decay must be >= 0, got {g['weight_decay']!r}")
    check_ratio(g["ratio"])
    if not 0.0 <= float(g["beta3"]) < 1.0:
        raise ConfigError(f"beta3 must be in [0, 1), got {g['beta3']!r}")
    h = g["sync_interval"]
    if isinstance(h, bool) or int(h) != h or h < 1:
        raise ConfigError(f"sync_interval must be an integer >= 1, got {g['sync_interval']!r}")
    if g["mask"] not in MASKS:
        raise ConfigError(f"unknown mask {g['mask']!r}; choose one of {list(MASKS)}")
    if check_block(g.get("block", 1)) != 1 and g["mask"] != "cyclic":
        raise ConfigError(f"block={g['block']} applies to the cyclic mask only, not {g['mask']!r}")
    _arr.value_dtype(g["value_dtype"])
    if not 0.0 < float(g["c_min"]) <= float(g["c_max"]):
        raise ConfigError(f"need 0 < c_min <= c_max, got {g['c_min']!r}, {g['c_max']!r}")
    if int(g["dense_threshold"]) < 0:
        raise ConfigError(f"dense_threshold must be >= 0, got {g['dense_threshold']!r}")
    if g["on_nonfinite"] not in ("skip", "raise"):
        raise ConfigError(f"on_nonfinite must be 'skip' or 'raise', got {g['on_nonfinite']!r}")
    if g["seed"] is not None and int(g["seed"]) != g["seed"]:
        raise ConfigError(f"seed must be an integer or None, got {g['seed']!r}")


def knobs_of(g):
    """Group ``g``'s :class:`SlambKnobs`."""
    rule = RuleKnobs(tuple(float(b) for b in g["betas"]), float(g["eps"]), float(g["beta3"]),
                     int(g["sync_interval"]), float(g["c_min"]), float(g["c_max"]), g["on_nonfinite"])
    comm = CommKnobs(check_ratio(g["ratio"]), g["mask"], _arr.value_dtype(g["value_dtype"]).name,
                     int(g["dense_threshold"]), check_block(g.get("block", 1)),
                     None if g["seed"] is None else int(g["seed"]))
    return SlambKnobs(rule, comm)


def layout_knobs(knobs):
    """The options that decide a bucket's layout and exchange: the ratio and the fixed ones."""
    return (knobs.comm.ratio, *knobs.comm.fixed)


def requested_ratio(bucket):
    """The ratio ``bucket``'s parameter groups ask for now (a schedule may have changed it);
    ConfigError if groups that share the bucket disagree."""
    asked = {check_ratio(g["ratio"]) for g in bucket.unique_groups}
    if len(asked) != 1:
        raise ConfigError(f"parameter groups that share a SLAMB bucket ask for different ratios {sorted(asked)}; "
                          "change the ratio of every group of the bucket at once")
    return asked.pop()


def refresh_rule(bucket):
    """Before a step: the options ``bucket``'s groups say now, into its rule (they may change between
    steps, alike for the groups of a bucket); ConfigError if the groups disagree, or change an option
    fixed at construction."""
    groups = bucket.unique_groups  # each group once, not once per parameter
    rule_k = knobs_of(groups[0]).rule
    for g in groups[1:]:
        if knobs_of(g).rule != rule_k:
            raise ConfigError("parameter groups that share a SLAMB bucket now disagree on betas/eps/beta3/"
                              "sync_interval/c_min/c_max; change them for every group at once")
    for g in groups:
        c, built = knobs_of(g).comm, bucket.key.knobs.comm
        if c.fixed != built.fixed:
            raise ConfigError("mask, value_dtype, dense_threshold and block are fixed at construction "
                              f"(built with {built.fixed}, the group now says {c.fixed}); the ratio may change")
    requested_ratio(bucket)
    r = bucket.rule
    r.betas, r.eps, r.beta3, r.sync_interval = rule_k.betas, rule_k.eps, rule_k.beta3, rule_k.sync_interval
    r.c_min, r.c_max, r.on_nonfinite = rule_k.c_min, rule_k.c_max, rule_k.on_nonfinite
