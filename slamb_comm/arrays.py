"""Array dispatch: NumPy on the CPU, CuPy on a GPU, DLPack in and out.

The library of an array is found by looking at the array itself and at
``sys.modules``; CuPy is never imported here. If no CuPy array has been handed to
slamb_comm, CuPy is never loaded (a test in a fresh subprocess checks this).
"""

import contextlib
import sys

import numpy as np

from .errors import DTypeError, SlambCommError

__all__ = ["namespace", "as_array", "is_cupy", "to_host", "synchronize", "device_scope", "cast_into", "cast",
           "import_cupy", "CuPyMissingError"]

# DLPack device types (dlpack.h): kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13.
_DL_CPU = (1, 3)
_DL_CUDA = (2, 13)


class CuPyMissingError(SlambCommError, ImportError):
    """A CUDA array was handed to the core, which needs CuPy for CUDA arrays, and CuPy cannot be
    imported. An ``ImportError`` (what is missing is a package) and a :class:`SlambCommError` (so
    an exchange that meets it on one rank raises on every rank instead of hanging)."""


def import_cupy(what):
    """CuPy, imported now because ``what`` (named in the error: a type, a device) is in CUDA memory.

    Raises:
        CuPyMissingError: ``import cupy`` failed; the message names the extra to install.
    """
    try:
        import cupy
    except ImportError as e:
        raise CuPyMissingError(
            f"{what} is in CUDA memory, and slamb_comm's core needs CuPy for CUDA arrays, but `import cupy` "
            f"failed ({type(e).__name__}: {e}). Install CuPy with pip install \"slamb_comm[cuda12]\" "
            '(or "slamb_comm[cuda13]" for CUDA 13 drivers)') from e
    return cupy


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
        CuPyMissingError: ``x`` lives in CUDA memory and CuPy cannot be imported (its message
            names the extra to install: ``slamb_comm[cuda12]`` or ``slamb_comm[cuda13]``).
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
        if getattr(x, "is_cpu", False) and hasattr(x, "numpy") and hasattr(x, "detach"):
            try:  # a torch CPU tensor: its own zero-copy view, several times cheaper than DLPack's
                return x.detach().numpy()
            except (RuntimeError, TypeError):  # e.g. a conjugate or negative view: DLPack below says why
                pass
        dev_type, _ = x.__dlpack_device__()
        if int(dev_type) in _DL_CPU:
            xp = np
        elif int(dev_type) in _DL_CUDA:
            xp = import_cupy(f"{type(x).__module__}.{type(x).__name__}")  # CuPy is imported only now
        else:
            raise TypeError(f"DLPack device type {int(dev_type)} is neither CPU nor CUDA")
        try:
            return xp.from_dlpack(x)
        except Exception as e:  # noqa: BLE001 -- BufferError, RuntimeError, ...: one named error instead
            raise DTypeError(f"cannot import {type(x).__module__}.{type(x).__name__} of dtype {dt or '?'} "
                             f"through DLPack: {e}") from e
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


# ---------------------------------------------------------------------------- float casts
# NumPy converts float16 in software, one element at a time, and raises the underflow flag
# element by element for results below float16's smallest normal number (2^24 such values
# take seconds). cast_into/cast give NumPy's own result, bit for bit, at close to memory
# speed: through torch's vectorised (F16C) cast when torch is already loaded, else through
# integer and float operations on the bit patterns in cache-sized blocks that raise no flag
# per element. CuPy's own casts are vectorised already and are used as they are.

#: elements per block of the NumPy conversions (a few uint32 scratch blocks fit in L2)
CAST_BLOCK = 1 << 16
#: below this many elements NumPy's own cast is cheaper than the ~15 vectorised calls of the
#: bit manipulation (about 20 us), even where every element is a float16 subnormal
SMALL_CAST = 64

_F16 = np.dtype(np.float16)


class _Format:
    """Constants of the float32/float64 <-> float16 bit conversions for one wide format."""

    def __init__(self, dtype, uint, sint, mant, bias):
        bits = 8 * np.dtype(dtype).itemsize
        self.dtype, self.uint, self.sint = np.dtype(dtype), uint, sint
        self.shift = mant - 10  # wide mantissa -> float16 mantissa
        self.sign_shift = bits - 16  # wide sign bit -> bit 15
        self.abs = (1 << (bits - 1)) - 1
        self.inf = ((1 << (bits - 1 - mant)) - 1) << mant  # exponent all ones
        self.clamp = (bias + 16) << mant  # 2^16: everything from here on encodes to Inf
        self.min_exp = (bias - 14) << mant  # 2^-14, float16's smallest normal number
        # Encoding (see _encode_half): s = |x| 2^d + 2^(e + mant - 10 + d) + c 2^10 ulp with
        # d + c = 24 - mant - bias (mod 64) and c < 6, so that s's exponent field plus c is
        # e + 14 modulo 64: float32 needs d = 0, c = 2; float64 d = 32, c = 5.
        r = (24 - mant - bias) % 64
        c = min(r, 5)
        self.a_add = (r - c) << mant
        self.b_add = ((mant - 10 + r - c) << mant) + (c << 10)
        # Decoding: the float16 bits placed as a wide float (with the sign), times 2^(bias-15)
        self.mask = (1 << (bits - 1)) | (0x7FFF << self.shift)
        self.mask -= 1 << bits  # as the signed integer of the same bits
        self.scale = self.dtype.type(2.0 ** (bias - 15))
        for k in ("abs", "inf", "a_add", "b_add", "shift", "sign_shift"):  # typed: faster ufunc calls
            setattr(self, k, uint(getattr(self, k)))
        self.mask, self.dshift = sint(self.mask), sint(self.shift)


