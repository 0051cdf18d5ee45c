"""CUDA C kernels run on the host: the machinery behind the strict CuPy double's ``RawModule``.

The kernels of :mod:`slamb_comm.device.kernels` are written in a dialect (its ``PRELUDE``) that the
host's C++ compiler also accepts: without ``__CUDACC__`` a kernel is an ``extern "C"``
function, ``blockIdx``/``blockDim``/``gridDim`` are globals of the library, and a block's
threads run one after another in each ``SLAMB_FOR_THREADS`` phase. :func:`build` compiles such
a source into a shared library and reads its kernels' C signatures; :class:`HostKernel` runs
one over a grid, block after block, with the checks a GPU does not make:

* every argument must be what CuPy would pass for that C parameter (a device array whose
  dtype is the pointee's, or a NumPy scalar of exactly the parameter's type): a Python
  ``float`` for an ``int``, a float64 array for a ``float*``, a NumPy host array or a missing
  argument raise ``TypeError`` naming the kernel, the parameter and both types (on a GPU the
  kernel would silently read garbage);
* an array passed to a ``const`` pointer must come out unchanged (``RuntimeError``
  otherwise): the kernels' const-correctness is checked by executing them.

Compilation: ``g++ -O2 -std=c++17 -ffp-contract=off -fPIC -shared -x c++`` (no contraction
into fused multiply-adds: the device side compiles with ``--fmad=false``), cached on disk by
the sha256 of the source, the flags and the compiler's version (``$SLAMB_HOST_KERNELS_CACHE``,
else ``$XDG_CACHE_HOME/slamb_comm/host_kernels``, else under the temporary directory); several
processes (MPI ranks) may build the same source at once: each writes its own temporary file
and renames it into place. A library is loaded once per process.
"""

import ctypes
import hashlib
import json
import os
import re
import subprocess
import tempfile
import threading

import numpy as np

__all__ = ["build", "HostLibrary", "HostKernel", "Param", "FLAGS"]

FLAGS = ("-O2", "-std=c++17", "-ffp-contract=off", "-fPIC")
CXX = os.environ.get("CXX", "g++")

#: C scalar types (qualifiers dropped, ``int`` folded into its modifiers) -> the NumPy dtypes
#: CuPy passes for them. ``unsigned short`` is how the dialect spells float16's bits.
C_TYPES = {
    "float": ("float32",), "double": ("float64",), "int": ("int32",), "unsigned int": ("uint32",),
    "long long": ("int64",), "unsigned long long": ("uint64",), "long": ("int64",), "unsigned long": ("uint64",),
    "short": ("int16",), "unsigned short": ("float16", "uint16"), "char": ("int8",), "unsigned char": ("uint8",),
    "bool": ("bool",),
}
_CTYPES = {"float32": ctypes.c_float, "float64": ctypes.c_double, "int32": ctypes.c_int32,
           "uint32": ctypes.c_uint32, "int64": ctypes.c_int64, "uint64": ctypes.c_uint64, "int16": ctypes.c_int16,
           "uint16": ctypes.c_uint16, "float16": ctypes.c_uint16, "int8": ctypes.c_int8, "uint8": ctypes.c_uint8,
           "bool": ctypes.c_bool}
