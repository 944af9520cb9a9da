#!/usr/bin/env bash
# One call on the 2-GPU machine (kind nvidia-h200-x2): build ffi/, the sharding equality tests on the two real
# GPUs (xla and ffi kernels), then benchmarks/sharding.py (K2-width layers on 1 and 2 GPUs + the 8-GPU projection).
#   KDTREE_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_sharding.sh [--kernels ffi]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
(cmake -S . -B /tmp/kd_build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" &&
  cmake --build /tmp/kd_build -j 32) > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
export KDTREE_JAX_FFI_DIR=/tmp/kd_build/ffi
JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_sharding.py 2>&1 | tee "$OUT/sharding_tests.log" | tail -5
python3 benchmarks/sharding.py --out "$OUT" "$@" 2>&1 | grep -v '^{'
