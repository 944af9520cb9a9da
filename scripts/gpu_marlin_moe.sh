#!/usr/bin/env bash
# marlin_moe on the GPU machine in one call: the FFI libraries (prebuilt ones from $PREBUILT when they load there,
# else a CMake build of ffi/ against that machine's jax), the GPU-marked tests of tests/test_marlin_moe.py, and
# benchmarks/marlin_moe.py. Logs, the results table (.md), the plot (.png) and the numbers (.json) go to $OUT.
# Every step has a wall-clock limit that keeps one call under five minutes.
#
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh            # tests, then a quick comparison of the paths and flags
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh bench      # the full benchmark: both shapes, M = 1 .. 4096, before/after
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh tests      # the GPU tests only
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh testbench  # the GPU tests, then the full benchmark
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh final      # testbench, then ncu profiles of the gemm kernels ($PROFILES)
#   OUT=<dir> bash scripts/gpu_marlin_moe.sh probe      # the benchmark (narrowed by BENCH_ARGS), then the profiles
#                                                       # (PROFILE_SOURCE=1: also the sampled stalls per SASS line)
#
# Environment: KDTREE_COMMIT stamps the results (default: git rev-parse --short HEAD); PREBUILT = a directory with
# libkdtree_jax_cpu.so / libkdtree_jax_cuda.so built elsewhere (skips the build when both load); BASELINE_LIB = an
# older libkdtree_jax_cuda.so exporting KdMarlinMoeCudaOld (the benchmark's `before`), or BASELINE_CU = the older
# marlin_moe.cu to build it from; TESTS_K = a pytest -k filter; BENCH_ARGS = extra benchmark arguments; LIMIT =
# seconds for the whole call (default 290).
set -u
MODE=${1:-all}
OUT=${OUT:-/tmp/marlin_moe_out}
LIMIT=${LIMIT:-290}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
# (the device machine's .git may be older than the tree it was sent: a tree that differs from HEAD is marked, so pass
# KDTREE_COMMIT=<hash> written out in the command)
export KDTREE_COMMIT=${KDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD \
  -- kdtree_jax ffi benchmarks 2>/dev/null || echo +modified)}
START=$(date +%s)
left() { echo $((LIMIT - ($(date +%s) - START))); }

{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv
  python3 -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  nvcc --version | tail -1
  echo "commit $KDTREE_COMMIT, mode $MODE"
} 2>&1 | tee "$OUT/env.txt"

JAXINC=$(python3 -c "import jax; print(jax.ffi.include_dir())")
LIBS=""
if [ -n "${PREBUILT:-}" ] && python3 -c "import ctypes, sys; [ctypes.CDLL(sys.argv[1] + '/' + n) for n in
    ('libkdtree_jax_cpu.so', 'libkdtree_jax_cuda.so')]" "$PREBUILT" 2>>"$OUT/env.txt"; then
  LIBS=$PREBUILT
  echo "using the prebuilt libraries in $PREBUILT" | tee -a "$OUT/env.txt"
else
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  BUILD=/tmp/kd_marlin_build
  if ! timeout 240 bash -c "cmake -S . -B $BUILD ${GEN[*]} -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE=$(command -v python3) && cmake --build $BUILD -j $(nproc)" >"$OUT/build.log" 2>&1; then
    echo "build failed:"; tail -40 "$OUT/build.log"; exit 1
  fi
  LIBS=$BUILD/ffi