_FORMATS = {np.dtype(np.float32): _Format(np.float32, np.uint32, np.int32, 23, 127),
            np.dtype(np.float64): _Format(np.float64, np.uint64, np.int64, 52, 1023)}
_CONSTS = {}


def _const(dtype, value, n):
    """A read-only array of at least ``n`` elements ``value`` (NumPy's minimum and maximum
    against an array run vectorised, against a scalar not)."""
    key = (np.dtype(dtype), value)
    a = _CONSTS.get(key)
    if a is None or a.size < n:
        a = np.full(n, value, dtype)
        a.flags.writeable = False
        _CONSTS[key] = a
    return a


def _half_nan_bits(u, f):
    """NumPy's float16 bits of the NaN wide bit patterns ``u`` (the payload's top 10 bits,
    kept a NaN)."""
    r = ((u >> f.shift) & 0x3FF).astype(np.uint16) | np.uint16(0x7C00)
    r[r == 0x7C00] = 0x7C01
    return r | ((u >> f.sign_shift) & 0x8000).astype(np.uint16)


def _encode_half(x, o):
    """``o[:] = x.astype(float16)`` for contiguous 1-D float32/float64 ``x`` and uint16 ``o``.

    IEEE round-to-nearest-even without a per-element branch. With ``a = |x|`` clamped to
    2^16 and e = max(exponent(a), -14), the float addition s = a 2^d + b, where
    b = 2^(e + mant - 10 + d) + c 2^10 ulp, has float16's last place (times 2^d) as its last
    place ulp: b is a multiple of ulp and s stays in b's binade, so the addition rounds a
    exactly as float16 does, and s's mantissa is c 2^10 + k, k <= 2^11 the rounded magnitude
    in float16 last places. d and c (see _Format) make s's exponent field plus c equal to
    e + 14 modulo 64, so the float16 bits are ((s >> shift) + s) modulo 2^16 (the exponent on
    bits 10-15, k below it), plus the sign. Zero and subnormal results (e = -14), rounding up
    into the next binade or to Inf (k = 2^11 carries into the exponent) and |x| >= 2^16
    (clamped: 31 << 10, Inf) come out right by themselves; NaNs are patched with NumPy's bits.
    No element-wise flag: the one float operation has a normal result.
    """
    f = _FORMATS[x.dtype]
    n = x.size
    u = x.view(f.uint)
    bs = min(n, CAST_BLOCK)
    a_all, b_all = np.empty(bs, f.uint), np.empty(bs, f.uint)
    hi_c, lo_c = _const(f.uint, f.clamp, bs), _const(f.uint, f.min_exp, bs)
    sign = f.uint(0x8000)
    for lo in range(0, n, bs):
        hi = min(lo + bs, n)
        k = hi - lo
        ub, a, b, ob = u[lo:hi], a_all[:k], b_all[:k], o[lo:hi]
        np.bitwise_and(ub, f.abs, out=a)
        nan = np.maximum.reduce(a) > f.inf
        np.minimum(a, hi_c[:k], out=a)
        np.bitwise_and(a, f.inf, out=b)
        np.maximum(b, lo_c[:k], out=b)
        b += f.b_add
        if f.a_add:
            a += f.a_add
        s = b.view(f.dtype)
        np.add(a.view(f.dtype), s, out=s)
        np.right_shift(b, f.shift, out=a)
        a += b
        np.right_shift(ub, f.sign_shift, out=b)
        b &= sign
        a |= b
        np.copyto(ob, a, casting="unsafe")  # the low 16 bits
        if nan:
            i = np.flatnonzero((ub & f.abs) > f.inf)
            ob[i] = _half_nan_bits(ub[i], f)
    return o