_QUALIFIERS = {"const", "volatile", "restrict", "__restrict__", "__restrict", "struct"}
_KEYWORDS = {"int", "long", "short", "char", "float", "double", "unsigned", "signed", "bool", "void"} | _QUALIFIERS
_KERNEL = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(([^()]*)\)\s*\{')
_TYPEDEF = re.compile(r"\btypedef\s+([A-Za-z_][\w\s]*?)\s+([A-Za-z_]\w*)\s*;")


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class Param:
    """One parameter of a kernel: its position, declaration, the dtypes it accepts, and whether
    it is a pointer (to ``const`` data)."""

    def __init__(self, index, decl, ctype, pointer, const):
        self.index, self.decl, self.ctype, self.pointer, self.const = index, decl, ctype, pointer, const
        self.dtypes = C_TYPES.get(ctype, ()) if ctype != "void" else None  # None: any (void*)

    def expected(self):
        what = "any dtype" if self.dtypes is None else "/".join(self.dtypes) or f"unsupported {self.ctype}"
        return f"a device array of {what}" if self.pointer else f"a numpy.{what} scalar"


def _canonical(words, typedefs):
    """The C type named by ``words`` (qualifiers dropped, typedefs resolved): 'unsigned long long'."""
    ws = [w for w in words if w not in _QUALIFIERS]
    if len(ws) == 1 and ws[0] in typedefs:
        return _canonical(typedefs[ws[0]], typedefs)
    unsigned = "unsigned" in ws
    ws = [w for w in ws if w not in ("unsigned", "signed")]
    if "int" in ws and len(ws) > 1:
        ws.remove("int")
    return ("unsigned " if unsigned else "") + (" ".join(ws) or "int")


def _param(index, decl, typedefs):
    """Parse one parameter's declaration ('const float* __restrict__ a9', 'u64 key')."""
    tokens = re.findall(r"[A-Za-z_]\w*|\*|\[", decl)
    words = [t for t in tokens if t not in ("*", "[")]
    if len(words) > 1 and words[-1] not in _KEYWORDS and words[-1] not in typedefs:
        words = words[:-1]  # its name
    stars = [i for i, t in enumerate(tokens) if t in ("*", "[")]
    const = bool(stars) and "const" in tokens[: stars[0]]  # const data, not a const pointer
    ctype = _canonical(words, typedefs) + "*" * max(0, len(stars) - 1)  # a pointer to pointers: unsupported
    return index, decl, ctype, bool(stars), const


def _signatures(preprocessed):
    """{kernel name: [(index, declaration, C type, pointer?, const data?), ...]} of the extern "C" kernels."""
    typedefs = {name: body.split() for body, name in _TYPEDEF.findall(preprocessed)}
    sigs = {}
    for name, params in _KERNEL.findall(preprocessed):
        decls = [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]
        sigs[name] = [_param(i, d, typedefs) for i, d in enumerate(decls)]
    return sigs


def _cache_dir():
    d = os.environ.get("SLAMB_HOST_KERNELS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slamb_comm", "host_kernels")
    try:
        os.makedirs(d, exist_ok=True)
        return d
    except OSError:
        d = os.path.join(tempfile.gettempdir(), f"slamb_comm_host_kernels_{os.getuid()}")
        os.makedirs(d, exist_ok=True)
        return d


def _run(cmd, stdin):
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"host kernel build failed ({' '.join(cmd)}):\n{r.stderr[-6000:]}")
    return r.stdout


def _replace_into(path, write):
    """Write ``path`` through a temporary name of this process, then rename it into place."""
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _compile(code):
    """(path of the shared library, signatures) for ``code``, from the disk cache or built now."""
    version = _run([CXX, "-dumpfullversion", "-dumpversion"], "").strip()
    digest = hashlib.sha256("\0".join((code, " ".join(FLAGS), CXX, version)).encode()).hexdigest()
    base = os.path.join(_cache_dir(), digest)
    so, sig = base + ".so", base + ".json"
    if not os.path.exists(sig):
        text = _run([CXX, *FLAGS, "-E", "-P", "-x", "c++", "-"], code)

        def dump(tmp):
            with open(tmp, "w") as f:
                json.dump(_signatures(text), f)
        _replace_into(sig, dump)
    if not os.path.exists(so):
        _replace_into(so, lambda tmp: _run([CXX, *FLAGS, "-shared", "-x", "c++", "-", "-o", tmp], code))
    with open(sig) as f:
        return so, json.load(f)


class HostLibrary:
    """A compiled source: its kernels by name, and the grid globals of the dialect."""

    def __init__(self, code):
        path, sigs = _compile(code)
        self._lib = ctypes.CDLL(path)
        self._sigs = {name: [Param(*p) for p in params] for name, params in sigs.items()}
        try:
            self._dims = {n: _Dim3.in_dll(self._lib, n) for n in ("blockIdx", "blockDim", "gridDim")}
        except ValueError:
            raise RuntimeError("host kernels need the dialect of slamb_comm.device.kernels.PRELUDE (its blockIdx, "
                               "blockDim and gridDim globals)") from None
        self._kernels = {}

    def kernel(self, name):
        k = self._kernels.get(name)
        if k is None:
            if name not in self._sigs:
                raise AttributeError(f"no kernel named {name!r} in the module (kernels: {sorted(self._sigs)})")
            k = self._kernels[name] = HostKernel(self, name, self._sigs[name])
        return k


