"""The status words every summing exchange carries, and the one host read that decides (docs/algorithm.md
section 9): :class:`StatusWords`, a part that the :class:`~slamb_comm.exchange.communicator.Communicator` owns.

A rank whose input is bad, or whose values are not finite, puts NaN in its status slot; the sum
carries it to every rank, so every rank raises alike and nothing changes: the rank with the problem
its own error, the others :class:`~slamb_comm.errors.PeerError` naming it, or every rank
:class:`~slamb_comm.errors.NonFiniteError` naming the ranks and the tensors.
"""

import numpy as np

from .. import arrays as _arr
from ..errors import STATUS_BAD_INPUT, STATUS_NON_FINITE, STATUS_OK, PeerError, collective_error

__all__ = ["StatusWords", "TEXT_WORDS", "problem_words", "problem_text", "rejected_at_construction"]

#: int64 words that carry a rank's error text in a construction agreement (its first 192 bytes of UTF-8)
TEXT_WORDS = 24


def problem_words(problem):
    """``problem`` (an exception, or None) as :data:`TEXT_WORDS` int64 words, for a construction
    agreement's allgather: its type and message in UTF-8, cut to fit (zeros for None). So the ranks
    whose input was fine can say which rank rejected what, and why."""
    out = np.zeros(TEXT_WORDS, np.int64)
    if problem is not None:
        raw = f"{type(problem).__name__}: {problem}".encode()[: out.nbytes]
        out.view(np.uint8)[: len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def problem_text(words):
    """The text :func:`problem_words` put into ``words`` (a cut multi-byte character is dropped)."""
    raw = np.ascontiguousarray(words, dtype=np.int64).view(np.uint8).tobytes().rstrip(b"\0")
    return raw.decode(errors="ignore")


def rejected_at_construction(failed, texts):
    """The PeerError of a rank whose input was fine after a construction agreement in which the ranks
    ``failed`` rejected theirs: it names them and what each said (``texts``: every rank's
    :func:`problem_words`)."""
    why = "; ".join(f"rank {r}: {problem_text(texts[r])}" for r in failed[:4])
    return PeerError(f"rank(s) {failed} rejected their arguments at construction ({why}); this rank stops too, "
                     "and nothing was built", failed)


class StatusWords:
    """The status words of the exchanges of ``layout`` over ``transport`` (see the module docstring)."""

    def __init__(self, layout, transport):
        self.layout, self.transport = layout, transport

    def _codes(self, code):
        """Every rank's status code (used only on the failure path)."""
        mine = np.array([code], dtype=np.int32)
        everyone = np.zeros(self.transport.size, dtype=np.int32)
        self.transport.allgather(mine, everyone)
        return everyone.tolist()

    def reduce_checked(self, buf, problem, local_bad, what, spans=None, whole=True, sent=None, mine=None, present=0,
                       status_in_buffer=False):
        """Sum ``buf`` over ranks in place, its last slot being the status word: 0, or NaN from a
        rank that rejected its input (``problem``, an exception) or found non-finite values of
        its own (``local_bad``: a bool, a 0-d device array, or a callable returning one, so that
        nothing is read back before sending). Then one host read decides: if any rank flagged, or (``whole``) any
        summed value is not finite, every rank raises and the caller must change nothing.

        ``spans``, ``(starts, counts)`` of each tensor's slice of the payload, names the tensors
        whose sums are not finite; ``sent()``, called on the failure path only, recomputes what
        this rank sent, to tell whether it was this rank's values that were not finite; and
        ``mine()``, also on the failure path only, flags per tensor where this rank's values
        were not finite (the ranks then agree on the union). Every exchange that sums goes
        through here.

        ``status_in_buffer``: the caller (a device kernel) already wrote the status word(s) into
        ``buf``; ``local_bad`` is then read only on the failure path.

        ``present``: what a rank that is fine puts in the status word (default 0). With
        ``whole=False`` the summed status word is returned (its one host read), so a caller
        that puts a nonzero ``present`` learns how many ranks took part: under Horovod's
        ``join()`` the ranks that joined contribute zeros.
        """
        xp = _arr.namespace(buf)
        if problem is not None:
            buf[-1] = np.nan
        elif status_in_buffer:
            pass
        elif isinstance(local_bad, (bool, np.bool_)):
            buf[-1] = np.nan if local_bad else present
        else:
            buf[-1:] = xp.where(local_bad, np.nan, present).astype(buf.dtype)
        self.transport.allreduce(buf)
        if whole:
            word = None
            ok = bool(xp.isfinite(xp.sum(buf, dtype=np.float64)))  # NaN and Inf survive a sum
        else:
            word = float(_arr.to_host(buf[-1:])[0])
            ok = np.isfinite(word)
        if ok:
            return word
        raise self.failure(buf, problem, local_bad, what, spans, sent, mine)

    def failure(self, buf, problem, local_bad, what, spans=None, sent=None, mine=None):
        """The error every rank raises after a summed exchange that failed (:meth:`reduce_checked`'s
        failure path, or a caller that decided on the device and reads the verdict later): who flagged
        (one small allgather, so every rank calls it for the same exchange) and where the sums in ``buf``
        are not finite. Host reads are fine here. ``local_bad``: a bool, a 0-d device array, or a callable
        returning one."""
        xp = _arr.namespace(buf)
        if problem is not None:
            code = STATUS_BAD_INPUT
        elif bool(local_bad() if callable(local_bad) else local_bad) or (
                sent is not None and not bool(xp.isfinite(sent()).all())):
            code = STATUS_NON_FINITE
        else:
            code = STATUS_OK
        codes = self._codes(code)
        tensors = ()
        if mine is not None:
            flags = np.zeros(len(self.layout), np.int32) if problem is not None else np.asarray(mine(), np.int32)
            self.transport.allreduce(flags)
            tensors = tuple(n for n, f in zip(self.layout.names, flags) if f)
        elif spans is not None:
            bad = _arr.to_host(~xp.isfinite(buf[:-1]))
            tensors = tuple(self.layout.names[i] for i, (s, c) in enumerate(zip(*spans))
                            if c and bad[s : s + c].any())
        return collective_error(codes, problem, what, tensors)
