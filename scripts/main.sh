#!/usr/bin/env bash
# Set everything up (idempotent), then run the main job: SLAMB training of a small
# transformer language model on the Python standard library's source, 4 ranks under
# mpirun through Horovod (600 steps, a few minutes on 2 cores), logging loss and bytes
# per step and ending with a summary (final validation loss, bytes vs a dense allreduce).
# SLAMB: ratio 0.1, fp16 momentum payload, beta3 0.9, H = 100, lr 0.01 (the best of the
# convergence benchmark's grid).
# Extra arguments go to examples/train_lm.py (e.g. --value-dtype float32, --steps 200).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
bash scripts/setup.sh
# On one machine the run is bitwise reproducible. Across machines, numpy's OpenBLAS, torch's
# ATen kernels, MKL and oneDNN each pick a kernel by CPU at run time, and these kernels sum in
# different orders, so the same seed ends elsewhere (1.8191 with OpenBLAS's Haswell kernel,
# 1.8142 with its SkylakeX one, 1.8116 with ATen's AVX2 kernels). Pin them all to their AVX2
# versions on x86-64 hosts that have AVX2 and FMA, for the same figures on every such host with
# the same library versions. A variable already set is kept.
if [ "$(uname -m)" = x86_64 ] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-Haswell}" ATEN_CPU_CAPABILITY="${ATEN_CPU_CAPABILITY:-avx2}"
  export MKL_CBWR="${MKL_CBWR:-AVX2}" ONEDNN_MAX_CPU_ISA="${ONEDNN_MAX_CPU_ISA:-AVX2}"
fi
exec bash scripts/mpirun.sh 4 1800 "${PYTHON:-python3}" examples/train_lm.py --optimizer slamb --value-dtype float16 "$@"
