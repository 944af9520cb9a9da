#!/usr/bin/env bash
# One device-machine call for the tree kernels: the GPU tests, a CMake build of ffi/ against that machine's jax,
# and the tree_build benchmark. Logs and the results table go to $OUT.
#
#   OUT=<dir> KD_COMMIT=$(git rev-parse --short HEAD) scripts/gpu_tree_kernels.sh [LIBDIR]
#
# LIBDIR holds libkdtree_jax_cpu.so and libkdtree_jax_cuda.so built elsewhere (for example on a CPU machine with
# nvcc); without it the script waits for its own build. Only the tree kernel modules are imported (copied into a
# fresh package), so unrelated work in progress elsewhere in kdtree_jax cannot break the run.
# Environment: BENCH_ARGS (e.g. --quick), SKIP_TESTS=1, SKIP_BENCH=1.
set -uo pipefail
OUT=${OUT:-/tmp/kd_out}
mkdir -p "$OUT"
ROOT=$(pwd)
LIBDIR=${1:-}
export PYTHONUNBUFFERED=1
export KD_COMMIT=${KD_COMMIT:-unknown}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__, jax.devices())"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.log"

(cmake -S "$ROOT" -B /tmp/kd_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" &&
  cmake --build /tmp/kd_build -j 12) >"$OUT/build.log" 2>&1 &
BUILD_PID=$!
if [ -z "$LIBDIR" ] || [ ! -f "$LIBDIR/libkdtree_jax_cuda.so" ]; then
  wait $BUILD_PID
  echo "build rc=$?" | tee -a "$OUT/build.log"
  BUILD_PID=
  LIBDIR=/tmp/kd_build/ffi
fi
export KDTREE_JAX_FFI_DIR=$(cd "$LIBDIR" && pwd)
echo "FFI libraries from $KDTREE_JAX_FFI_DIR" | tee -a "$OUT/env.log"

PKG=/tmp/kd_pkg
rm -rf $PKG && mkdir -p $PKG/kdtree_jax/kernels
cp "$ROOT"/kdtree_jax/kernels/{_registry,tree_build,tree_accept}.py $PKG/kdtree_jax/kernels/
echo '"""The tree kernels alone (device run)."""' >$PKG/kdtree_jax/__init__.py
cat >$PKG/kdtree_jax/kernels/__init__.py <<'PY'
from .tree_accept import Accepted, tree_accept, tree_accept_ref
from .tree_build import Tree, tree_build, tree_build_ref
PY
cp "$ROOT/tests/test_tree_kernels.py" "$ROOT/benchmarks/tree_build.py" $PKG/
cd $PKG

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning \
    --durations=8 test_tree_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
fi
if [ -n "$BUILD_PID" ]; then
  wait $BUILD_PID
  echo "build rc=$?" | tee -a "$OUT/build.log"
fi
tail -n 3 "$OUT/build.log"
if [ -f /tmp/kd_build/ffi/libkdtree_jax_cuda.so ] && [ "$KDTREE_JAX_FFI_DIR" != /tmp/kd_build/ffi ]; then
  # the libraries built here (this machine's jax headers) pass a short check too
  KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi python3 -m pytest -q -m gpu -p no:cacheprovider \
    -W ignore::pytest.PytestUnknownMarkWarning -k "overflow or accept_cuda" test_tree_kernels.py 2>&1 |
    tail -n 2 | tee -a "$OUT/build.log"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 tree_build.py --out "$OUT/tree_build.md" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/benchmark.log"
fi