def _decode_half(h, out):
    """``out[:] = h.astype(out.dtype)`` for contiguous 1-D float16 ``h`` and float32/float64
    ``out``: the sign-extended bits shifted into place, masked, and times 2^(bias - 15) (exact,
    subnormals included); Inf and NaN patched with NumPy's bits."""
    f = _FORMATS[out.dtype]
    n = h.size
    hs, hu = h.view(np.int16), h.view(np.uint16)
    oi, ou = out.view(f.sint), out.view(f.uint)
    bs = min(n, CAST_BLOCK)
    for lo in range(0, n, bs):
        hi = min(lo + bs, n)
        ob = oi[lo:hi]
        np.copyto(ob, hs[lo:hi], casting="unsafe")
        ob <<= f.dshift
        ob &= f.mask
        fb = out[lo:hi]
        fb *= f.scale
        if np.maximum.reduce(hs[lo:hi]) >= 0x7C00 or np.maximum.reduce(hu[lo:hi]) >= 0xFC00:  # Inf or NaN
            hb = hu[lo:hi]
            i = np.flatnonzero((hb & 0x7C00) == 0x7C00)
            v = hb[i].astype(f.uint)
            ou[lo + i] = ((v & 0x8000) << f.sign_shift) | f.inf | ((v & 0x3FF) << f.shift)
    return out


def _torch():
    """torch if it is already loaded (never imported here), else None."""
    t = sys.modules.get("torch")
    return t if t is not None and hasattr(t, "from_numpy") else None


def _has_nan_half(hu):
    """Whether the float16 bits ``hu`` (uint16) hold a NaN."""
    return hu.view(np.int16).max() > 0x7C00 or hu.max() > 0xFC00


def _torch_cast(torch, x, out):
    """torch's vectorised cast of the whole array (one call: torch's threads start once per
    call), or False where NumPy's bits must be computed instead: a NaN on the float16 side
    (the hardware quietens signalling NaNs, NumPy keeps them; the two agree on everything else)."""
    if x.dtype == _F16:
        if _has_nan_half(x.view(np.uint16)):
            return False
        torch.from_numpy(out).copy_(torch.from_numpy(x))
        return True
    torch.from_numpy(out).copy_(torch.from_numpy(x))
    return not _has_nan_half(out.view(np.uint16))


def cast_into(out, x):
    """``out[...] = x`` between float dtypes, bit for bit ``x.astype(out.dtype)``; returns ``out``.

    IEEE round-to-nearest-even as NumPy does it, including overflow to Inf, subnormals,
    signed zeros and NaN payloads (NumPy's: the top mantissa bits, a NaN kept a NaN), but
    at close to memory speed and without NumPy's element-wise float16 conversion, which is
    slow and raises the floating-point underflow flag per subnormal result. No warning is
    issued for overflow (NumPy's astype warns; the core checks finiteness itself).

    On CuPy arrays this is the plain vectorised assignment (CuPy's NaN payloads are CUDA's).
    On NumPy arrays, float16 to/from float32 or float64: torch's vectorised cast on
    ``torch.from_numpy`` views when torch is already imported (it is never imported here),
    else exact integer bit manipulation in cache-sized blocks (:data:`CAST_BLOCK`); below
    :data:`SMALL_CAST` elements, and for every other pair of dtypes (vectorised in
    hardware), NumPy's own cast.

    Args:
        out: the destination array (NumPy or CuPy), of ``x``'s shape (or one that ``x``
            broadcasts to).
        x: the source array, of the same library.
    """
    if not isinstance(out, np.ndarray) or not isinstance(x, np.ndarray):
        namespace(out, x)  # both CuPy, or a TypeError
        out[...] = x
        return out
    src, dst = x.dtype, out.dtype
    if src == dst or _F16 not in (src, dst) or (src if dst == _F16 else dst) not in _FORMATS:
        np.copyto(out, x, casting="unsafe")
        return out
    if x.shape != out.shape:
        x = np.broadcast_to(x, out.shape)
    if not out.flags.c_contiguous:
        tmp = np.empty(out.shape, dst)
        cast_into(tmp, x)
        np.copyto(out, tmp)
        return out
    if out.size < SMALL_CAST:
        with np.errstate(all="ignore"):
            np.copyto(out, x, casting="unsafe")
        return out
    xs = np.ascontiguousarray(x).reshape(-1)
    o = out.reshape(-1)
    encode = dst == _F16
    torch_ok = src == np.float32 if encode else True  # torch's float64 -> float16 rounds twice
    torch = _torch() if torch_ok else None
    if torch is not None and xs.flags.writeable and o.flags.writeable and xs.dtype.isnative and o.dtype.isnative:
        try:
            if _torch_cast(torch, xs, o):
                return out
        except (RuntimeError, TypeError, ValueError):  # e.g. a torch without NumPy support
            pass
    if encode:
        _encode_half(xs, o.view(np.uint16))
    else:
        _decode_half(xs, o)
    return out


def cast(x, dtype, copy=True):
    """``x.astype(dtype, copy=copy)`` through :func:`cast_into` (a new array unless ``copy``
    is false and ``x`` already has ``dtype``)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype and not copy:
        return x
    if not isinstance(x, np.ndarray):
        return x.astype(dtype, copy=copy)
    return cast_into(np.empty(x.shape, dtype), x)
