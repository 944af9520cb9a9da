#!/usr/bin/env bash
# One GPU call: build ffi/ with CMake, then the embedded model's acceptance/speed with the custom calls named in
# KDTREE_FFI_OPS, and the per-stage step breakdown. Results under $OUT.
#   KDTREE_COMMIT=$(git rev-parse --short HEAD) KDTREE_FFI_OPS=tree_build,tree_accept scripts/gpu_e2e.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
(cmake -S . -B /tmp/kd_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" &&
  cmake --build /tmp/kd_build -j 16) > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi
python3 benchmarks/acceptance.py --out "$OUT" --kernels ffi ${ACCEPTANCE_ARGS:-} 2>&1 | grep -v "^tau \|^speed "
python3 benchmarks/ddtree_e2e.py --builtin --kernels ffi --out "$OUT" ${E2E_ARGS:-} 2>&1 | grep -v '^{'
