"""A bucket's parameters as one flat buffer, its gradients read where they are (``fused=`` of the optimizers).

On a GPU the core's device step (:mod:`slamb_comm.device.slamb_step`: a few kernels whatever the number of
tensors) reads the parameters and the gradients through tables of device addresses. :class:`FlatBuffer`
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
  :class:`slamb_comm.device.tables.Addresses`, the device address of every ``p.grad`` (DDP's bucket
  views, autograd's own tensors, whatever a recipe left), so the step makes no copy of them and
  keeps no gradient buffer. The copy is unavoidable only where the kernels cannot read a
  gradient as it is: a 16-bit gradient (bfloat16/float16 parameters: the kernels read the
  bucket's float32) and a non-contiguous one; those are converted, in one ``_foreach_copy_``, into
  buffers kept for them alone.

**Host work per step**: a constant number of Python calls whatever the number of tensors, and a
few C-level passes over them (``map`` over ``operator.attrgetter`` and tensor methods, tuple
comparisons: no Python frame per tensor). :meth:`load` compares the viewed parameters' addresses
with those recorded (``p.data = ...`` changes them; a parameter's shape and dtype are the
optimizer's check, :meth:`~.bucket.Bucket.layout_problem`). :meth:`ready` and :meth:`gradients`
take every ``p.grad`` -- the same tensors each step (written in place, DDP's bucket views) or new
ones (``zero_grad()``'s default ``set_to_none=True``) alike -- and compare each one's shape, dtype
and contiguity with what the last full check of the gradients saw; only a difference (the first
step, a 16-bit or non-contiguous gradient appearing) runs the per-gradient checks in Python. Then
their addresses are read: new tensors usually reuse the last ones' addresses (torch's allocators
recycle them), and the core copies its table of addresses to the device only when they do not.
No gradient tensor is kept past the step, so ``zero_grad()`` frees them as with any optimizer.

A step where some parameter has no gradient, or a sparse one, goes tensor by tensor instead
(:meth:`ready`). Caveat of views, as with any flat-parameter scheme: ``torch.save`` of one
parameter alone saves its storage, the whole bucket (``model.state_dict()`` saves the bucket
once, shared by its parameters).
"""

import itertools
import operator

import torch

from slamb_comm import arrays as _arr
from slamb_comm.errors import LayoutError
from slamb_comm.device.tables import Addresses
from ...privates import foreach_copy_

__all__ = ["FlatBuffer", "wants_flat"]


def wants_flat(fused, device):
    """Whether a bucket on ``device`` uses flat buffers: ``fused`` True always, False never,
    None (the default) on CUDA devices only (on the CPU the core's blocked tensor-by-tensor
    step is faster than the device kernels' layout)."""
    if fused is None:
        return device.type == "cuda"
    return bool(fused)


_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_LAYOUT = operator.attrgetter("layout")
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")


