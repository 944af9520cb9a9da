#!/usr/bin/env bash
# Issue 46's soak on one GPU, longer than one device call: benchmarks/soak.py runs in its own process session (setsid),
# which the device machine leaves running between calls while it stays held, and later calls wait for it and collect
# its results. The machine goes back when idle for ~30 s or after 30 minutes held, so the calls must follow each other
# at once and the whole soak (start-up, --warmup all, the solo answers, MINUTES, the drain) must end inside 30
# minutes of the machine's start: MINUTES=20 leaves ~5 minutes for the rest.
#
#   OUT=$OUT KDTREE_COMMIT=<hash> KDTREE_JAX_FFI_DIR=$PWD/build/cur bash scripts/gpu_soak.sh start   # returns in ~1 min
#   OUT=$OUT bash scripts/gpu_soak.sh wait      # up to WAIT_S (default 570) seconds; repeat until "soak ended"
#   OUT=$OUT bash scripts/gpu_soak.sh collect   # waits too, then $OUT/results.tar.gz holds results/soak/soak_<gpu>.*
#
# `wait` and `collect` print the soak's log so far; `collect` packs whatever exists (a partial log if the soak has not
# ended: the report is written at its end). Environment: MINUTES (default 20), CONCURRENCY (16), SOAK_ARGS (more
# soak.py flags), SERVE_ARGS (the server's flags; default ddtree@16, 16 slots, --warmup all, the tree custom calls).
# The fastapi / uvicorn / httpx / jinja2 / openai wheels come in scratch/wheels (the machine has no network).
set -uo pipefail
MODE=${1:-start}
OUT=${OUT:-/tmp/out}
DIR=/tmp/kd_soak  # outside $OUT, which each call empties
cd "$(dirname "$0")/.."
mkdir -p "$OUT" "$DIR"
finish() {
  [ -f "$DIR/soak.log" ] && tail -c 200000 "$DIR/soak.log" > "$OUT/soak.log"
  [ "$MODE" = collect ] && tar -czf "$OUT/results.tar.gz" -C "$DIR" . 2>/dev/null
}
trap finish EXIT
running() { [ -f "$DIR/pid" ] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null; }
case $MODE in
start)
  if running; then echo "a soak is already running (pid $(cat "$DIR/pid"))"; exit 1; fi
  rm -rf "${DIR:?}"/*
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$DIR/env.txt"
  python3 -m pip install --no-index --find-links scratch/wheels fastapi uvicorn httpx jinja2 openai \
    > "$DIR/pip.log" 2>&1 || { tail -20 "$DIR/pip.log"; exit 1; }
  . scripts/ffi_env.sh
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H[0-9]+" | tr 'H' 'h')
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 PYTHONPATH=$PWD KDTREE_COMMIT=${KDTREE_COMMIT:-unknown} setsid nohup python3 benchmarks/soak.py \
    --minutes "${MINUTES:-20}" --concurrency "${CONCURRENCY:-16}" --out "$DIR/results/soak" --name "soak_${GPU:-gpu}" \
    ${SOAK_ARGS:-} -- ${SERVE_ARGS:---method ddtree --budget 16 --max-batch 16 --warmup all --ffi-ops tree_build,tree_accept} \
    > "$DIR/soak.log" 2>&1 < /dev/null &
  echo $! > "$DIR/pid"
  date +%s > "$DIR/started"
  sleep 45
  if running; then echo "soak started (pid $(cat "$DIR/pid")), ${MINUTES:-20} minutes of load after its warm-up"; else
    echo "the soak ended at once:"; tail -30 "$DIR/soak.log"; exit 1; fi
  tail -5 "$DIR/soak.log"
  ;;
wait|collect)
  [ -f "$DIR/pid" ] || { echo "no soak was started on this machine (it may have gone back: start again)"; exit 1; }
  end=$(( $(date +%s) + ${WAIT_S:-570} ))
  while running && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
  echo "$(( ($(date +%s) - $(cat "$DIR/started")) / 60 )) minutes since the start"
  if running; then echo "soak still running"; else echo "soak ended"; fi
  grep -v -i "warn" "$DIR/soak.log" | tail -40
  ;;
*)
  echo "usage: bash scripts/gpu_soak.sh start|wait|collect"; exit 2 ;;
esac
