"""SLAMB's momentum exchange tensor by tensor, launched from the gradient hooks: :class:`HookExchange`.

The distributed SLAMB optimizer's buckets that are not flat (the CPU's default) exchange in two
calls of the core per tensor, with the framework's collectives in between: the core's
``SlambRule.tensorwise.accumulate`` writes this rank's new momentum on M_t into a buffer
whose last slot is the status word, the collectives average it asynchronously (a parameter's
gradient hook, or DDP's bucket hook, launches it; Horovod's and torch.distributed's collectives
fuse a bucket's into one), and :meth:`HookExchange.finish` waits, checks every status word and
value with one host read, and keeps the means until ``step()`` applies them. The status slot: 0;
-1 where this rank has no gradient for the parameter (the average is -1 only if no rank has one:
the parameter is left as it is); inf where this rank's gradient is not finite (or its square
would overflow v), computed on the device; NaN where a parameter of this rank no longer fits its
bucket (it still takes part, with zeros). The average spreads inf and NaN to every rank. A bucket
with the topk mask picks per tensor in the hooks and exchanges fused in the core at ``finish``.
"""

import math
import time
from typing import NamedTuple

import numpy as np
import torch

from slamb_comm import arrays as _arr
from slamb_comm.errors import LayoutError, NonFiniteError, PeerError

from .. import tensors
from ..tensors import Grads, Params, cuda_scope, torch_dtype

__all__ = ["HookExchange", "Finished"]


class Finished(NamedTuple):
    """What :meth:`HookExchange.finish` found, the same on every rank: ``changed`` (None; True: a
    rank's parameter or option changed, seen in its NaN status; or the LayoutError/PeerError the
    core raised), and ``bad``: the (bucket, parameter) pairs whose exchange was not finite on some
    rank (empty: the step goes); and, this rank's own, ``mine``: whether its gradients were not
    finite (read on the failure path only)."""

    changed: object
    bad: list
    mine: bool = False


class _HookStep:
    """One bucket's exchange in flight: its payload's counts (None for the topk mask), what was
    launched per parameter, the bytes and encoding time, then the means and the tensors no rank
    had a gradient for."""

    __slots__ = ("counts", "launched", "payload", "encode_s", "means", "skip", "bad")

    def __init__(self, counts):
        self.counts, self.launched, self.payload, self.encode_s = counts, {}, 0, 0.0
        self.means, self.skip = None, set()
        self.bad = []  # per launch, whether this rank's gradient was bad (a bool, or a 0-d device array: not read)

    def bad_here(self):
        """Whether a gradient this rank launched was bad (host reads: the failure path only)."""
        return any(bool(b) for b in self.bad)


