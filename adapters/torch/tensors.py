"""Torch tensors as the core's arrays: compute dtypes, views, CUDA streams, lazy conversion.

The one place where a torch tensor becomes a NumPy/CuPy array for :mod:`slamb_comm` (and
back): the dtype slamb_comm computes in for each parameter dtype (16-bit -> float32), views
without copies (:func:`torch_view`, :func:`tensor_of`), the CUDA stream scope that orders the
core's CuPy work with torch's (:func:`cuda_scope`), and the lazily converted parameter and
gradient sequences a bucket hands to the core (:class:`Params`, :class:`Grads`).
"""

import contextlib

import numpy as np
import torch

from slamb_comm import arrays as _arr

__all__ = ["torch_view", "tensor_of", "state_dtype", "np_dtype", "torch_dtype", "as_compute", "cuda_scope",
           "local_of", "is_dtensor", "grad_array", "Params", "Grads"]


def is_dtensor(t):
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and gradients)."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


def local_of(t):
    """This rank's piece of ``t``: ``t.to_local()`` for a DTensor (a view of its storage: an in-place
    update of it updates the DTensor), ``t`` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def torch_view(buf):
    """A torch tensor sharing memory with a NumPy (CPU) or CuPy (CUDA) buffer."""
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf)
    if _arr.is_cupy(buf):
        _arr.synchronize(buf)  # the buffer must be complete before the collective reads it
        return torch.from_dlpack(buf)
    raise TypeError(f"expected a numpy or cupy array, got {type(buf).__module__}.{type(buf).__name__}")


def state_dtype(dtype):
    """The dtype slamb_comm computes in for parameters of ``dtype``: 16-bit -> float32."""
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float32
    raise TypeError(f"slamb_comm cannot optimise parameters of dtype {dtype}: it steps float16, bfloat16, float32 and "
                    "float64 parameters; leave the others out of the optimizer's parameters (or set requires_grad=False)")


def np_dtype(tdtype):
    return np.dtype({torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}[tdtype])


def torch_dtype(npdtype):
    return {"float16": torch.float16, "float32": torch.float32, "float64": torch.float64}[np.dtype(npdtype).name]


def as_compute(t, dtype):
    """``t`` (detached) as a contiguous tensor of ``dtype``; no copy when it already is one."""
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def cuda_scope(device):
    """For tensors on a CUDA ``device``: CuPy's current device is that device and its current
    stream is torch's current stream there, so what the core queues is ordered with torch's own
    work (before: the gradients; after: whatever reads the parameters) without a host
    synchronisation. A no-op context for CPU tensors."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    cupy = _arr.import_cupy(f"a parameter on {device}")  # names the extra to install where CuPy is missing

    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()))
    stack.enter_context(cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream))
    return stack


def tensor_of(a):
    """A torch view of a NumPy/CuPy array."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


def grad_array(p, dtype):
    """``p``'s gradient as an array of ``dtype`` (zeros where ``p`` has none): a view where it is one."""
    if p.grad is None:
        return _arr.as_array(torch.zeros(p.shape, dtype=dtype, device=p.device))
    return _arr.as_array(as_compute(p.grad, dtype))


class Params:
    """The parameters of a bucket as a lazily read sequence of arrays of the bucket's dtype:
    a view for float32/float64 parameters, a converted copy for 16-bit ones, made when the
    core reads the tensor and written back (and dropped) when it calls :meth:`written`. So a
    bfloat16 model never has more than one tensor's float32 copy alive. One object per step:
    a view, once made, is kept for the step (a DTensor's ``to_local()`` costs tens of µs)."""

    def __init__(self, e):
        self.e = e
        self._copy = {}
        self._view = {}

    def __len__(self):
        return len(self.e.params)

    def __getitem__(self, i):
        x = self._view.get(i)
        if x is not None:
            return x
        x = self._copy.get(i)
        if x is None:
            p = local_of(self.e.params[i])
            x = as_compute(p, self.e.dtype)
            if x.data_ptr() != p.data_ptr():
                self._copy[i] = x
            else:
                self._view[i] = x = _arr.as_array(x)
                return x
        return _arr.as_array(x)

    def written(self, i):
        x = self._copy.pop(i, None)
        if x is not None:
            local_of(self.e.params[i]).data.copy_(x)


class Grads:
    """The gradients of a bucket as a lazily read sequence of arrays of the bucket's dtype
    (zeros for a parameter without a gradient; converted per access for 16-bit ones). One
    object per step: a gradient that needs no conversion is viewed once and kept."""

    def __init__(self, e):
        self.e = e
        self._view = {}

    def __len__(self):
        return len(self.e.params)

    def __getitem__(self, i):
        a = self._view.get(i)
        if a is not None:
            return a
        p = self.e.params[i]
        g = p.grad
        if g is None:
            return _arr.as_array(torch.zeros(local_of(p).shape, dtype=self.e.dtype, device=p.device))
        g = local_of(g)
        c = as_compute(g, self.e.dtype)
        a = _arr.as_array(c)
        if c.data_ptr() == g.data_ptr():
            self._view[i] = a
        return a
