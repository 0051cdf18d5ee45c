"""Array dispatch: NumPy on the CPU, CuPy on a GPU, DLPack in and out.

The library of an array is found by looking at the array itself and at
``sys.modules``; CuPy is never imported here. If no CuPy array has been handed to
slamb_comm, CuPy is never loaded (a test in a fresh subprocess checks this).
"""

import contextlib
import sys

import numpy as np

from .errors import DTypeError

__all__ = ["namespace", "as_array", "is_cupy", "to_host", "synchronize", "device_scope"]

# DLPack device types (dlpack.h): kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13.
_DL_CPU = (1, 3)
_DL_CUDA = (2, 13)


def is_cupy(x):
    """True if ``x`` is a CuPy array (without importing CuPy)."""
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def namespace(*arrays):
    """Return ``numpy`` or ``cupy``, whichever all ``arrays`` belong to.

    Raises:
        TypeError: if the arrays mix libraries, or one of them is not a NumPy/CuPy array.
    """
    found = None
    for a in arrays:
        if isinstance(a, np.ndarray):
            xp = np
        elif is_cupy(a):
            xp = sys.modules["cupy"]
        else:
            raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(a).__module__}.{type(a).__name__}")
        if found is None:
            found = xp
        elif xp is not found:
            raise TypeError(f"arrays mix {found.__name__} and {xp.__name__}; pass arrays of one library")
    if found is None:
        raise TypeError("no arrays given")
    return found


def as_array(x):
    """View ``x`` as a NumPy or CuPy array without copying.

    NumPy and CuPy arrays pass through. Any other object with ``__dlpack__`` (a torch
    tensor, a JAX array) is imported with DLPack: CPU memory becomes a NumPy array, CUDA
    memory a CuPy array (CuPy is imported only then). The result shares memory with
    ``x``, so in-place updates are seen by the owner of ``x``.

    Raises:
        DTypeError: the object's dtype has no NumPy/CuPy equivalent (bfloat16, for
            example), whatever exception the DLPack import itself would raise, so that the
            communicator can turn it into a collective error.
        TypeError: ``x`` is not an array at all.
    """
    if isinstance(x, np.ndarray) or is_cupy(x):
        return x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dt = str(getattr(x, "dtype", ""))
        if "bfloat16" in dt:
            raise DTypeError(f"cannot exchange {dt} arrays: NumPy and CuPy have no bfloat16; convert to float32 "
                             "(the torch adapters do this for you)")
        dev_type, _ = x.__dlpack_device__()
        try:
            if int(dev_type) in _DL_CPU:
                return np.from_dlpack(x)
            if int(dev_type) in _DL_CUDA:
                import cupy  # a CUDA array was handed to us, so CuPy is needed

                return cupy.from_dlpack(x)
        except Exception as e:  # noqa: BLE001 -- BufferError, RuntimeError, ...: one named error instead
            raise DTypeError(f"cannot import {type(x).__module__}.{type(x).__name__} of dtype {dt or '?'} "
                             f"through DLPack: {e}") from e
        raise TypeError(f"DLPack device type {int(dev_type)} is neither CPU nor CUDA")
    raise TypeError(
        f"cannot use {type(x).__module__}.{type(x).__name__} as an array: "
        "pass a numpy/cupy array or an object with __dlpack__"
    )


def device_scope(x):
    """A context in which new arrays are allocated on ``x``'s device (CuPy allocates on its
    *current* device, not on its inputs'); a no-op context for NumPy arrays."""
    if isinstance(x, np.ndarray):
        return contextlib.nullcontext()
    return x.device


def to_host(x):
    """A NumPy copy (or the array itself, if already NumPy) of ``x``."""
    if isinstance(x, np.ndarray):
        return x
    return x.get()


def synchronize(x):
    """Wait for the current CUDA stream if ``x`` is a CuPy array; no-op for NumPy.

    MPI knows nothing of CUDA streams: a device buffer must be complete before it is
    handed to MPI. NCCL takes the stream instead and needs no such wait.
    """
    if not isinstance(x, np.ndarray):
        sys.modules["cupy"].cuda.get_current_stream().synchronize()


_VALUE_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def value_dtype(name):
    """Resolve a payload dtype name ('float16'/'fp16', 'float32'/'fp32', 'float64')."""
    if isinstance(name, str):
        key = {"fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32", "fp64": "float64"}.get(
            name, name
        )
        if key in ("bfloat16", "bf16"):
            raise DTypeError(
                "bfloat16 payloads are not supported: NumPy and the MPI transport have no bfloat16; use 'float16'"
            )
        if key not in _VALUE_DTYPES:
            raise DTypeError(f"unsupported payload dtype {name!r}; choose one of {sorted(_VALUE_DTYPES)}")
        return np.dtype(_VALUE_DTYPES[key])
    dt = np.dtype(name)
    if dt.name not in _VALUE_DTYPES:
        raise DTypeError(f"unsupported payload dtype {dt.name!r}; choose one of {sorted(_VALUE_DTYPES)}")
    return dt
