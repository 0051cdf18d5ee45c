#!/usr/bin/env bash
# Set everything up (idempotent), then run the main job: SLAMB training at 4 ranks under
# mpirun (NumPy model on scikit-learn's bundled digits), printing loss, accuracy and the
# bytes moved against dense LAMB. Extra arguments go to the example.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$HERE"
bash scripts/setup.sh
exec bash scripts/mpirun.sh 4 1200 "${PYTHON:-python3}" examples/numpy_slamb.py "$@"
