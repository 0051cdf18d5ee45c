#!/usr/bin/env bash
# bash benchmarks/gpu_check.sh [OUTDIR]     (a machine lent a GPU, no network: at most 5 minutes on an H100/H200)
#
# What a session lent a GPU runs first, in one command. Parts, in this order, each under `timeout`
# (its own limit, cut to what is left of the whole budget, GPU_CHECK_BUDGET_S, default 290 s), and
# the script goes on past a part that fails or times out and reports it:
#   1. install this tree without a network (pip --no-deps --no-build-isolation --no-index);
#   2. tests/test_gpu.py (CuPy against NumPy, NCCL, the torch SLAMB on CUDA);
#   3. benchmarks/gpu_step.py: the optimizer step at 64M float32 parameters in 10/100/1,000 tensors,
#      AdamW(fused) against SLAMB (fp32 and fp16 payloads), with torch.profiler's device time of
#      every kernel per step (gpu_step_64M_kernels.csv; each arm's longest kernels in the log);
#   4. benchmarks/gpu_train_step.py: a whole training step of a 217M-parameter GPT-like model,
#      bf16 autocast, AdamW(fused) / SLAMB / DistributedOptimizer(SLAMB) on a 1-rank NCCL group;
#   5. gpu_step.py at 512M parameters in 100 tensors, AdamW(fused) and SLAMB, a fresh process each;
#   6. Nsight Compute's SpeedOfLight section of the SLAMB kernels of a few steps (where ncu works);
#   7. tests/test_strict_cupy.py with SLAMB_COMM_REAL_CUPY=1 (the strict double's comparisons on
#      real CuPy).
# Everything (CSVs, the ncu report, gpu_check.log) goes to OUTDIR (default: $OUT if set, else
# benchmarks/results/gpu_check); the log ends with a summary naming the card and the date.
# GPU_CHECK_TINY=1 is a dry run on the CPU at tiny sizes, without the install (tested by hand
# on a machine without a GPU: parts 2, 6 and 7 skip there).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-${OUT:-$HERE/benchmarks/results/gpu_check}}"
mkdir -p "$OUTDIR" || exit 1
OUTDIR="$(cd "$OUTDIR" && pwd)"
LOG="$OUTDIR/gpu_check.log"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-290}"
TINY="${GPU_CHECK_TINY:-0}"
RESERVE=15  # seconds kept for the summary
cd "$HERE" || exit 1
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RESULTS=()

note() { echo "[gpu_check] $*"; }

# part NAME LIMIT_S CMD...: run CMD under timeout (LIMIT_S, cut to what the budget has left) and
# record how it ended; never stops the script.
part() {
  local name="$1" limit="$2" left t0 rc status
  shift 2
  left=$((BUDGET - SECONDS - RESERVE))
  if [ "$left" -lt 15 ]; then
    note "=== $name: skipped, the budget of ${BUDGET}s is spent"
    RESULTS+=("$name: SKIPPED (budget spent)")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  note "=== $name (at most ${limit}s): $*"
  t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@"
  rc=$?
  case $rc in
    0) status="ok" ;;
    124 | 137) status="TIMED OUT after ${limit}s" ;;
    *) status="FAILED (rc $rc)" ;;
  esac
  note "=== $name: $status in $((SECONDS - t0))s"
  RESULTS+=("$name: $status, $((SECONDS - t0))s")
}

skip() {  # skip NAME WHY
  note "=== $1: skipped: $2"
  RESULTS+=("$1: SKIPPED ($2)")
}

card_name() {
  local name
  name="$(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
  [ -n "$name" ] || name="$(timeout 60 "$PY" -c 'import torch
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (the CPU)")' 2>/dev/null)"
  echo "${name:-unknown}"
}

# `python -P` (3.11+) leaves the working directory off sys.path, so that pytest imports the
# installed package (with slamb_comm.adapters) and not the tree's slamb_comm/ folder.
PYP=("$PY")
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' && PYP=("$PY" -P)

