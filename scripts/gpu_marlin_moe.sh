#!/usr/bin/env bash
# marlin_moe on the GPU machine in one call: a CMake build of ffi/ against that machine's jax (with the ptxas report
# of ffi/marlin_moe.cu), the GPU-marked tests of tests/test_marlin_moe.py, and benchmarks/marlin_moe.py. Logs,
# the results table (.md), the plot (.png) and the numbers (.json) go to $OUT. Every step has a wall-clock
# limit that keeps one call under ten minutes.
#
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh          # build, GPU tests, quick benchmark (M = 1, 4, ..., 4096)
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh bench    # build, full benchmark (M = 1, 2, ..., 4096) + block_m sweep
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh tests    # build, GPU tests only
#
# KDTREE_COMMIT stamps the benchmark results (default: git rev-parse --short HEAD, when git is there).
set -u
MODE=${1:-all}
OUT=${OUT:-/tmp/marlin_moe_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
export KDTREE_COMMIT=${KDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
START=$(date +%s)

{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv
  python3 -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  nvcc --version | tail -1
  cmake --version | head -1
  echo "commit $KDTREE_COMMIT, mode $MODE"
} 2>&1 | tee "$OUT/env.txt"

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
BUILD=/tmp/kd_marlin_build
if ! timeout 300 bash -c "cmake -S . -B $BUILD ${GEN[*]} -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE=$(command -v python3) && cmake --build $BUILD -j $(nproc)" >"$OUT/build.log" 2>&1; then
  echo "build failed:"; tail -40 "$OUT/build.log"; exit 1
fi
export KDTREE_JAX_FFI_DIR=$BUILD/ffi
ls -la "$KDTREE_JAX_FFI_DIR"/*.so | tee -a "$OUT/env.txt"

# registers, spills and shared memory of every marlin_moe kernel, as built here
JAXINC=$(python3 -c "import jax; print(jax.ffi.include_dir())")
timeout 120 nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -Xptxas -v -diag-suppress=940,2473 \
  -I"$JAXINC" -Iffi -Xcompiler -fPIC -c ffi/marlin_moe.cu -o /tmp/marlin_moe_ptxas.o 2>&1 |
  grep -E "Compiling entry|registers|spill|stack" | { command -v c++filt >/dev/null && c++filt || cat; } \
  >"$OUT/ptxas.txt"
SPILLS=$(grep -c '[1-9][0-9]* bytes spill' "$OUT/ptxas.txt")
echo "ptxas: $(grep -c registers "$OUT/ptxas.txt") kernels, lines with spills: $SPILLS"

if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
  JAX_PLATFORMS=cuda,cpu timeout 330 python3 -m pytest tests/test_marlin_moe.py -q -m gpu -p no:cacheprovider \
    -rA --durations=12 >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"
  grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi

if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
  LEFT=$((570 - ($(date +%s) - START)))
  BENCH=(--out "$OUT" --commit "$KDTREE_COMMIT" --budget $((LEFT > 90 ? LEFT - 90 : 30)))
  [ "$MODE" = all ] && BENCH+=(--quick)
  [ "$MODE" = bench ] && BENCH+=(--sweep)
  timeout $((LEFT > 30 ? LEFT : 30)) python3 benchmarks/marlin_moe.py "${BENCH[@]}" 2>&1 | tee "$OUT/bench.log" |
    tail -25
fi
echo "done in $(($(date +%s) - START)) s; results in $OUT"
