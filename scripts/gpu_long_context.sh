#!/usr/bin/env bash
# benchmarks/long_context.py on the GPU machine, with the GPU tests of what it measures. Two calls:
#   OUT=/tmp/out KDTREE_COMMIT=<hash> bash scripts/gpu_long_context.sh one   # nvidia-h200: mla_verify GPU tests,
#                                                                           # then parts sweep, attention, prefill
#   OUT=/tmp/out KDTREE_COMMIT=<hash> bash scripts/gpu_long_context.sh two   # nvidia-h200-x2: sharding GPU tests,
#                                                                           # then part mesh
# Every step has a time limit; each part rewrites its JSON as it goes. Then, here:
#   python benchmarks/long_context.py report --out <dir with the JSON files> --commit <hash>
set -uo pipefail
MODE=${1:-one}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env_$MODE.txt"
. "$(dirname "$0")/ffi_env.sh"
BENCH=(python3 benchmarks/long_context.py --out "$OUT" --commit "${KDTREE_COMMIT:-unknown}")
run_part() {  # part, time limit in seconds
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 timeout -k 5 "$2" "${BENCH[@]}" "$1" "${@:3}" 2>&1 | grep -v -i "warn\|donat" |
    grep -v "^|\|^#\|^$\|^heads:\|^\`" | tee -a "$OUT/bench_$MODE.log"
}
if [ "$MODE" = one ]; then
  JAX_PLATFORMS=cuda,cpu timeout -k 5 "${TEST_LIMIT:-90}" python3 -m pytest -q -rA -m gpu tests/test_mla_verify.py \
    -k "prefix or fast_path" > "$OUT/gpu_tests_one.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/gpu_tests_one.log" | tail -8
  run_part attention 60
  run_part sweep "${SWEEP_LIMIT:-220}"
  run_part prefill "${PREFILL_LIMIT:-200}"
else
  JAX_PLATFORMS=cuda XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -k 5 "${TEST_LIMIT:-150}" python3 -m pytest -q -rA \
    tests/test_sharding.py > "$OUT/gpu_tests_two.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/gpu_tests_two.log" | tail -8
  XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true run_part mesh "${MESH_LIMIT:-300}"
fi
