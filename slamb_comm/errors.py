"""Exceptions raised by slamb_comm.

Every check that could fail on one rank only is made collectively (see
:mod:`slamb_comm.exchange.communicator`), so a bad input raises on *every* rank: the rank
whose input was bad raises the specific error below, the others raise
:class:`PeerError` naming it. Nothing hangs in a collective waiting for a rank that
already gave up.
"""

__all__ = [
    "SlambCommError",
    "ConfigError",
    "LayoutError",
    "LayoutMismatchError",
    "DTypeError",
    "NonContiguousError",
    "NonFiniteError",
    "PeerError",
    "STATUS_OK",
    "STATUS_BAD_INPUT",
    "STATUS_NON_FINITE",
    "collective_error",
]

#: The status word every exchange's payload carries, summed or gathered with it: how each rank
#: learns, in the same collective, that some rank's input was bad or not finite.
STATUS_OK, STATUS_BAD_INPUT, STATUS_NON_FINITE = 0, 1, 2


class SlambCommError(Exception):
    """Base class of every exception slamb_comm raises on purpose."""


class ConfigError(SlambCommError, ValueError):
    """A hyper-parameter or option is out of range or unknown (e.g. ratio not in (0, 1])."""


class LayoutError(SlambCommError, ValueError):
    """The arrays handed to an exchange do not match the layout it was built for."""


class LayoutMismatchError(LayoutError):
    """Ranks disagree on the layout (shapes, dtypes, order) or on the options of an exchange."""


class DTypeError(SlambCommError, TypeError):
    """An array or payload dtype is not supported."""


class NonContiguousError(LayoutError):
    """An array is not C-contiguous, so it cannot be viewed as part of a fused buffer."""


class NonFiniteError(SlambCommError, FloatingPointError):
    """A NaN or Inf was found in what an exchange would send or received.

    Raised on every rank at once; no state (parameters, momenta, error buffers) was
    changed by the exchange that raised it.

    Attributes:
        ranks: ranks whose contribution was non-finite, where known (else empty).
        tensors: names of the tensors that held non-finite values, where known.
    """

    def __init__(self, message, ranks=(), tensors=()):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.tensors = tuple(tensors)


class PeerError(SlambCommError):
    """Another rank rejected its input for an exchange; this rank raises too.

    Attributes:
        ranks: the ranks that reported a problem.
    """

    def __init__(self, message, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


def collective_error(codes, problem, what, tensors=(), nonfinite="non-finite values (NaN/Inf)"):
    """The error this rank raises after an exchange whose status words (``codes``, every rank's,
    as gathered or summed) were not all :data:`STATUS_OK`: its own ``problem`` (its input was
    bad), else :class:`PeerError` naming the ranks whose input was, else :class:`NonFiniteError`
    naming the ranks with ``nonfinite`` values (none: the sum over ranks overflowed), in
    ``tensors`` if given. Every rank gets the same verdict from the same codes."""
    if problem is not None:
        return problem
    bad = [r for r, c in enumerate(codes) if c == STATUS_BAD_INPUT]
    if bad:
        return PeerError(f"{what}: rank(s) {bad} rejected their input (see their error); nothing was changed", bad)
    ranks = [r for r, c in enumerate(codes) if c == STATUS_NON_FINITE]
    where = f" in tensor(s) {list(tensors)}" if tensors else ""
    if ranks:
        return NonFiniteError(f"{what}: {nonfinite} from rank(s) {ranks}{where}; nothing was changed", ranks, tensors)
    return NonFiniteError(f"{what}: the sum over ranks overflowed to Inf{where}; nothing was changed", ranks, tensors)
