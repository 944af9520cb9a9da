#!/usr/bin/env bash
# mla_verify on the GPU machine in one call: FFI libraries, GPU tests, benchmark; logs and results under $OUT.
#
#   bash scripts/gpu_mla_verify.sh quick   # GPU-marked tests + ten benchmark configurations + key-split sweep
#   bash scripts/gpu_mla_verify.sh full    # GPU-marked and model tests + the whole benchmark grid
#
# The FFI libraries are taken from $KDTREE_JAX_FFI_DIR when they load there (built on the workstation with the same
# nvcc and carried), else built here with CMake. KDTREE_COMMIT stamps the benchmark results. Every step has a
# wall-clock limit, so a hung kernel costs minutes, not the lease.
set -u
MODE=${1:-quick}
OUT=${OUT:-/tmp/mla_verify_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"

if ! python3 -c "import ctypes, os, sys; d = os.environ.get('KDTREE_JAX_FFI_DIR', '');
[ctypes.CDLL(os.path.join(d, f)) for f in ('libkdtree_jax_cpu.so', 'libkdtree_jax_cuda.so')]" 2>/dev/null; then
  echo "building the FFI libraries here"
  cmake -S . -B /tmp/kd_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
    >"$OUT/build.log" 2>&1 && cmake --build /tmp/kd_build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  export KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi
fi

TESTS="gpu"
[ "$MODE" = full ] && TESTS="gpu or model"
JAX_PLATFORMS=cuda,cpu timeout 200 python3 -m pytest tests/test_mla_verify.py -q -k "$TESTS" -p no:cacheprovider \
  --timeout 60 -rA 2>&1 | tee "$OUT/tests.log" | tail -40

BENCH=(--out "$OUT")
[ "$MODE" = quick ] && BENCH+=(--quick --sweep --budget 40)
[ "$MODE" = full ] && BENCH+=(--budget 110)
timeout 200 python3 benchmarks/mla_verify.py "${BENCH[@]}" 2>&1 | tee "$OUT/bench.log"
