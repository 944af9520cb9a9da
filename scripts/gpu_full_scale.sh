#!/usr/bin/env bash
# One call on the 2-GPU machine (kind nvidia-h200-x2): the sharded-init and sharding equality tests on the two GPUs,
# then benchmarks/full_scale.py: the all-reduces of one K2-width layer on both GPUs (XLA's one-shot all-reduce),
# then the per-device program of an 8-GPU mesh (61 layers, ~76 GB) on GPU 0, profile and projection. Every step
# has a time limit; results are rewritten after every cell. Logs and results under $OUT.
#   KDTREE_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash scripts/gpu_full_scale.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
. "$(dirname "$0")/ffi_env.sh"
JAX_PLATFORMS=cuda XLA_FLAGS=--xla_gpu_autotune_level=0 timeout -k 5 "${TEST_LIMIT:-150}" python3 -m pytest -q -rA \
  tests/test_sharding.py "tests/test_layout.py::test_sharded_init_equals_unsharded" > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR)| passed| failed" "$OUT/gpu_tests.log" | tail -14
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 XLA_FLAGS=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true \
  timeout -k 5 "${BENCH_LIMIT:-380}" python3 benchmarks/full_scale.py --out "$OUT/results" --budget "${CELL_BUDGET:-290}" \
  --repeats 3 "$@" 2>&1 | grep -v -i "warn\|donat" > "$OUT/full_scale.log"
echo "bench rc=$?"; tail -60 "$OUT/full_scale.log"