class HookExchange:
    """The step's tensor-by-tensor exchange of a distributed SLAMB (see the module docstring).

    Args:
        coll: the framework's collectives.
        predivide: Horovod's ``gradient_predivide_factor`` (the average is taken as a pre-scaled sum).
    """

    def __init__(self, coll, predivide=1.0):
        self.coll, self.predivide = coll, predivide
        self._open = {}  # bucket -> _HookStep
        self._ids = 0  # numbers the have-a-gradient collectives of the topk mask (Horovod matches names)

    def is_open(self, e):
        return e in self._open

    def launched(self, e, p):
        return e in self._open and p in self._open[e].launched

    def begin(self, e, topk):
        """Open bucket ``e``'s step (the core's too)."""
        e.rule.begin_step()
        self._open[e] = _HookStep(None if topk else e.rule.tensorwise.counts())

    def launch(self, e, i, p, g, problem, redo=False):
        """Tensor ``i`` (parameter ``p``) of bucket ``e``: its new momentum on M_t from ``g`` (its
        gradient as an array, or None where this rank has none), and its asynchronous average;
        ``problem``: this rank no longer fits the bucket (it sends zeros and a NaN status)."""
        st, t0 = self._open[e], time.perf_counter()
        if st.counts is None:  # topk mask: pick now, exchange fused after every gradient is in
            if problem is None:
                with cuda_scope(p.device):
                    st.bad.append(e.rule.tensorwise.accumulate(i, g))
            st.launched[p] = None
            return
        buf = torch.empty(st.counts[i] + 1, dtype=torch_dtype(e.comm.value_dtype), device=p.device)
        if problem is not None:
            buf.zero_()[-1] = math.nan
        else:
            fine = -1.0 if p.grad is None else 0.0
            with cuda_scope(p.device):
                bad = e.rule.tensorwise.accumulate(i, g, out=_arr.as_array(buf)[:-1])  # this rank's new momentum on M_t
            st.bad.append(bad)
            if isinstance(bad, (bool, np.bool_)):
                buf[-1] = math.inf if bad else fine
            else:
                buf[-1:].copy_(torch.where(tensors.tensor_of(bad), math.inf, fine).reshape(1))
        name = f"slamb_comm.momentum.{e.names[i]}" + (".redo" if redo else "")
        handle = self.coll.allreduce_async(buf, name, average=True, prescale=1.0 / self.predivide,
                                           postscale=self.predivide)
        st.launched[p] = (handle, buf)
        st.payload += buf.numel() * buf.element_size()
        st.encode_s += time.perf_counter() - t0

    def relaunch(self):
        """Forget what was launched (after :meth:`finish`), to launch every tensor again (a redo)."""
        for st in self._open.values():
            st.launched, st.payload, st.bad = {}, 0, []

    def finish(self, engines, problem):
        """Wait for every launched exchange and check it (one host read); keep the means. The
        topk mask's buckets exchange now, in the core. ``problem``: this rank's own error, if its
        input no longer fits (it takes part with zeros)."""
        t1 = time.perf_counter()
        results = [(e, p, self.coll.wait(h)) for e, st in self._open.items() if st.counts is not None
                   for p, (h, _) in st.launched.items()]
        changed, failed, mine = self._topk_buckets(engines, problem)
        t2 = time.perf_counter()
        absent = -1.0 + 0.5 / self.coll.size  # an averaged status at most this: no rank had a gradient
        finite, gone = True, []
        if results:  # one host read: every exchange's finiteness, and which parameters no rank had a gradient for
            flags = torch.stack([torch.isfinite(out).all() for _, _, out in results])
            words = torch.stack([flags.all()] + [out[-1] <= absent for _, _, out in results]).tolist()
            finite, gone = words[0], words[1:]
        bad = [] if finite else [(e, p) for e, p, out in results if not bool(torch.isfinite(out).all())]
        if not finite and changed is None and any(bool(torch.isnan(out[-1])) for _, _, out in results):
            changed = True
        bad += [(e, p) for e in failed for p in e.params]
        if changed is not None or bad:
            return Finished(changed, bad, bool(bad) and (mine or any(st.bad_here() for st in self._open.values())))
        for (e, p, out), nobody in zip(results, gone):
            st = self._open[e]
            if nobody:
                st.skip.add(e.index[p])
            if st.means is None:
                st.means = [None] * len(e.params)
            st.means[e.index[p]] = _arr.as_array(out[:-1])  # applied by step(): m is not touched before then
        self._record(t1, t2)
        return Finished(None, [])

    def _topk_buckets(self, engines, problem):
        """The topk mask's buckets: which parameters have a gradient on some rank (every rank takes
        part), then the core's fused exchange. Returns (the LayoutError/PeerError raised on every
        rank, or None; the buckets whose exchange was not finite; whether this rank's gradients there were)."""
        failed, mine = [], False
        for e in engines:
            st = self._open.get(e)
            if st is None or st.counts is not None:
                continue
            try:
                with cuda_scope(e.params[0].device):
                    have = torch.tensor([p.grad is not None for p in e.params], dtype=torch.int32,
                                        device=self.coll.device)
                    self._ids += 1
                    self.coll.allreduce(have, f"slamb_comm.have.{self._ids}")
                    st.skip = {i for i, c in enumerate(have.tolist()) if c == 0}
                    if problem is not None:  # input the core rejects, collectively
                        e.comm.masked_allreduce([], e.rule.t + 1)
                    else:
                        e.rule.tensorwise.exchange(Grads(e))
            except NonFiniteError:  # raised on every rank; the core abandoned the step
                mine = mine or self._open.pop(e).bad_here()
                failed.append(e)
            except (LayoutError, PeerError) as err:  # also raised on every rank
                return err, failed, mine
        return None, failed, mine

    def _record(self, t1, t2):
        t3 = time.perf_counter()
        for e, st in self._open.items():
            if st.counts is not None:
                e.comm.record_masked_allreduce(st.payload, sum(st.counts), st.encode_s, t2 - t1, t3 - t2)
                st.launched = {}

    def close(self, e):
        """Bucket ``e``'s step, after :meth:`finish`: ``(means, skip)`` for the core's ``apply``, or None
        where it did not open."""
        st = self._open.pop(e, None)
        return None if st is None else (st.means, st.skip)

    def apply(self, buckets, publish):
        """After :meth:`finish`: every bucket's update with its means (the core's ``apply``), then
        ``publish(bucket)`` (the optimizer's torch state)."""
        for e in buckets:
            opened = self.close(e)
            if opened is None:
                continue
            means, skip = opened
            if len(skip) == len(e.params):  # no gradient anywhere in the bucket: no step at all
                e.rule.abort_step()
                continue
            lr, wd = e.lr_wd()
            x = Params(e)
            with cuda_scope(e.params[0].device):
                e.rule.update.apply(x, Grads(e), means=means, lr=lr, weight_decay=wd, written=x.written, skip=skip)
            publish(e)

    def abandon(self):
        """Wait for whatever this step launched (Horovod needs every handle collected), then :meth:`abort`."""
        for st in self._open.values():
            for launched in st.launched.values():
                if launched is not None:
                    self.coll.wait(launched[0])
        self.abort()

    def abort(self):
        """Drop the step's exchange: every open bucket's core step aborted, nothing changed."""
        for e in self._open:
            e.rule.abort_step()
        self._open = {}