if [ "$TINY" = 1 ]; then
  STEP64=(--device cpu --tensors '2,5' --elements 20000 --reps 3 --profile-steps 1)
  STEP512=(--device cpu --tensors 3 --elements 30000 --reps 3 --profile-steps 1)
  TRAIN=(--device cpu --layers 2 --width 64 --heads 4 --vocab 256 --batch 2 --seq 32 --steps 2 --warmup 1 --repeats 2)
  NCU_STEP=(--device cpu --tensors 3 --elements 30000 --reps 3)
else
  STEP64=(--tensors '10,100,1000' --elements $((64 << 20)) --reps 30)
  STEP512=(--tensors 100 --elements $((512 << 20)) --reps 20 --profile-steps 2)
  TRAIN=()
  NCU_STEP=(--tensors 100 --elements $((64 << 20)) --reps 5)
fi

note "slamb_comm GPU check, $(date -u '+%F %T UTC'), out: $OUTDIR, budget ${BUDGET}s"
note "tree: $(git -C "$HERE" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')" \
  "($(git -C "$HERE" status --porcelain 2>/dev/null | wc -l) paths changed or new)"
timeout 20 nvidia-smi 2>/dev/null || note "nvidia-smi: not available"
timeout 60 "$PY" - <<'PYEOF' || note "versions: could not be read"
import importlib, platform
print("[gpu_check] python", platform.python_version())
for m in ("torch", "cupy", "mpi4py", "triton"):
    try:
        print(f"[gpu_check] {m} {importlib.import_module(m).__version__}")
    except Exception as e:  # noqa: BLE001
        print(f"[gpu_check] {m}: {type(e).__name__}: {e}")
PYEOF

