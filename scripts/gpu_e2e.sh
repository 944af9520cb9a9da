#!/usr/bin/env bash
# One GPU call (under ten minutes): build ffi/ with CMake; `kdtree-jax bench` on the embedded model (ar, chain,
# ddtree; pure-JAX kernels, then the CUDA tree kernels) with compile and run times and the equality with AR; the
# per-stage step breakdown of the embedded model and of a 2-layer model of K2 widths. Every step has its own
# time limit and writes its log under $OUT as it goes (a step that runs out of time still leaves its lines).
#   KDTREE_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash scripts/gpu_e2e.sh
# Environment: E2E_BUILTIN_ARGS, E2E_K2_ARGS (extra arguments of benchmarks/ddtree_e2e.py for each model).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
stamp() { while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done; }
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, show the last lines
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" 2>&1 | stamp > "$OUT/$name.log"
  echo "rc=${PIPESTATUS[0]}" >> "$OUT/$name.log"
  grep -v "^..:..:.. {" "$OUT/$name.log" | grep -v "Warning\|warn(" | tail -${TAIL:-25}
}
(cmake -S . -B /tmp/kd_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" &&
  cmake --build /tmp/kd_build -j "$(nproc)") > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi
BENCH=(python3 -m kdtree_jax.cli bench --budgets 16,64 --batch 2 --prompt-len 64 --max-new-tokens 32 --repeats 3)
step bench_xla 90 "${BENCH[@]}" --kernels xla --json "$OUT/bench_xla.json"
step bench_ffi 90 "${BENCH[@]}" --ffi-ops tree_build,tree_accept --json "$OUT/bench_ffi.json"
step e2e_builtin 120 env KDTREE_FFI_OPS=tree_build,tree_accept python3 benchmarks/ddtree_e2e.py --builtin \
  --kernels ffi --out "$OUT" --budgets 16,64,256 --batches 1,8 --prompt-len 128 --repeats 10 ${E2E_BUILTIN_ARGS:-}
step e2e_k2 200 python3 benchmarks/ddtree_e2e.py --kernels ffi --out "$OUT" --budgets 64 --batches 1,8 \
  --repeats 5 ${E2E_K2_ARGS:-}
