"""slamb_comm's CUDA kernels compile under NVRTC, without a GPU.

The strict CuPy double runs ``slamb_comm.device.kernels.SOURCE`` through the host's C++ compiler
(``tests/support/host_kernels.py``); this checks the other side of the dialect: NVRTC (the compiler
``cupy.RawModule`` uses on a GPU) takes the same text with ``slamb_comm.device.kernels.OPTIONS`` for
the A100's and H100's architectures, every kernel the library can ask for is an entry of the
PTX, and no multiply-add is contracted (``--fmad=false``: the device rounds ``a * b + c`` twice,
as the host build does with ``-ffp-contract=off``). NVRTC needs no device and no driver: it comes
with ``nvidia-cuda-nvrtc-cu12`` and CuPy's bindings (``scripts/setup.sh`` installs both). Skipped,
with the reason, only where NVRTC cannot be loaded.
"""

import re

import numpy as np
import pytest

from slamb_comm.device import kernels

ARCHS = ("compute_80", "compute_90")


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 -- not installed, or the library cannot be loaded: the same answer
        pytest.skip(f"NVRTC cannot be loaded ({type(e).__name__}: {e}): install cupy-cuda12x and "
                    "nvidia-cuda-nvrtc-cu12 (scripts/setup.sh does)")
    return nvrtc


def _ptx(arch):
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(kernels.SOURCE, "slamb.cu", (), ())
    try:
        nvrtc.compileProgram(prog, [*kernels.OPTIONS, f"--gpu-architecture={arch}"])
    except Exception as e:  # noqa: BLE001 -- NVRTCError: its log says why
        raise AssertionError(f"NVRTC failed for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
    ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _names():
    names = {kernels.kernel_name("trust", np.float32)}
    for v in ("float16", "float32", "float64"):
        names.add(kernels.kernel_name("verdict", None, v))
    for p in ("float32", "float64"):
        names |= {kernels.kernel_name("update", p), kernels.kernel_name("update_levels", p)}
        for v in ("float16", "float32", "float64"):
            names |= {kernels.kernel_name("pack", p, v), kernels.kernel_name("moments", p, v)}
    return names


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_under_nvrtc(arch):
    ptx = _ptx(arch)
    entries = set(re.findall(r"\.visible\s+\.entry\s+(\w+)\s*\(", ptx))
    names = _names()
    assert len(names) == 20
    assert names <= entries, sorted(names - entries)
    assert not re.search(r"\bfma\.", ptx), "a multiply-add was contracted: the host build would round differently"