fi
export KDTREE_JAX_FFI_DIR=$LIBS
ls -la "$LIBS"/*.so | tee -a "$OUT/env.txt"
# the instructions of each gemm kernel's main loop, from the SASS (benchmarks/sass_loops.py)
command -v cuobjdump >/dev/null && python3 benchmarks/sass_loops.py "$LIBS/libkdtree_jax_cuda.so" \
  >"$OUT/sass_loops.txt" 2>&1

if [ -z "${BASELINE_LIB:-}" ] && [ -n "${BASELINE_CU:-}" ] && [ -f "${BASELINE_CU}" ]; then
  BASELINE_LIB=/tmp/kd_marlin_before.so
  timeout 120 nvcc -std=c++17 -shared -Xcompiler -fPIC -cudart static -gencode=arch=compute_90a,code=sm_90a -O3 \
    -diag-suppress=940,2473,177 -DKdMarlinMoeCuda=KdMarlinMoeCudaOld -I"$JAXINC" -I"$(dirname "$BASELINE_CU")" \
    -I"$PWD/ffi" "$BASELINE_CU" -o "$BASELINE_LIB" >"$OUT/baseline_build.log" 2>&1 || BASELINE_LIB=""
fi

if [ "$MODE" = all ] || [ "$MODE" = tests ] || [ "$MODE" = testbench ] || [ "$MODE" = final ]; then
  T=$(( $(left) - 30 ))
  [ "$MODE" = testbench ] && T=$(( T * 60 / 100 ))
  [ "$MODE" = final ] && T=$(( T * 63 / 100 ))
  [ "$MODE" = all ] && T=$(( T * 60 / 100 ))
  JAX_PLATFORMS=cuda,cpu timeout $T python3 -m pytest tests/test_marlin_moe.py -m gpu -p no:cacheprovider \
    -v -rfE --durations=15 ${TESTS_K:+-k "$TESTS_K"} >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? (limit $T s)" | tee -a "$OUT/gpu_tests.log"
  grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi

if [ "$MODE" != tests ]; then
  L=$(( $(left) - 10 ))
  { [ "$MODE" = final ] || [ "$MODE" = probe ]; } && L=$(( L - ${PROFILE_S:-60} ))
  BENCH=(--out "$OUT" --commit "$KDTREE_COMMIT" --budget $((L > 60 ? L - 45 : 15)))
  [ -n "${BASELINE_LIB:-}" ] && BENCH+=(--baseline-lib "$BASELINE_LIB")
  if [ "$MODE" = all ]; then
    BENCH+=(--shapes k2 --ms 1024,4096,64,256,16 \
            --variants after,before,after+serial,stream+l2,tile128,tile128+sync,tile64+l2)
  fi
  # shellcheck disable=SC2206
  BENCH+=(${BENCH_ARGS:-})
  timeout $((L > 20 ? L : 20)) python3 benchmarks/marlin_moe.py "${BENCH[@]}" 2>&1 | tee "$OUT/bench.log" |
    grep -v "^\(k2\|device\) M=" | tail -5
  grep -E "^(k2|device) M=" "$OUT/bench.log" | tail -60
fi
if { [ "$MODE" = final ] || [ "$MODE" = probe ]; } && command -v ncu >/dev/null; then
  # one ncu report per SHAPE:M:VARIANT: the two gemm launches of one call (gate/up, down), with the reasons warps
  # waited (cycles per issued instruction, by stall reason) and the busy fraction of each pipe
  for P in ${PROFILES:-k2:64:after k2:1024:after}; do
    L=$(( $(left) - 5 ))
    [ $L -lt 20 ] && { echo "no time left for ncu $P"; break; }
    timeout $L ncu --clock-control none --kernel-name regex:"GemmKernel|TileKernel" --launch-count 2 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section SchedulerStats \
      --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active" \
      python3 benchmarks/marlin_moe.py --profile "$P" >"$OUT/ncu_${P//:/_}.txt" 2>&1
    echo "ncu $P rc=$?"; grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|No Eligible" "$OUT/ncu_${P//:/_}.txt" | head -24
    awk '$NF+0 > 0.2 && /issue_stalled/ {print $1, $NF} $NF+0 > 10 && /pipe_/ {print $1, $NF}' "$OUT/ncu_${P//:/_}.txt" | head -60
    if [ -n "${PROFILE_SOURCE:-}" ]; then
      # where the warps wait, per SASS instruction (sampled): the first gemm launch's source page as gzipped CSV
      L=$(( $(left) - 5 ))
      [ $L -lt 20 ] && { echo "no time left for the source profile of $P"; break; }
      R=/tmp/ncu_src_${P//[:+]/_}
      timeout $L ncu --clock-control none --kernel-name regex:"GemmKernel|TileKernel" --launch-count 1 \
        --section WarpStateStats --section SourceCounters -f -o "$R" \
        python3 benchmarks/marlin_moe.py --profile "$P" >"$R.log" 2>&1 &&
        ncu --import "$R.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/src_${P//[:+]/_}.csv.gz"
      echo "source profile $P rc=${PIPESTATUS[0]} (see $R.log when not 0)"
    fi
  done
fi
echo "done in $(($(date +%s) - START)) s; results in $OUT"
