#!/usr/bin/env bash
# benchmarks/auto_budget.py on the GPU machine in one call (kind nvidia-h200-x2): the full-scale part (61 layers as
# one GPU of ep=8, ~80 GB; with kernel profiles of auto's tier-16 step vs fixed 16) on GPU 0 while the embedded-model
# part runs on GPU 1. Logs and the two JSON files under $OUT; then, on any machine:
#   python benchmarks/auto_budget.py report --out <dir with the JSON files> --commit <hash>
#   OUT=/tmp/out KDTREE_COMMIT=<hash> bash scripts/gpu_auto_budget.sh
# Environment: FULL_LIMIT / EMB_LIMIT (seconds, default 390 / 330), CELL_BUDGET (the full-scale part starts no new
# cell after this many seconds, default 290). One GPU: run the two parts one after the other instead.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} KDTREE_JAX_COSTS=${KDTREE_JAX_COSTS:-/tmp/costs}
OUT=${OUT:-/tmp/out}
C=${KDTREE_COMMIT:-unknown}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt"
. "$(dirname "$0")/ffi_env.sh"
(CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout -k 5 "${FULL_LIMIT:-390}" python3 \
   benchmarks/auto_budget.py fullscale --profile --out "$OUT" --commit "$C" --budget-s "${CELL_BUDGET:-290}" 2>&1 |
   grep -v -i "warn\|donat" > "$OUT/full.log") &
(CUDA_VISIBLE_DEVICES=1 timeout -k 5 "${EMB_LIMIT:-330}" python3 benchmarks/auto_budget.py embedded --out "$OUT" \
   --commit "$C" 2>&1 | grep -v -i "warn\|donat" > "$OUT/emb.log") &
wait
grep -v "calibrating" "$OUT/full.log" | tail -20; echo ---; grep -v "calibrating" "$OUT/emb.log" | tail -16