_LIBRARIES = {}  # source -> HostLibrary, once per process


def build(code):
    """The :class:`HostLibrary` of ``code`` (compiled once per machine, loaded once per process)."""
    lib = _LIBRARIES.get(code)
    if lib is None:
        lib = _LIBRARIES[code] = HostLibrary(code)
    return lib


def _type_name(x):
    if isinstance(x, np.ndarray):
        return f"numpy.ndarray (host memory) of {x.dtype}"
    if isinstance(x, np.generic):
        return f"numpy.{x.dtype.name}"
    kind = f"{type(x).__module__}.{type(x).__qualname__}".removeprefix("builtins.")
    return f"{kind} of {x.dtype}" if hasattr(x, "dtype") else kind


class HostKernel:
    """One kernel of a :class:`HostLibrary`: ``run(grid, block, args, device_array)``."""

    def __init__(self, library, name, params):
        self.library, self.name, self.params = library, name, params
        self._fn = getattr(library._lib, name)
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p if p.pointer else _CTYPES[p.dtypes[0]] if p.dtypes else ctypes.c_void_p
                             for p in params]

    def _bad(self, p, x, why=""):
        return TypeError(f"kernel {self.name}: argument {p.index} ({p.decl}) takes {p.expected()}, got "
                         f"{_type_name(x)}{why}")

    def _pointer(self, p, x, device_array):
        try:
            a = device_array(x)
        except TypeError as e:
            raise self._bad(p, x, f": {e}") from None
        if a is None:
            raise self._bad(p, x)
        if p.dtypes is not None and a.dtype.name not in p.dtypes:
            raise self._bad(p, x)
        return a

    def _scalar(self, p, x):
        if not isinstance(x, np.generic) or not p.dtypes or x.dtype.name not in p.dtypes:
            raise self._bad(p, x)
        return x.view(np.uint16).item() if x.dtype == np.float16 else x.item()

    def bind(self, args, device_array):
        """The C arguments for ``args``, and the arrays behind ``const`` pointers (to check)."""
        args = tuple(args)
        if len(args) != len(self.params):
            raise TypeError(f"kernel {self.name}: takes {len(self.params)} arguments, got {len(args)}")
        cargs, const = [], []
        for p, x in zip(self.params, args):
            if p.pointer:
                a = self._pointer(p, x, device_array)
                cargs.append(ctypes.c_void_p(a.ctypes.data))
                if p.const:
                    const.append((p, a))
            else:
                cargs.append(self._scalar(p, x))
        return cargs, const

    def run(self, grid, block, args, device_array):
        """Run the kernel over ``grid`` (blocks one after another) with ``block`` threads each.
        ``device_array(x)``: the NumPy array inside a device array, None for anything else
        (it may raise ``TypeError`` for a device array this launch cannot take)."""
        grid, block = _dims(grid), _dims(block)
        if grid[1:] != (1, 1) or block[1:] != (1, 1):
            raise NotImplementedError(f"kernel {self.name}: the host runs 1-D grids and blocks, got {grid} x {block}")
        cargs, const = self.bind(args, device_array)
        before = [(p, a, a.copy()) for p, a in const]
        dims = self.library._dims
        # the library's grid variables and shared arrays are process-wide: ranks that are
        # threads of one process (ThreadRanks) run one grid at a time, as one GPU's stream would
        with _ONE_GRID_AT_A_TIME:
            dims["blockDim"].x, dims["blockDim"].y, dims["blockDim"].z = block
            dims["gridDim"].x, dims["gridDim"].y, dims["gridDim"].z = grid
            dims["blockIdx"].y = dims["blockIdx"].z = 0
            for b in range(grid[0]):
                dims["blockIdx"].x = b
                self._fn(*cargs)
        for p, a, old in before:
            if a.tobytes() != old.tobytes():
                raise RuntimeError(f"kernel {self.name} wrote argument {p.index} ({p.decl}), a const pointer")


_ONE_GRID_AT_A_TIME = threading.Lock()


def _dims(d):
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))