class FlatBuffer:
    """Bucket ``e``'s parameters as one flat tensor of ``e.dtype``, laid out as ``e.comm.layout``,
    and its gradients as device addresses (see the module docstring)."""

    def __init__(self, e):
        lay = e.comm.layout
        ps = e.params
        self.params = ps
        self.dtype = e.dtype
        self.x = torch.empty(lay.total, dtype=e.dtype, device=ps[0].device)
        self.xv = [self.x[o:o + n].view(s) for (o, n), s in zip(lay.segments(), lay.shapes)]
        with torch.no_grad():
            foreach_copy_(self.xv, [p.detach() for p in ps])
        self.viewed = [i for i, p in enumerate(ps) if p.dtype == e.dtype and p.is_contiguous()]
        for i in self.viewed:
            ps[i].data = self.xv[i]
        keep = set(self.viewed)
        self.copied = [i for i in range(len(ps)) if i not in keep]
        self._record_parameters()
        self.array = _arr.as_array(self.x)
        self._meta = None  # what the last full check of the gradients saw (_meta_of); no tensor is kept
        self._converted = {}  # parameter index -> the buffer its gradient is converted into

    def _record_parameters(self):
        """Record the viewed parameters and their addresses, and the copied ones with their slices."""
        self._viewed = tuple(self.params[i] for i in self.viewed)
        self._ptrs = tuple(map(_DATA_PTR, self._viewed))
        self._copied = [self.params[i] for i in self.copied]
        self._copied_xv = [self.xv[i] for i in self.copied]

    def _read(self, grads):
        """``grads`` as a tuple, or every ``p.grad`` now (C level)."""
        return tuple(map(operator.attrgetter("grad"), self.params)) if grads is None else tuple(grads)

    def ready(self, grads=None):
        """Whether every parameter has a dense gradient (else the step goes tensor by tensor).
        ``grads``: every ``p.grad`` now, read here if not given."""
        grads = self._read(grads)
        return (all(map(operator.is_not, grads, itertools.repeat(None)))
                and all(map(operator.is_, map(_LAYOUT, grads), itertools.repeat(torch.strided))))

    @torch.no_grad()
    def load(self):
        """Before a step: re-adopt parameters whose ``.data`` was replaced, copy the copied
        parameters in. Returns the flat parameters (the core's array)."""
        if tuple(map(_DATA_PTR, self._viewed)) != self._ptrs:
            self._readopt()
        if self.copied:
            foreach_copy_(self._copied_xv, self._copied)
        return self.array

    def _readopt(self):
        """Viewed parameters whose ``.data`` was replaced since (same shape: the optimizer checked it):
        adopted again (values copied in, ``.data`` pointed back), or copied from now on."""
        ps = self.params
        moved = [i for i, ptr in zip(self.viewed, self._ptrs) if ps[i].data_ptr() != ptr]
        for i in moved:
            p = ps[i]
            if p.device != self.x.device:
                raise LayoutError(f"parameter {i} of this bucket moved from {self.x.device} to {p.device} after the "
                                  "optimizer was built; move the model first, then build the optimizer")
            if p.dtype == self.x.dtype and p.is_contiguous():
                self.xv[i].copy_(p.detach())
                p.data = self.xv[i]  # adopted again
            else:  # another dtype (e.g. model.half()) or memory format: copied in and out from now on
                self.viewed.remove(i)
                self.copied.append(i)
        self._record_parameters()

    @torch.no_grad()
    def gradients(self, grads=None):
        """The gradients (``grads``, default every ``p.grad``) as :class:`~slamb_comm.device.tables.Addresses`,
        read where they are; a gradient the kernels cannot read as it is (another dtype, or not
        contiguous) is converted into a buffer kept for it. Needs :meth:`ready`. Nothing keeps the
        gradient tensors after the step (``zero_grad()`` frees them, as with any optimizer)."""
        grads = self._read(grads)
        if self._meta_of(grads) != self._meta:
            self._adopt(grads)
        if not self._converted:
            return Addresses(tuple(map(_DATA_PTR, grads)), grads)
        idx = list(self._converted)
        foreach_copy_([self._converted[i] for i in idx], [grads[i] for i in idx])
        owners = list(grads)
        for i in idx:
            owners[i] = self._converted[i]
        return Addresses(tuple(map(_DATA_PTR, owners)), tuple(owners))

    @staticmethod
    def _meta_of(grads):
        """What decides how the gradients are read: each one's shape and dtype, and its contiguity
        (its device is its parameter's: torch checks it when ``p.grad`` is set, and :meth:`load`
        sees a parameter moved)."""
        return tuple(map(_SHAPE_DTYPE, grads)), tuple(map(_IS_CONTIGUOUS, grads))

    def _adopt(self, grads):
        """Gradients unlike the last ones: check each, and keep a conversion buffer for those that need one."""
        device = self.x.device
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g.device != device or g.shape != p.shape:
                raise LayoutError(f"the gradient of parameter {i} of this bucket is {tuple(g.shape)} on {g.device}, "
                                  f"its parameter {tuple(p.shape)} on {device}")
        need = {i for i, g in enumerate(grads) if g.dtype != self.dtype or not g.is_contiguous()}
        self._converted = {i: self._converted.get(i) if self._converted.get(i) is not None
                           else torch.empty(self.params[i].shape, dtype=self.dtype, device=device) for i in need}
        self._meta = self._meta_of(grads)

    @torch.no_grad()
    def store(self):
        """After a step: the copied parameters take their new values (cast to their dtype)."""
        if self.copied:
            foreach_copy_([p.data for p in self._copied], self._copied_xv)
