"""A bucket's parameters and gradients as the core's two fused buffers (``fused=`` of the optimizers).

On a GPU every operation is a kernel launch, so the core's whole-buffer step
(:mod:`slamb_comm.fused`: a constant number of operations whatever the number of tensors)
needs the bucket as one flat array of parameters and one of gradients. :class:`Flat` makes them:

* **Parameters become views into the flat buffer** (as FSDP's flat parameters): at
  construction each float32/float64 contiguous parameter's values are copied in once and
  ``p.data`` is pointed at its slice, so the core updates the model in place, with no copy per
  step and no second copy of the model. Parameters it cannot view -- 16-bit ones, whose buffer
  is float32, and non-contiguous ones (``channels_last``), whose memory format a view would
  change -- are copied in before the step and back after it, each direction one multi-tensor
  ``torch._foreach_copy_``. A parameter whose ``.data`` was replaced since is adopted again
  (its values copied in, ``.data`` pointed back) if its dtype and layout allow, else copied from
  then on; one moved to another device raises :class:`~slamb_comm.LayoutError`.
* **Gradients are copied in** with one ``torch._foreach_copy_`` per step. Views would save
  the copy, but autograd replaces ``p.grad`` whenever it is None (``zero_grad()``'s default
  ``set_to_none=True``), DDP hands its own bucket views, and a user's clipping or unscaling works
  on whatever ``p.grad`` is: a copy is right in every case, and costs one pass over the
  gradients (4 bytes per parameter of device memory for the buffer).

A step where some parameter has no gradient, or a sparse one, goes tensor by tensor instead
(:meth:`ready`). Caveat of views, as with any flat-parameter scheme: ``torch.save`` of one
parameter alone saves its storage, the whole bucket (``model.state_dict()`` saves the bucket
once, shared by its parameters).
"""

import torch

from slamb_comm import arrays as _arr
from slamb_comm.errors import LayoutError

__all__ = ["Flat", "wants_flat"]


def wants_flat(fused, device):
    """Whether a bucket on ``device`` uses flat buffers: ``fused`` True always, False never,
    None (the default) on CUDA devices only (on the CPU the core's blocked tensor-by-tensor
    step is faster than the whole-buffer one)."""
    if fused is None:
        return device.type == "cuda"
    return bool(fused)


class Flat:
    """Engine ``e``'s parameters and gradients as two flat tensors of ``e.dtype``, laid out as
    ``e.comm.layout`` (see the module docstring)."""

    def __init__(self, e):
        lay = e.comm.layout
        ps = e.params
        self.params = ps
        self.x = torch.empty(lay.total, dtype=e.dtype, device=ps[0].device)
        self.g = torch.empty_like(self.x)
        self.xv = [self.x[o:o + n].view(s) for (o, n), s in zip(lay.segments(), lay.shapes)]
        self.gv = [self.g[o:o + n].view(s) for (o, n), s in zip(lay.segments(), lay.shapes)]
        with torch.no_grad():
            torch._foreach_copy_(self.xv, [p.detach() for p in ps])
        self.viewed = [i for i, p in enumerate(ps) if p.dtype == e.dtype and p.is_contiguous()]
        for i in self.viewed:
            ps[i].data = self.xv[i]
        keep = set(self.viewed)
        self.copied = [i for i in range(len(ps)) if i not in keep]
        self._ptrs = [self.xv[i].data_ptr() for i in self.viewed]
        self.arrays = (_arr.as_array(self.x), _arr.as_array(self.g))

    def ready(self):
        """Whether every parameter has a dense gradient (else the step goes tensor by tensor)."""
        return all(p.grad is not None and p.grad.layout == torch.strided for p in self.params)

    @torch.no_grad()
    def load(self):
        """Before a step: re-adopt parameters whose ``.data`` was replaced, copy the copied
        parameters and every gradient into the flat buffers."""
        ps = self.params
        moved = [i for i, ptr in zip(self.viewed, self._ptrs) if ps[i].data_ptr() != ptr]
        for i in moved:  # p.data was replaced since (same shape: param_changed checked it)
            p = ps[i]
            if p.device != self.x.device:
                raise LayoutError(f"parameter {i} of this bucket moved from {self.x.device} to {p.device} after the "
                                  "optimizer was built; move the model first, then build the optimizer")
            if p.dtype == self.x.dtype and p.is_contiguous():
                self.xv[i].copy_(p.detach())
                p.data = self.xv[i]  # adopted again
            else:  # another dtype (e.g. model.half()) or memory format: copied in and out from now on
                k = self.viewed.index(i)
                del self.viewed[k], self._ptrs[k]
                self.copied.append(i)
        if moved:
            self._ptrs = [self.xv[i].data_ptr() for i in self.viewed]
        if self.copied:
            torch._foreach_copy_([self.xv[i] for i in self.copied], [ps[i].detach() for i in self.copied])
        torch._foreach_copy_(self.gv, [p.grad.detach() for p in ps])
        return self.arrays

    @torch.no_grad()
    def store(self):
        """After a step: the copied parameters take their new values (cast to their dtype)."""
        if self.copied:
            torch._foreach_copy_([self.params[i].data for i in self.copied], [self.xv[i] for i in self.copied])
