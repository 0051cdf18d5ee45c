#!/usr/bin/env bash
# One idempotent set-up step for slamb_comm on a fresh Debian machine with Python 3.11:
# Open MPI, torch==2.13.0 (CPU wheel), mpi4py, CuPy 14.2 with NVRTC and ptxas (no GPU needed), Horovod 0.28.1
# built from its sdist with PyTorch + MPI + Gloo, and this package in editable mode with its extras.
# A second run skips every step that is already done. Any failure stops the script and
# names the step that failed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
HOROVOD_VERSION=0.28.1
CUPY_VERSION=14.2.0
STEP=""
# pip run as root (a container, CI) warns on every install; the warning asks nothing of the user here
export PIP_ROOT_USER_ACTION=ignore

step() { STEP="$1"; echo "[setup] $1"; }
trap 'echo "[setup] FAILED during: ${STEP}" >&2' ERR

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# Every pip install below takes the torch pin as a constraint: an unpinned resolve could replace
# the CPU wheel with a CUDA build of several GB.
PIN="$(mktemp)"
echo "torch==${TORCH_VERSION}" > "$PIN"
trap 'rm -f "$PIN"' EXIT

step "Debian packages: Open MPI (openmpi-bin, libopenmpi-dev), iproute2 and ping (emulated cluster)"
APT_PKGS=(openmpi-bin libopenmpi-dev iproute2 iputils-ping)
missing=()
for p in "${APT_PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[setup]   already installed: $(mpirun --version 2>/dev/null | head -n1)"
else
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

step "torch==${TORCH_VERSION} (CPU wheel)"
if "$PY" -c "import torch,sys; sys.exit(0 if torch.__version__.split('+')[0]=='${TORCH_VERSION}' else 1)" 2>/dev/null; then
  echo "[setup]   already installed"
else
  "$PY" -m pip install -q "torch==${TORCH_VERSION}"
fi

step "build and runtime Python packages (numpy, mpi4py, pytest, pytest-mpi, hypothesis, ...)"
"$PY" -m pip install -q --disable-pip-version-check -c "$PIN" numpy mpi4py pytest pytest-mpi pytest-timeout hypothesis \
  cloudpickle psutil pyyaml packaging cffi wheel setuptools matplotlib scikit-learn tqdm

step "CuPy ${CUPY_VERSION} (cupy-cuda12x) and NVRTC (nvidia-cuda-nvrtc-cu12): the kernels' compile check, no GPU needed"
# tests/test_kernels_nvrtc.py compiles slamb_comm's CUDA kernels with NVRTC on this CPU-only
# machine; the strict double (tests/support/strict_cupy.py) charges CuPy's calls as CuPy 14.2 runs them.
if "$PY" -c "import cupy, sys; from cupy_backends.cuda.libs import nvrtc; nvrtc.getVersion()
sys.exit(0 if cupy.__version__ == '${CUPY_VERSION}' else 1)" 2>/dev/null; then
  echo "[setup]   already installed"
else
  "$PY" -m pip install -q --disable-pip-version-check -c "$PIN" "cupy-cuda12x==${CUPY_VERSION}" nvidia-cuda-nvrtc-cu12
fi

step "ptxas (nvidia-cuda-nvcc-cu12): the kernels' registers and spills, no GPU needed"
# tests/test_kernels_ptxas.py assembles NVRTC's PTX with the wheel's nvidia/cuda_nvcc/bin/ptxas.
if "$PY" -c "import nvidia, os, sys
sys.exit(0 if any(os.access(os.path.join(p, 'cuda_nvcc', 'bin', 'ptxas'), os.X_OK) for p in nvidia.__path__) else 1)" 2>/dev/null; then
  echo "[setup]   already installed"
else
  "$PY" -m pip install -q --disable-pip-version-check -c "$PIN" nvidia-cuda-nvcc-cu12
fi

step "frameworks the integration tests run under: accelerate, transformers, lightning (torch pinned)"
# (timm is not installed: it pulls a CUDA torchvision that breaks transformers.)
if "$PY" -c "import accelerate, transformers, lightning" 2>/dev/null; then
  echo "[setup]   already installed"
else
  "$PY" -m pip install -q --disable-pip-version-check -c "$PIN" accelerate transformers "lightning>=2.6,<2.7"
fi

step "horovod==${HOROVOD_VERSION} with PyTorch, MPI and Gloo"
if "$PY" - <<PYEOF 2>/dev/null
import sys, horovod, horovod.torch as hvd
ok = horovod.__version__ == "${HOROVOD_VERSION}" and hvd.mpi_built() and hvd.gloo_built()
sys.exit(0 if ok else 1)
PYEOF
then
  echo "[setup]   already built"
else
  BUILD="$(mktemp -d)"
  ( cd "$BUILD"
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==${HOROVOD_VERSION}"
    tar xzf "horovod-${HOROVOD_VERSION}.tar.gz"
    cd "horovod-${HOROVOD_VERSION}"
    # PyTorch >= 2.1 needs C++17; the 0.28.1 release still asks for C++14 (fixed upstream later).
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' CMakeLists.txt horovod/torch/CMakeLists.txt
    grep -q 'CMAKE_CXX_STANDARD 17' horovod/torch/CMakeLists.txt
    echo "[setup]   compiling Horovod (about 4 minutes on 2 cores)"
    CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip install -q --no-build-isolation --no-deps --no-cache-dir . )
  rm -rf "$BUILD"
  "$PY" -c "import horovod.torch as hvd; assert hvd.mpi_built() and hvd.gloo_built()"
fi

step "slamb_comm (editable, extras test + horovod)"
# Asked from / so that this checkout's own folder cannot answer for the installed package, and
# for both packages, so that an install of another checkout is replaced.
installed_from() { (cd / && "$PY" -c 'import os, slamb_comm, slamb_comm.adapters as a
print(os.path.dirname(os.path.dirname(slamb_comm.__file__)), os.path.dirname(os.path.dirname(a.__file__)))' 2>/dev/null); }
if [ "$(installed_from)" = "$HERE $HERE" ]; then
  echo "[setup]   already installed from $HERE"
else
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -c "$PIN" -e "${HERE}[test,horovod]"
fi
STEP=""
# pip run as root (a container, CI) warns on every install; the warning asks nothing of the user here
export PIP_ROOT_USER_ACTION=ignore
echo "[setup] done"
