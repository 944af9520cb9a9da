#!/usr/bin/env bash
# The decoding loop with XLA's WHILE and CONDITIONAL command buffers (a loop nest captured as one CUDA graph with
# conditional nodes, no host read of the loop condition per step) against XLA's default (a host loop launching one
# graph per step), and budget="auto"'s two loops (KDTREE_JAX_AUTO_LOOP=phases | switch), on the embedded model at
# C=1: `benchmarks/auto_budget.py overhead` (wall per call and per step, the AR check, a profile) once per setting,
# each in its own process (the flags and the loop are read when a program is compiled). One H200, ~6-8 minutes.
#   OUT=/tmp/out KDTREE_COMMIT=<hash> bash scripts/gpu_cmdbuf.sh
# Environment: COSTS (auto's cost model, default the committed C=1 one of aec89a4), LENGTHS (new tokens of the
# fitted calls, default 128,512), EACH (seconds per setting, default 150), CMDBUF (the flag value, default
# +WHILE,+CONDITIONAL: XLA's defaults plus those two), ALL=1 (also the switch loop with the default command buffers;
# past one call's 10 minutes with the defaults above), RUNS (which settings and budgets, default
# "default_phases:ar,16,auto graph_phases:ar,16,auto graph_switch:ar,auto"; default_switch is the fourth).
# Compiled programs are shared by the settings through JAX's compilation cache (JAX_COMPILATION_CACHE_DIR, default
# /tmp/kdtree_jaxcache; its key holds XLA_FLAGS, so a setting reuses only its own flags' programs).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/kdtree_jaxcache}
OUT=${OUT:-/tmp/out}
C=${KDTREE_COMMIT:-unknown}
COSTS=${COSTS:-benchmarks/results/auto_budget/runs/2026-12-01_aec89a4_embedded_c1/auto_budget_embedded.json}
mkdir -p "$OUT"
. "$(dirname "$0")/ffi_env.sh"
run() {  # $1: name, $2: XLA_FLAGS, $3: auto loop, $4: budgets
  local t0=$SECONDS
  KDTREE_JAX_AUTO_LOOP=$3 XLA_FLAGS="$2" timeout -k 5 "${EACH:-150}" python3 benchmarks/auto_budget.py overhead \
    --costs "$COSTS" --concurrency 1 --budgets "$4" --lengths "${LENGTHS:-128,512}" --new-tokens 128 --repeats 5 \
    --out "$OUT/$1" --commit "$C" 2>&1 | grep -v -i "warn\|donat" > "$OUT/$1.log"
  local rc=${PIPESTATUS[0]}
  echo "--- $1 (XLA_FLAGS='$2', loop $3, budgets $4): rc $rc$([ "$rc" = 124 ] && echo ', timed out'), $((SECONDS - t0)) s"
  grep -E "budget|profile|Error|error" "$OUT/$1.log" | head -12
}
GRAPH="--xla_gpu_enable_command_buffer=${CMDBUF:-+WHILE,+CONDITIONAL}"
RUNS=${RUNS:-default_phases:ar,16,auto graph_phases:ar,16,auto graph_switch:ar,auto${ALL:+ default_switch:ar,auto}}
for r in $RUNS; do
  name=${r%%:*}
  flags=""; [ "${name%%_*}" = graph ] && flags=$GRAPH
  run "$name" "$flags" "${name#*_}" "${r#*:}"
done
