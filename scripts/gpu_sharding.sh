#!/usr/bin/env bash
# One call on the 2-GPU machine (kind nvidia-h200-x2), under ten minutes: build ffi/, the sharding equality tests
# on the two real GPUs (xla and ffi kernels; XLA's GEMM autotuning off to keep compiles short: the tests compare
# results, not speed), then benchmarks/sharding.py (K2-width layers on 2 then 1 GPU + the 8-GPU projection; the
# results files are rewritten after every measurement). Logs under $OUT.
#   KDTREE_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash scripts/gpu_sharding.sh [--kernels ffi]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
(cmake -S . -B /tmp/kd_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" &&
  cmake --build /tmp/kd_build -j "$(nproc)") > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi
JAX_PLATFORMS=cuda XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -k 5 "${TEST_LIMIT:-130}" \
  python3 -m pytest -q -rA tests/test_sharding.py > "$OUT/sharding_tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/sharding_tests.log"; grep -E "^(PASSED|FAILED|ERROR)| passed| failed" \
  "$OUT/sharding_tests.log" | tail -12
timeout -k 5 "${BENCH_LIMIT:-200}" python3 benchmarks/sharding.py --out "$OUT" "$@" > "$OUT/sharding_bench.log" 2>&1
echo "bench rc=$?"; grep -v '^{' "$OUT/sharding_bench.log" | grep -v "Warning\|warn(" | tail -30
