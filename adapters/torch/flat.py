"""A bucket's parameters as one flat buffer, its gradients read where they are (``fused=`` of the optimizers).

On a GPU the core's device step (:mod:`slamb_comm.fused`: a few kernels whatever the number of
tensors) reads the parameters and the gradients through tables of device addresses. :class:`Flat`
provides them:

* **Parameters become views into one flat buffer** (as FSDP's flat parameters): at construction
  each float32/float64 contiguous parameter's values are copied in once and ``p.data`` is pointed
  at its slice, so the core updates the model in place, with no copy per step and no second copy
  of the model. Parameters it cannot view -- 16-bit ones, whose buffer is float32, and
  non-contiguous ones (``channels_last``), whose memory format a view would change -- are copied
  in before the step and back after it, each direction one multi-tensor ``torch._foreach_copy_``.
  A parameter whose ``.data`` was replaced since is adopted again (its values copied in,
  ``.data`` pointed back) if its dtype and layout allow, else copied from then on; one moved to
  another device raises :class:`~slamb_comm.LayoutError`.
* **Gradients are read where they are**: :meth:`gradients` hands the core
  :class:`slamb_comm.device.Addresses`, the device address of every ``p.grad`` (DDP's bucket
  views, autograd's own tensors, whatever a recipe left), so the step makes no copy of them and
  keeps no gradient buffer. The copy is unavoidable only where the kernels cannot read a
  gradient as it is: a 16-bit gradient (bfloat16/float16 parameters: the kernels read the
  bucket's float32) and a non-contiguous one; those are converted, in one ``_foreach_copy_``, into
  buffers kept for them alone. The host work per step is two passes over the parameter list at
  C level (``p.grad`` and ``data_ptr``); the checks of each gradient run only when a gradient
  tensor is new (``zero_grad()``'s default ``set_to_none=True`` makes new ones every step;
  their addresses usually repeat, and the core copies its table of addresses to the device only
  when they do not).

A step where some parameter has no gradient, or a sparse one, goes tensor by tensor instead
(:meth:`ready`). Caveat of views, as with any flat-parameter scheme: ``torch.save`` of one
parameter alone saves its storage, the whole bucket (``model.state_dict()`` saves the bucket
once, shared by its parameters).
"""

import operator

import torch

from slamb_comm import arrays as _arr
from slamb_comm.errors import LayoutError
from slamb_comm.device import Addresses

__all__ = ["Flat", "wants_flat"]


def wants_flat(fused, device):
    """Whether a bucket on ``device`` uses flat buffers: ``fused`` True always, False never,
    None (the default) on CUDA devices only (on the CPU the core's blocked tensor-by-tensor
    step is faster than the device kernels' layout)."""
    if fused is None:
        return device.type == "cuda"
    return bool(fused)


class Flat:
    """Engine ``e``'s parameters as one flat tensor of ``e.dtype``, laid out as ``e.comm.layout``,
    and its gradients as device addresses (see the module docstring)."""

    def __init__(self, e):
        lay = e.comm.layout
        ps = e.params
        self.params = ps
        self.dtype = e.dtype
        self.x = torch.empty(lay.total, dtype=e.dtype, device=ps[0].device)
        self.xv = [self.x[o:o + n].view(s) for (o, n), s in zip(lay.segments(), lay.shapes)]
        with torch.no_grad():
            torch._foreach_copy_(self.xv, [p.detach() for p in ps])
        self.viewed = [i for i, p in enumerate(ps) if p.dtype == e.dtype and p.is_contiguous()]
        for i in self.viewed:
            ps[i].data = self.xv[i]
        keep = set(self.viewed)
        self.copied = [i for i in range(len(ps)) if i not in keep]
        self._ptrs = [self.xv[i].data_ptr() for i in self.viewed]
        self.array = _arr.as_array(self.x)
        self._grads = None  # the gradient tensors of the last step, and what was made of them
        self._converted = {}  # parameter index -> the buffer its gradient is converted into
        self._owners = ()

    def ready(self):
        """Whether every parameter has a dense gradient (else the step goes tensor by tensor)."""
        return all(p.grad is not None and p.grad.layout == torch.strided for p in self.params)

    @torch.no_grad()
    def load(self):
        """Before a step: re-adopt parameters whose ``.data`` was replaced, copy the copied
        parameters in. Returns the flat parameters (the core's array)."""
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
        return self.array

    @torch.no_grad()
    def gradients(self, grads=None):
        """The gradients (``grads``, default every ``p.grad``) as :class:`~slamb_comm.device.Addresses`,
        read where they are; a gradient the kernels cannot read as it is (another dtype, or not
        contiguous) is converted into a buffer kept for it. Needs :meth:`ready`."""
        grads = [p.grad for p in self.params] if grads is None else list(grads)
        if self._grads is None or len(grads) != len(self._grads) or not all(map(operator.is_, grads, self._grads)):
            self._adopt(grads)
        if self._converted:
            idx = list(self._converted)
            torch._foreach_copy_([self._converted[i] for i in idx], [grads[i] for i in idx])
        return Addresses(tuple(map(torch.Tensor.data_ptr, self._owners)), self._owners)

    def _adopt(self, grads):
        """New gradient tensors: check each, and keep a conversion buffer for those that need one."""
        device = self.x.device
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g.device != device or g.shape != p.shape:
                raise LayoutError(f"the gradient of parameter {i} of this bucket is {tuple(g.shape)} on {g.device}, "
                                  f"its parameter {tuple(p.shape)} on {device}")
        need = {i for i, g in enumerate(grads) if g.dtype != self.dtype or not g.is_contiguous()}
        self._converted = {i: self._converted.get(i) if self._converted.get(i) is not None
                           else torch.empty(self.params[i].shape, dtype=self.dtype, device=device) for i in need}
        self._grads = grads
        self._owners = tuple(self._converted.get(i, g) for i, g in enumerate(grads))

    @torch.no_grad()
    def store(self):
        """After a step: the copied parameters take their new values (cast to their dtype)."""
        if self.copied:
            torch._foreach_copy_([self.params[i].data for i in self.copied], [self.xv[i] for i in self.copied])