# Where pip cannot install the tree: the package as the install lays it out (slamb_comm/ with
# adapters/ as slamb_comm/adapters), in links under a temporary folder on PYTHONPATH.
linked_package() {
  local dir f
  dir="$(mktemp -d)" && mkdir "$dir/slamb_comm" || return 1
  for f in "$HERE"/slamb_comm/*; do ln -s "$f" "$dir/slamb_comm/"; done
  ln -s "$HERE/adapters" "$dir/slamb_comm/adapters"
  export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
  note "slamb_comm from links to this tree in $dir (PYTHONPATH)"
}

if [ "$TINY" = 1 ]; then
  skip "install" "GPU_CHECK_TINY=1: the installed slamb_comm is used as it is"
else
  part "install" 90 "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    --no-index "$HERE"
  (cd / && "$PY" -c "import slamb_comm.adapters.torch" 2>/dev/null) || linked_package
fi

part "tests/test_gpu.py" 75 "${PYP[@]}" -m pytest -q -p no:cacheprovider --junitxml="$OUTDIR/test_gpu.xml" \
  tests/test_gpu.py

part "gpu_step 64M" 100 "$PY" benchmarks/gpu_step.py "${STEP64[@]}" --top-kernels 6 \
  --out "$OUTDIR/gpu_step_64M.csv" --kernels-out "$OUTDIR/gpu_step_64M_kernels.csv"

part "gpu_train_step" 100 "$PY" benchmarks/gpu_train_step.py "${TRAIN[@]}" --out "$OUTDIR/gpu_train_step.csv"

part "gpu_step 512M (fresh process per arm)" 90 "$PY" benchmarks/gpu_step.py "${STEP512[@]}" --fresh \
  --arms adamw-fused,slamb --top-kernels 6 --out "$OUTDIR/gpu_step_512M.csv" \
  --kernels-out "$OUTDIR/gpu_step_512M_kernels.csv"

if ! command -v ncu >/dev/null 2>&1; then
  skip "ncu SpeedOfLight" "ncu (Nsight Compute) is not on PATH"
elif [ "$TINY" = 1 ]; then
  skip "ncu SpeedOfLight" "GPU_CHECK_TINY=1: no GPU"
else
  # The first steps (step 1 syncs the parameters) are skipped; then 15 slamb_ kernels are profiled,
  # into a report that the second command prints as CSV (one row per kernel and metric).
  part "ncu SpeedOfLight" 90 ncu --clock-control none --section SpeedOfLight -k regex:slamb_ \
    --launch-skip 10 --launch-count 15 --export "$OUTDIR/ncu_slamb_sol" --force-overwrite \
    "$PY" benchmarks/gpu_step.py "${NCU_STEP[@]}" --arms slamb --no-profile
  if [ -f "$OUTDIR/ncu_slamb_sol.ncu-rep" ]; then
    # shellcheck disable=SC2016  # $1 and $2 are the inner shell's arguments
    part "ncu report as CSV" 30 bash -c 'ncu --import "$1" --csv --page details > "$2"' _ \
      "$OUTDIR/ncu_slamb_sol.ncu-rep" "$OUTDIR/ncu_slamb_sol.csv"
  fi
fi

if [ "$TINY" = 1 ]; then
  skip "strict double on real CuPy" "GPU_CHECK_TINY=1: no GPU"
else
  part "strict double on real CuPy" 60 env SLAMB_COMM_REAL_CUPY=1 "${PYP[@]}" -m pytest -q -p no:cacheprovider \
    --junitxml="$OUTDIR/test_strict_cupy_real.xml" tests/test_strict_cupy.py
fi

note "=== summary"
timeout 30 "$PY" - "$OUTDIR" <<'PYEOF' || note "summary of the CSVs: failed"
import csv, os, sys

out = sys.argv[1]


def rows(name):
    path = os.path.join(out, name)
    return list(csv.DictReader(open(path))) if os.path.exists(path) and os.path.getsize(path) > 2 else []


def f(x, spec=".2f"):
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return "-"


for name in ("gpu_step_64M.csv", "gpu_step_512M.csv"):
    for r in rows(name):
        print(f"[gpu_check] {name[:-4]}: {r['tensors']:>5s} tensors {r['arm']:12s} {f(r['step_ms_median'], '8.3f')} ms"
              f"  x{f(r['vs_first_arm'])} of the first arm, {f(r['kernels_per_step'], '.0f')} kernels/step")
for r in rows("gpu_train_step.csv"):
    ratio = next((v for k, v in r.items() if k.startswith("vs_") and k.endswith("_median")), None)
    print(f"[gpu_check] train step: {r['arm']:18s} {f(r['step_ms_median'])} ms ({f(r['step_ms_min'])}-"
          f"{f(r['step_ms_max'])}), optimizer {f(r['opt_ms_median'])} ms, x{f(ratio)} of the first arm, "
          f"{r['params']} parameters")
sol = os.path.join(out, "ncu_slamb_sol.csv")
if os.path.exists(sol):
    lines = [l for l in open(sol) if l.startswith('"')]
    table = list(csv.DictReader(lines))
    keep = ("Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput")
    for r in table:
        if r.get("Metric Name") in keep:
            print(f"[gpu_check] ncu: {r.get('ID', '?'):>3s} {r.get('Kernel Name', '?')[:40]:40s} "
                  f"{r['Metric Name']:26s} {r.get('Metric Value', '?')} {r.get('Metric Unit', '')}")
PYEOF
note "card: $(card_name)"
note "date: $(date -u '+%F %T UTC'); whole check: ${SECONDS}s of a ${BUDGET}s budget"
for r in "${RESULTS[@]}"; do note "  $r"; done
note "outputs: $OUTDIR ($(find "$OUTDIR" -type f | wc -l) files)"
failed=0
for r in "${RESULTS[@]}"; do case "$r" in *FAILED* | *"TIMED OUT"*) failed=1 ;; esac; done
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit $failed
