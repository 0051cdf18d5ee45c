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
exec bash scripts/mpirun.sh 4 1800 "${PYTHON:-python3}" examples/train_lm.py --optimizer slamb --value-dtype float16 "$@"
