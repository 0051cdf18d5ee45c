"""SLAMB's optimizer state: the moments m and v of one layout, the freshness where it is stored, and a
checkpoint restored on the host until the first step places it on that step's device.

:class:`SlambState` is a part that a :class:`~slamb_comm.methods.slamb.SlambRule` owns. For the cyclic mask
the freshness is derived from the mask's schedule and stored only for the tensors that once skipped a
step (:attr:`SlambState.fx`); the other masks store every element's (:attr:`SlambState.f`, 4 bytes per
element).
"""

import numpy as np

from .. import arrays as _arr
from ..errors import LayoutError

__all__ = ["SlambState"]


class SlambState:
    """m, v and the stored freshness of ``layout`` (see the module docstring); ``derived``: whether the
    mask derives the freshness (the cyclic mask)."""

    def __init__(self, layout, derived):
        self.layout, self.derived = layout, derived
        self.clear()

    def clear(self):
        """No state: zeros at the first step."""
        #: ``numpy`` or ``cupy``: where the state lives (None before the first step)
        self.xp = None
        self.m = self.v = None
        #: every element's stored freshness (the bernoulli and topk masks), else None
        self.f = None
        #: cyclic mask: tensor -> the stored freshness of a tensor that once skipped a step
        self.fx = {}
        #: a restored state on the host ({"m", "v", "f", "fx"}), moved to the device at :meth:`ensure`
        self.host = None

    def ensure(self, xp, like):
        """The state in library ``xp`` on the device of ``like``: allocated (zeros, or what
        :meth:`load` restored) at the first call; TypeError for another library afterwards."""
        if self.xp is None:
            n, dt = self.layout.total, self.layout.dtype
            with _arr.device_scope(like):
                host = self.host or {}
                self.m = xp.asarray(host["m"]) if "m" in host else xp.zeros(n, dt)
                self.v = xp.asarray(host["v"]) if "v" in host else xp.zeros(n, dt)
                if not self.derived:
                    self.f = xp.asarray(host["f"]) if "f" in host else xp.ones(n, dt)
                self.fx = {i: xp.asarray(a) for i, a in host.get("fx", {}).items()}
            self.host = None
            self.xp = xp
        elif self.xp is not xp:
            raise TypeError(f"SLAMB state lives in {self.xp.__name__}, got {xp.__name__} arrays")

    @property
    def has_stored_freshness(self):
        """Whether some tensor's freshness is stored (cyclic mask: it once skipped a step), not derived."""
        return bool(self.fx or (self.host or {}).get("fx"))

    def stored(self, i):
        """Tensor ``i``'s stored freshness (a live 1-D view), or None where it is derived."""
        if not self.derived:
            o, n = self.layout.offsets[i], self.layout.sizes[i]
            return None if self.f is None else self.f[o : o + n]
        return self.fx.get(i)

    def keep(self, i, f):
        """Store tensor ``i``'s freshness ``f`` (cyclic mask: a tensor that left the schedule)."""
        if not self.derived:
            raise RuntimeError("only the cyclic mask derives freshness; the others store all of it")
        if self.xp is None:
            raise RuntimeError("place() the state first")
        host = np.array(_arr.to_host(_arr.as_array(f)), dtype=self.layout.dtype).reshape(-1)
        self.fx[i] = self.xp.asarray(host)

    def freshness(self, i, mask, t, beta3):
        """The freshness after step ``t``: of tensor ``i`` (shaped like it), or of the fused buffer
        (``i=None``); a host array, derived from ``mask``'s schedule where it is not stored."""
        lay = self.layout
        parts = [self._freshness_of(k, mask, t, beta3) for k in (range(len(lay)) if i is None else [i])]
        if i is not None:
            return parts[0].reshape(lay.shapes[i])
        return np.concatenate(parts) if parts else np.zeros(0, lay.dtype)

    def _freshness_of(self, k, mask, t, beta3):
        lay = self.layout
        n = lay.sizes[k]
        fx = self.host.get("fx", {}) if self.host is not None else self.fx
        if self.derived and k in fx:
            return _arr.to_host(fx[k]).copy()
        if not self.derived:
            f = self.host["f"] if self.host is not None and "f" in self.host else self.f
            return np.ones(n, lay.dtype) if f is None else _arr.to_host(f[lay.offsets[k] : lay.offsets[k] + n]).copy()
        if not mask.selects_in(k):
            return np.ones(n, lay.dtype)
        return mask.freshness(k, t, beta3, 0, n).astype(lay.dtype)

    def arrays(self):
        """Host copies ``{"m", "v"}`` (None before any state), and the tensors whose freshness is stored."""
        src = self.host if self.host is not None else {"m": self.m, "v": self.v}
        host = (lambda a: None if a is None else _arr.to_host(a).copy())
        skipped = sorted(self.host.get("fx", {}) if self.host is not None else self.fx)
        return {"m": host(src.get("m")), "v": host(src.get("v"))}, skipped

    def load(self, state):
        """Keep ``state``'s m, v (and f, and the skipped tensors' freshness) on the host until :meth:`ensure`."""
        self.clear()
        if state["m"] is None:
            return
        dt, n = self.layout.dtype, self.layout.total
        keys = ("m", "v") if self.derived else ("m", "v", "f")
        for k in keys:
            if np.shape(state[k]) != (n,):
                raise LayoutError(f"saved {k} has shape {np.shape(state[k])}, expected ({n},)")
        self.host = {k: np.array(_arr.to_host(state[k]), dtype=dt, copy=True) for k in keys}
        if self.derived and state.get("skipped"):  # tensors whose freshness left the schedule
            f = _arr.to_host(state["f"])
            lay = self.layout
            self.host["fx"] = {int(i): np.array(f[lay.offsets[i] : lay.offsets[i] + lay.sizes[i]], dtype=dt)
                               for i in state["skipped"]}
