#!/usr/bin/env bash
# benchmarks/bench_serve.py on one H200 (kind nvidia-h200), in one call: `kdtree-jax serve` of the embedded model (ar
# and ddtree@16, 10 slots, each engine compiling its prefills before it serves) under 1-10 concurrent streamed
# clients. Results (bench_serve_h200.{json,md,png}) and logs under $OUT; every step has a time limit.
#   KDTREE_COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/out bash scripts/gpu_serve.sh [bench_serve.py arguments]
# The machine has no network: the wheels of fastapi, uvicorn, httpx, jinja2 and openai come in scratch/wheels.
# Environment: FFI_OPS (custom calls for the benchmark, default tree_build,tree_accept; empty: pure JAX, no FFI
# build), BENCH_LIMIT (seconds, default 420), SERVE_TESTS=1 to run tests/test_serve.py on the GPU first (its greedy
# answers must equal `generate`'s there too; TEST_LIMIT seconds, default 240), PREFIX=1 to run
# benchmarks/prefix_cache.py first (cold and warm TTFT of a 1,500-token shared prefix; PREFIX_LIMIT, default 200;
# PREFIX_ARGS, its arguments),
# BASE_DIR=<an older commit's tree, its libraries in BASE_DIR/lib> to run that commit's bench_serve.py just before
# this one with the same arguments, this one's report then giving each level against it (--base); with AB=1 (and
# BASE_DIR), benchmarks/serve_ab.py instead: both servers kept up, measured in turns (--repeats, default 3).
# Everything lands in $OUT/results.tar.gz (the device tool returns at most 8 files) and $OUT/*.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
FFI_OPS=${FFI_OPS-tree_build,tree_accept}
R=$OUT/results
mkdir -p "$R"
trap 'tar -czf "$OUT/results.tar.gz" -C "$OUT" results' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/env.txt"
python3 -m pip install --no-index --find-links scratch/wheels fastapi uvicorn httpx jinja2 openai \
  > "$R/pip.log" 2>&1 || { tail -20 "$R/pip.log"; exit 1; }
python3 -c "import matplotlib" 2>/dev/null || echo "no matplotlib: the plot fails; the .json and .md are written first"
# does a jitted while_loop hold the calling thread (then a new request's first token waits for the engine's chunk)?
timeout -k 5 60 python3 benchmarks/dispatch.py --out "$R" 2>&1 | grep -v -i warn | tee "$R/dispatch.log"
if [ -n "$FFI_OPS" ]; then
  . "$(dirname "$0")/ffi_env.sh"
fi
if [ "${SERVE_TESTS:-0}" = 1 ]; then
  JAX_PLATFORMS=cuda timeout -k 5 "${TEST_LIMIT:-240}" python3 -m pytest -q -rA -p no:cacheprovider \
    tests/test_serve.py > "$R/gpu_tests.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)| passed| failed" "$R/gpu_tests.log" | tail -14
fi
if [ "${PREFIX:-0}" = 1 ]; then
  timeout -k 5 "${PREFIX_LIMIT:-200}" python3 benchmarks/prefix_cache.py --name prefix_cache_h200 --out "$R" \
    ${FFI_OPS:+--ffi-ops "$FFI_OPS"} ${PREFIX_ARGS:-} 2>&1 | grep --line-buffered -v -i "warn\|donat" \
    > "$R/prefix_cache.log"
  echo "prefix rc=${PIPESTATUS[0]}"; tail -14 "$R/prefix_cache.log"
fi
if [ "${AB:-0}" = 1 ]; then  # the two servers alternated in one process pair (benchmarks/serve_ab.py), then stop
  timeout -k 5 "${BENCH_LIMIT:-420}" python3 benchmarks/serve_ab.py --base "$BASE_DIR" --base-lib "$BASE_DIR/lib" \
    --base-label "${BASE_LABEL:-base}" --label "${KDTREE_COMMIT:-this}" --out "$R" --name serve_ab_gpu \
    ${FFI_OPS:+--ffi-ops "$FFI_OPS"} "$@" 2>&1 | grep --line-buffered -v -i "warn\|donat" > "$R/serve_ab.log"
  echo "serve_ab rc=${PIPESTATUS[0]}"; tail -12 "$R/serve_ab.log"
  exit 0
fi
BASE=()
if [ -n "${BASE_DIR:-}" ]; then
  KDTREE_JAX_FFI_DIR=$BASE_DIR/lib PYTHONPATH=$BASE_DIR timeout -k 5 "${BENCH_LIMIT:-420}" python3 \
    "$BASE_DIR/benchmarks/bench_serve.py" --name bench_serve_h200_base --out "$R" ${FFI_OPS:+--ffi-ops "$FFI_OPS"} \
    "$@" 2>&1 | grep --line-buffered -v -i "warn\|donat" > "$R/bench_serve_base.log"
  echo "base rc=${PIPESTATUS[0]}"; tail -4 "$R/bench_serve_base.log"
  BASE=(--base "$R/bench_serve_h200_base.json")
fi
timeout -k 5 "${BENCH_LIMIT:-420}" python3 benchmarks/bench_serve.py --name bench_serve_h200 --out "$R" \
  ${FFI_OPS:+--ffi-ops "$FFI_OPS"} "${BASE[@]}" "$@" 2>&1 | grep --line-buffered -v -i "warn\|donat" \
  > "$R/bench_serve.log"
echo "bench rc=${PIPESTATUS[0]}"; tail -4 "$R/bench_serve.log"
