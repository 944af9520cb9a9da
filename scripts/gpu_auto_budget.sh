#!/usr/bin/env bash
# benchmarks/auto_budget.py on the GPU machine, one call per part (issue 19):
#   PART=fullscale  the full-scale part (61 layers as one GPU of ep=8, ~80 GB; with kernel profiles of auto's tier-16
#                   step vs fixed 16), one H200 (kind nvidia-h200), timed marginally (runs of 2 STEPS minus runs of
#                   STEPS); one concurrency per call: CONC=1 (~5.5 min), CONC=10 (longer: pass CELL_BUDGET/FULL_LIMIT)
#   PART=embedded   the embedded-model part (batch sizes EMB_CONC, default 1,10; budgets EMB_BUDGETS, default all), then `report` with the full-scale JSON of an earlier call, where one is
#                   given (FULL_JSON=path in the carried tree, e.g. scratch/auto_budget_fullscale.json), so that the
#                   projection's acceptance comes from the same prompts as the embedded table; one H200
#   PART=fullscale2 the full-scale part at C=1 (GPU 0, under $OUT/c1) and at C=10 (GPU 1, under $OUT/c10) at once, on
#                   two GPUs (kind nvidia-h200-x2): both parts' steps are GPU-bound (18-100 ms), so sharing the host
#                   matters less than for the embedded model; CONC is ignored
#   PART=embedded2  the embedded-model part at C=1 (GPU 0, under $OUT/c1) and at C=10 (GPU 1, under $OUT/c10) at once
#                   (kind nvidia-h200-x2), budgets EMB_BUDGETS1 / EMB_BUDGETS10 (default: every budget); no report.
#                   auto and the fixed budgets of one concurrency run side by side in one process; the other job
#                   shares the host, so compare within a concurrency, not across the two
#   PART=both       both at once on two GPUs (kind nvidia-h200-x2): quicker, but the two jobs share the host, and the
#                   embedded model's launch-bound steps are slower while the full-scale part compiles next to it
# Logs and JSON under $OUT; then, on any machine: python benchmarks/auto_budget.py report --out DIR --commit HASH
#   OUT=/tmp/out KDTREE_COMMIT=<hash> PART=embedded FULL_JSON=scratch/auto_budget_fullscale.json bash scripts/gpu_auto_budget.sh
# EMB_TIERS: auto's tiers in the embedded part (e.g. 0,8,16,32,64,128: autoregressive steps among the choices).
# Environment: FULL_LIMIT / EMB_LIMIT (seconds, default 540 / 450), CELL_BUDGET (the full-scale part starts no new
# cell after this many seconds, default 420), STEPS (k of the full-scale timing, default 4), CONC (full-scale batch
# sizes, default 1), REPORT_LIMIT (seconds, default 300) and BATCHES (the projection's batches per cell, default 12;
# the report can also run afterwards on another machine, but its prompts come from the running Python's standard
# library: the same acceptance needs the same Python version).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} KDTREE_JAX_COSTS=${KDTREE_JAX_COSTS:-/tmp/costs}
OUT=${OUT:-/tmp/out}
C=${KDTREE_COMMIT:-unknown}
PART=${PART:-both}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt"
. "$(dirname "$0")/ffi_env.sh"
full() {  # $1: the GPU, $2: the batch sizes, $3: the output folder
  mkdir -p "$3"
  CUDA_VISIBLE_DEVICES=$1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout -k 5 "${FULL_LIMIT:-540}" python3 \
    benchmarks/auto_budget.py fullscale --profile --out "$3" --commit "$C" --budget-s "${CELL_BUDGET:-420}" \
    --steps "${STEPS:-4}" --concurrency "$2" 2>&1 | grep -v -i "warn\|donat" > "$3/full.log"
}
embedded() {  # $1: the GPU; $2, $3, $4 (optional): the batch sizes, the budgets, the output folder
  local out=${4:-$OUT}
  mkdir -p "$out"
  CUDA_VISIBLE_DEVICES=$1 timeout -k 5 "${EMB_LIMIT:-450}" python3 benchmarks/auto_budget.py embedded --out "$out" \
    --commit "$C" --concurrency "${2:-1,10}" --budgets "${3:-8,16,32,64,128,auto}" ${EMB_TIERS:+--tiers "$EMB_TIERS"} 2>&1 |
    grep -v -i "warn\|donat" > "$out/emb.log"
  if [ -n "${FULL_JSON:-}" ]; then
    cp "$FULL_JSON" "$OUT/auto_budget_fullscale.json"
    CUDA_VISIBLE_DEVICES=$1 timeout -k 5 "${REPORT_LIMIT:-300}" python3 benchmarks/auto_budget.py report --out "$OUT" \
      --commit "$C" --batches "${BATCHES:-12}" 2>&1 |
      grep -v -i "warn\|donat" > "$OUT/report.log"
  fi
}
case "$PART" in
  fullscale) full 0 "${CONC:-1}" "$OUT" ;;
  fullscale2) full 0 1 "$OUT/c1" & full 1 10 "$OUT/c10" & wait ;;
  embedded) embedded 0 "${EMB_CONC:-1,10}" "${EMB_BUDGETS:-8,16,32,64,128,auto}" ;;
  embedded2) embedded 0 1 "${EMB_BUDGETS1:-8,16,32,64,128,auto}" "$OUT/c1" &
    embedded 1 10 "${EMB_BUDGETS10:-8,16,32,64,128,auto}" "$OUT/c10" & wait ;;
  both) full 0 "${CONC:-1}" "$OUT" & embedded 1 & wait ;;
  *) echo "PART must be fullscale, fullscale2, embedded, embedded2 or both, got $PART"; exit 2 ;;
esac
for f in full c1/full c10/full emb c1/emb c10/emb report; do
  [ -f "$OUT/$f.log" ] && { echo "--- $f"; grep -v "calibrating" "$OUT/$f.log" | grep -v "^    " | tail -20; }
done
