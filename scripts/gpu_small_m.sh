#!/usr/bin/env bash
# Issue 41 (few, full kernels per layer) on one H200 in one call: the GPU tests of the custom calls the small-M path
# adds or changes, then benchmarks/full_scale.py (the per-device program of an ep=8 mesh, 61 layers) in the cells
# DDTree runs, with kernel profiles. Every step has a time limit; the logs go to $OUT/all.log and every result file
# into $OUT/results.tar.gz (the device tool returns at most 8 files).
#
#   OUT=/tmp/out bash scripts/gpu_small_m.sh probe   # tests; this build with and without the PDL/streams XLA flags;
#                                                    # a 3-layer step's optimized HLO; ncu of mla_verify at 1 x 1
#   OUT=/tmp/out BASE_DIR=<dir> BASE_COMMIT=<commit> bash scripts/gpu_small_m.sh ab
#                                                    # tests; the same cells at an older commit (its tree in BASE_DIR)
#                                                    # and at this build, side by side in one report (AB_FLAGS=1:
#                                                    # both builds with the XLA flags above; BENCH=1: the embedded
#                                                    # model's greedy tokens compared across methods; NCU=1: ncu
#                                                    # of the custom calls in a 3-layer step; FIXED=1, before the
#                                                    # mode's steps: benchmarks/fixed_cost.py)
#   OUT=/tmp/out bash scripts/gpu_small_m.sh tests   # the GPU tests of every custom call (the issue's "done when"):
#                                                    # mla_pre, move_rows, tree kernels, moe_route, mla_verify,
#                                                    # fused_dot, marlin_moe, cuDNN attention (MOVE_BENCH=1: first
#                                                    # benchmarks/move_rows.py; ALL_TESTS=1: every test of the files)
#   OUT=/tmp/out SKIP_TESTS=1 bash scripts/gpu_small_m.sh drafter  # the drafter alone (ddtree_full_scale.py's
#                                                    # drafter rows, 1/8 and replicated, batch 1 and 10): XLA's
#                                                    # attention with the XLA flags without and with the dot-merger
#                                                    # pass disabled, then cuDNN's; its attention's GPU tests
#   OUT=/tmp/out SKIP_TESTS=1 bash scripts/gpu_small_m.sh draftattn  # the drafter's block attention as one custom
#                                                    # call (draft_attention): its GPU tests, under compute-sanitizer
#                                                    # memcheck too; the call alone against XLA's operations
#                                                    # (benchmarks/draft_attention.py); then the drafter alone
#                                                    # (1/8 and replicated, batch 1 and 10) with XLA's attention
#                                                    # and with the custom call, on the CUDA cores
#                                                    # (KDTREE_JAX_DRAFT_MMA=0) and the tensor cores
#   OUT=/tmp/out bash scripts/gpu_small_m.sh fused  # the fused decode path of marlin_moe (FLAG_FUSED): its GPU tests,
#                                                    # the MoE alone at one device's M (defaults against +fused),
#                                                    # then, where the GPU holds the full step (H200), the full step
#                                                    # without and with it (KDTREE_JAX_MOE_FUSED=1, then =one:
#                                                    # one block an SM; FUSED_CELLS), side by side, the XLA flags
#                                                    # on all three
#   OUT=/tmp/out bash scripts/gpu_small_m.sh mla_pdl  # the full step (H200) with mla_verify's two kernels launched
#                                                    # plainly (the default) and as programmatic dependents
#                                                    # (KDTREE_JAX_MLA_PDL=1), side by side, the XLA flags on both
#                                                    # (PDL_CELLS); then mla_verify's GPU tests with PDL
#   OUT=/tmp/out bash scripts/gpu_small_m.sh fdot  # fused_dot's tests on the GPU; the full step without and with it
#                                                    # (a layer's dense weights and their glue in four launches),
#                                                    # side by side; each of its calls alone against XLA's operations
#   OUT=/tmp/out bash scripts/gpu_small_m.sh fdmma  # fused_dot's tensor-core kernel (M 5-32): its GPU tests,
#                                                    # memcheck, each call alone at M 1-32 against XLA's operations,
#                                                    # the drafter alone without and with it
#   OUT=/tmp/out bash scripts/gpu_small_m.sh gemv  # the MoE's GEMV decode path: its tests, the MoE alone, the full
#                                                    # step as is, with it, and with it and fused_dot
#   OUT=/tmp/out BASE_DIR=<dir> bash scripts/gpu_small_m.sh defaults  # this build against BASE_DIR's package,
#                                                    # alternated twice
#   OUT=/tmp/out OLD_LIB=<dir> bash scripts/gpu_small_m.sh libs  # GPU tests (LIB_TESTS); the full step with this
#                                                    # build's libraries against OLD_LIB's, alternated twice (NCU=1:
#                                                    # then gemv_ncu)
#   OUT=/tmp/out bash scripts/gpu_small_m.sh timeline  # the full step, then one layer of each profiled cell kernel
#                                                    # by kernel (benchmarks/timeline.py)
#   OUT=/tmp/out bash scripts/gpu_small_m.sh loop  # the full step one call a step and as LOOP steps in one
#                                                    # executable, for each of LOOP_VARIANTS (XLA flags); gaps
#   OUT=/tmp/out bash scripts/gpu_small_m.sh gemv_ncu  # ncu of the GEMV kernels (the MoE's, fused_dot's) at M = 1
#   OUT=/tmp/out bash scripts/gpu_small_m.sh fd_ncu  # fused_dot's calls alone with and without whole-line L2
#                                                    # requests, then ncu of its kernel (sections, sampled stalls)
#   OUT=/tmp/out bash scripts/gpu_small_m.sh pre_ncu  # mla_pre's kernel alone: fixed_cost.py (hot, cold; against
#                                                    # XLA's operations), then ncu of it at M = 1 and 17
#   OUT=/tmp/out bash scripts/gpu_small_m.sh stalls  # ncu's sampled stalls of mla_verify's, moe_route's and the
#                                                    # MoE's align/combine kernels at small M (fixed_cost.py's cases)
#   OUT=/tmp/out bash scripts/gpu_small_m.sh mla_pre  # mla_pre's and mla_verify's GPU tests, then the full step (H200)
#                                                    # without and with mla_pre (the projections between qkv_a and
#                                                    # the attention in one launch), side by side, the XLA flags on
#                                                    # both (PRE_CELLS; PRE_PDL=1: a third run with
#                                                    # mla_verify's PDL launches too; on an H100 all runs at
#                                                    # LAYERS_SMALL = 40 layers)
#
# Environment: KDTREE_COMMIT stamps the results (default: git rev-parse --short HEAD); KDTREE_JAX_FFI_DIR = prebuilt
# libraries of this build (else built here); CELLS, PROFILE = full_scale.py's --cells / --profile; SKIP_TESTS=1
# leaves out the GPU tests that start the probe and ab modes.
set -uo pipefail
MODE=${1:-probe}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
# (the device machine's .git may be older than the tree it was sent: a tree that differs from HEAD is marked, so pass
# KDTREE_COMMIT=<hash> written out in the command)
export KDTREE_COMMIT=${KDTREE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD \
  -- kdtree_jax ffi benchmarks 2>/dev/null || echo +modified)}
LOG=$OUT/all.log
CELLS=${CELLS:-4096:1x1,4096:1x17,4096:1x65,4096:10x17,4096:10x65,131072:1x1}
PROFILE=${PROFILE:-4096:1x1,4096:1x17}
FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_executable_num_compute_streams=2"
FLAGS="$FLAGS --xla_gpu_graph_enable_concurrent_region=true --xla_disable_hlo_passes=dot-merger"  # = GPU_FLAGS
BIG=(env XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.92)
step() {  # step NAME SECONDS COMMAND...: run with a limit, append to $LOG, show the last lines
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" > "$OUT/results/$name.log" 2>&1
  local rc=$?
  grep -v -i "warn\|donat" "$OUT/results/$name.log" >> "$LOG"
  echo "rc=$rc" | tee -a "$LOG"
  grep -v -i "warn\|donat" "$OUT/results/$name.log" | tail -"${TAIL:-12}"
  finish  # packed after every step: a call the device kills at its limit still returns the steps before
}
finish() { tar -czf "$OUT/results.tar.gz" -C "$OUT" results; }
ncu_both() {  # ncu_both NAME KERNELS SKIP COUNT SCRIPT TOP: ncu's sections of the matching launches (their key lines
  # into $LOG), then their sampled stalls per SASS instruction, summed by benchmarks/ncu_source_top.py
  local name=$1 kernels=$2 skip=$3 count=$4 script=$5 top=$6
  step "ncu_$name" 150 ncu --kernel-name "$kernels" --launch-skip "$skip" --launch-count "$count" \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --section WarpStateStats --section SchedulerStats python3 "$script"
  grep -E "^  [A-Za-z].*Kernel|Duration|DRAM Throughput|Achieved Occupancy|No Eligible|Registers Per|Grid Size|Warp Cycles" \
    "$OUT/results/ncu_$name.log" | tee -a "$LOG" | head -80
  step "ncu_${name}_src" 150 ncu --kernel-name "$kernels" --launch-skip "$skip" --launch-count "$count" \
    --section WarpStateStats --section SourceCounters -f -o "/tmp/ncu_$name" python3 "$script"
  ncu --import "/tmp/ncu_$name.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip \
    > "$OUT/results/src_$name.csv.gz"
  TAIL=200 step "src_top_$name" 60 python3 benchmarks/ncu_source_top.py "$OUT/results/src_$name.csv.gz" --top "$top"
}
set_depth() {  # DEPTH: --layers LAYERS_SMALL (default 40) on a GPU of < 120 GB (an H100: 61 layers do not fit), so
  # that both sides of an A/B run the same depth and their difference is measured, not projected
  local mem
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  DEPTH=()
  [ "${mem:-0}" -lt 120000 ] && { DEPTH=(--layers "${LAYERS_SMALL:-40}"); echo "GPU of ${mem} MiB: ${DEPTH[*]}" | tee -a "$LOG"; }
}
trap finish EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee -a "$LOG"
. scripts/ffi_env.sh
if [ "$MODE" = tests ]; then  # MOVE_BENCH=1: first benchmarks/move_rows.py (XLA's move against the custom call)
  [ -n "${MOVE_BENCH:-}" ] && step move_rows 90 python3 benchmarks/move_rows.py --out "$OUT/results/move_rows" \
    --commit "$KDTREE_COMMIT"
  # the tests marked gpu (200 on 2026-12-06), the newest files first and marlin_moe's last; ALL_TESTS=1: every test
  # of those files, whose CPU tests then run on the GPU too (on an H100, 2026-12-06, 373 tests took ~580 s in all,
  # more than one step's 480 s); then the cuDNN attention's GPU tests
  SEL=(-m gpu)
  [ -n "${ALL_TESTS:-}" ] && SEL=()
  step all_tests 480 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider "${SEL[@]}" \
    tests/test_mla_pre.py tests/test_move_rows.py tests/test_tree_kernels.py tests/test_moe_route.py \
    tests/test_mla_verify.py tests/test_fused_dot.py tests/test_marlin_moe.py
  step attention_tests 120 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider \
    tests/test_model.py tests/test_long_context.py -k gpu
  exit 0
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  step tests 150 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider tests/test_moe_route.py \
    tests/test_mla_verify.py
fi

if [ -n "${FIXED:-}" ]; then  # each custom call's kernels hot and after an L2 flush (benchmarks/fixed_cost.py)
  step fixed 150 python3 benchmarks/fixed_cost.py --out "$OUT/results/fixed_cost" --commit "$KDTREE_COMMIT"
fi

PF_CELLS=${PF_CELLS:-4096:1x1,4096:1x17}
OPS=tree_build,tree_accept,mla_verify,marlin_moe,moe_route,move_rows,mla_pre
run_full() {  # run_full NAME SUFFIX OPS [ENV...]: one full_scale.py run at PF_CELLS (a run named base is the base of
  # the others); SCRIPT: the benchmark to run (BASE_DIR's copy for the older package)
  local name=$1 suffix=$2 ops=$3 base=(); shift 3
  [ "$name" != base ] && base=(--base "$OUT/results/base/full_scale.json")
  step "$name" "${PF_LIMIT:-150}" "${BIG[@]}" XLA_FLAGS="$FLAGS" "$@" python3 "${SCRIPT:-benchmarks/full_scale.py}" \
    --out "$OUT/results/$name" --cells "$PF_CELLS" --profile "${PF_PROFILE:-4096:1x1}" --repeats 3 \
    --commit "$KDTREE_COMMIT$suffix" --ffi-ops "$ops" "${base[@]}" "${DEPTH[@]}" ${LOOP:+--loop "$LOOP"} \
    ${SKIP_DRAFTER:+--skip-drafter}
}
run_older() {  # run_older NAME: the package of BASE_DIR (a git archive of an older commit's kdtree_jax and
  # benchmarks) with this commit's benchmark scripts copied into it (they put their own tree first on the path)
  mkdir -p "$BASE_DIR/benchmarks"
  cp benchmarks/full_scale.py benchmarks/common.py benchmarks/profile_tools.py "$BASE_DIR/benchmarks/"
  SCRIPT="$BASE_DIR/benchmarks/full_scale.py" run_full "$1" "${BASE_SUFFIX:--older}" "$OPS" PYTHONPATH="$BASE_DIR"
}
case $MODE in
drafter)  # the K2.5-DFlash-shaped drafter alone (sharded 1/8 and replicated, batch 1 and 10): its attention on XLA with
  # the XLA flags without and with --xla_disable_hlo_passes=dot-merger (XLA merged its q/k/v and gate/up dots over
  # copied weights), then on cuDNN (drafter.block_attention) with the flags; then its GPU tests
  step drafter_merged 200 env XLA_FLAGS="${FLAGS% --xla_disable_hlo_passes=dot-merger}" python3 \
    benchmarks/ddtree_full_scale.py --layers 2 --drafters 1,10 --time-limit 0 --draft-attention xla \
    --out "$OUT/results/drafter_merged" --commit "$KDTREE_COMMIT"
  step drafter 200 env XLA_FLAGS="$FLAGS" python3 benchmarks/ddtree_full_scale.py --layers 2 --drafters 1,10 \
    --time-limit 0 --draft-attention xla --out "$OUT/results/drafter" --commit "$KDTREE_COMMIT"
  step drafter_cudnn 200 env XLA_FLAGS="$FLAGS" python3 benchmarks/ddtree_full_scale.py --layers 2 --drafters 1,10 \
    --time-limit 0 --draft-attention cudnn --out "$OUT/results/drafter_cudnn" --commit "$KDTREE_COMMIT"
  step drafter_tests 150 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider tests/test_model.py \
    tests/test_long_context.py -k gpu
  ;;
draftattn)  # the drafter's block attention as one custom call: correctness first (tests, then memcheck of the
  # smallest GPU cases), then the drafter alone with XLA's attention and with the custom call, the XLA flags on both
  step draftattn_tests 150 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider \
    tests/test_draft_attention.py -k gpu
  for kernel in cores mma; do  # each kernel under memcheck on the GPU tests' shapes, a process each, the inputs made
    # on the host and the reference on the CPU (2026-12-07: the GPU tests under memcheck ended in a segmentation
    # fault of the tool in most cases, XLA's own kernels on the GPU the common factor; this way none run)
    for case in "3 4 8 2 16 100 --splits 1" "3 4 8 2 16 100 --splits 7" "2 3 6 3 20 90 --splits 5" \
        "2 8 8 1 112 300 --splits 256" "1 8 8 1 112 4352" "10 8 8 1 112 4352" "2 8 64 8 112 1000" "2 5 130 1 128 50"; do
      # shellcheck disable=SC2086 (the case is its words)
      step "draftattn_memcheck_${kernel}_${case// /_}" 90 env JAX_PLATFORMS=cuda,cpu \
        XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 scripts/draft_attention_memcheck.py $case $([ "$kernel" = cores ] && echo --cores)
    done
  done
  step draftattn_alone 200 python3 benchmarks/draft_attention.py --out "$OUT/results/draft_attention" \
    --commit "$KDTREE_COMMIT" --mma --splits plan,8,16,32,64
  step drafter 200 env XLA_FLAGS="$FLAGS" python3 benchmarks/ddtree_full_scale.py --layers 2 --drafters 1,10 \
    --time-limit 0 --draft-attention xla --out "$OUT/results/drafter" --commit "$KDTREE_COMMIT"
  step drafter_ffi 200 env XLA_FLAGS="$FLAGS" KDTREE_JAX_DRAFT_MMA=0 python3 benchmarks/ddtree_full_scale.py \
    --layers 2 --drafters 1,10 --time-limit 0 --draft-attention ffi --out "$OUT/results/drafter_ffi" \
    --commit "$KDTREE_COMMIT+cores"
  step drafter_mma 200 env XLA_FLAGS="$FLAGS" KDTREE_JAX_DRAFT_MMA=1 python3 benchmarks/ddtree_full_scale.py \
    --layers 2 --drafters 1,10 --time-limit 0 --draft-attention ffi --out "$OUT/results/drafter_mma" \
    --commit "$KDTREE_COMMIT"
  ;;
fused)
  step fused_tests 240 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider tests/test_marlin_moe.py \
    -k "fused or (k2_shapes and (512 or 1536))"
  step fused_bench 150 python3 benchmarks/marlin_moe.py --shapes device --ms "${FUSED_MS:-1,4,10,17,32}" \
    --variants after,after+fused,after+fusedone --out "$OUT/results/marlin_moe_fused" --commit "$KDTREE_COMMIT"
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  [ "${MEM:-0}" -lt 120000 ] && { echo "GPU of ${MEM} MiB: the full step does not fit" | tee -a "$LOG"; exit 0; }
  FUSED_CELLS=${FUSED_CELLS:-4096:1x1,4096:1x17,4096:10x1}
  step base 200 "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py --out "$OUT/results/base" \
    --cells "$FUSED_CELLS" --profile 4096:1x1 --repeats 3 --commit "$KDTREE_COMMIT"
  step new 200 "${BIG[@]}" XLA_FLAGS="$FLAGS" KDTREE_JAX_MOE_FUSED=1 python3 benchmarks/full_scale.py \
    --out "$OUT/results/new" --cells "$FUSED_CELLS" --profile 4096:1x1 --repeats 3 --commit "$KDTREE_COMMIT+fused" \
    --base "$OUT/results/base/full_scale.json"
  step one 200 "${BIG[@]}" XLA_FLAGS="$FLAGS" KDTREE_JAX_MOE_FUSED=one python3 benchmarks/full_scale.py \
    --out "$OUT/results/one" --cells "$FUSED_CELLS" --profile 4096:1x1 --repeats 3 \
    --commit "$KDTREE_COMMIT+fusedone" --base "$OUT/results/base/full_scale.json"
  ;;
mla_pdl)  # the step first (a call's device time is short), then the tests
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  PDL_CELLS=${PDL_CELLS:-4096:1x1,4096:1x17}
  if [ "${MEM:-0}" -lt 120000 ]; then
    echo "GPU of ${MEM} MiB: the full step does not fit" | tee -a "$LOG"
  else
    step plain 200 "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py \
      --out "$OUT/results/plain" --cells "$PDL_CELLS" --profile 4096:1x1 --repeats 3 --commit "$KDTREE_COMMIT+mla_plain"
    step new 200 "${BIG[@]}" XLA_FLAGS="$FLAGS" KDTREE_JAX_MLA_PDL=1 python3 benchmarks/full_scale.py \
      --out "$OUT/results/new" --cells "$PDL_CELLS" --profile 4096:1x1,4096:1x17 --repeats 3 --commit "$KDTREE_COMMIT+mla_pdl" \
      --base "$OUT/results/plain/full_scale.json"
  fi
  step mla_tests 150 env JAX_PLATFORMS=cuda,cpu KDTREE_JAX_MLA_PDL=1 python3 -m pytest -q -rA -p no:cacheprovider \
    tests/test_mla_verify.py
  ;;
mla_pre)  # on a GPU of < 120 GB (H100) the A/B runs LAYERS_SMALL (default 40) layers on both sides, so their
  # difference is measured at that depth, not projected; PRE_PDL=1 adds a third run: + mla_verify's PDL launches
  step pre_tests 150 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider tests/test_mla_pre.py \
    tests/test_mla_verify.py -k gpu
  set_depth
  PRE_CELLS=${PRE_CELLS:-4096:1x1,4096:1x17}
  OPS=tree_build,tree_accept,mla_verify,marlin_moe,moe_route,move_rows
  LIMIT=${PRE_LIMIT:-200}
  step base "$LIMIT" "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py --out "$OUT/results/base" \
    --cells "$PRE_CELLS" --profile "${PRE_PROFILE:-4096:1x1}" --repeats 3 --commit "$KDTREE_COMMIT" --ffi-ops "$OPS" \
    "${DEPTH[@]}"
  step pre "$LIMIT" "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py --out "$OUT/results/pre" \
    --cells "$PRE_CELLS" --profile "${PRE_PROFILE:-4096:1x1}" --repeats 3 --commit "$KDTREE_COMMIT+mla_pre" \
    --ffi-ops "$OPS,mla_pre" --base "$OUT/results/base/full_scale.json" "${DEPTH[@]}"
  [ -n "${PRE_PDL:-}" ] && step pre_pdl "$LIMIT" "${BIG[@]}" XLA_FLAGS="$FLAGS" KDTREE_JAX_MLA_PDL=1 python3 \
    benchmarks/full_scale.py --out "$OUT/results/pre_pdl" --cells "$PRE_CELLS" --profile "${PRE_PROFILE:-4096:1x1}" \
    --repeats 3 --commit "$KDTREE_COMMIT+mla_pre+mla_pdl" --ffi-ops "$OPS,mla_pre" \
    --base "$OUT/results/pre/full_scale.json" "${DEPTH[@]}"
  [ -n "${PRE_PDL:-}" ] && [ -z "${SKIP_PDL_TESTS:-}" ] && step pdl_tests 150 env JAX_PLATFORMS=cuda,cpu KDTREE_JAX_MLA_PDL=1 python3 -m pytest -q -rA \
    -p no:cacheprovider tests/test_mla_verify.py tests/test_mla_pre.py -k gpu
  ;;
fdot)  # fused_dot (a layer's dense weights with their norms, SwiGLU and residual adds, four launches): every test
  # of tests/test_fused_dot.py on the GPU; the full step without and with it, side by side, the XLA flags on both
  # (FD_CELLS, FD_PROFILE; on an H100 at LAYERS_SMALL layers); then benchmarks/fused_dot.py (each call alone, the
  # custom call against XLA's operations; FD_MS)
  step fd_tests 200 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider tests/test_fused_dot.py
  set_depth
  FD_CELLS=${FD_CELLS:-4096:1x1,4096:4x1}
  OPS=tree_build,tree_accept,mla_verify,marlin_moe,moe_route,move_rows,mla_pre
  step base "${FD_LIMIT:-150}" "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py --out "$OUT/results/base" \
    --cells "$FD_CELLS" --profile "${FD_PROFILE:-4096:1x1}" --repeats 3 --commit "$KDTREE_COMMIT" \
    --ffi-ops "$OPS" "${DEPTH[@]}"
  step fdot "${FD_LIMIT:-150}" "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py --out "$OUT/results/fdot" \
    --cells "$FD_CELLS" --profile "${FD_PROFILE:-4096:1x1}" --repeats 3 --commit "$KDTREE_COMMIT+fused_dot" \
    --ffi-ops "$OPS,fused_dot" --base "$OUT/results/base/full_scale.json" "${DEPTH[@]}"
  [ -z "${SKIP_FD_BENCH:-}" ] && step fd_bench 200 python3 benchmarks/fused_dot.py --out "$OUT/results/fused_dot" \
    --commit "$KDTREE_COMMIT" --ms "${FD_MS:-1,4}" --flags 2,6
  ;;
fdmma)  # fused_dot's tensor-core kernel (M 5-32, and FLAG_MMA at 1-4), the most telling first (a call may end at its
  # limit): every test of tests/test_fused_dot.py on the GPU (the model's and the drafter's with it too); every call
  # alone at M 1-32 with the CUDA cores (flags 2) and the tensor cores (10: at M <= 4; past 4 both columns are the
  # tensor cores) against XLA's operations; the drafter alone without and with fused_dot; then memcheck of one call a
  # process (scripts/fused_dot_memcheck.py, 4-32 rows, each epilogue)
  step fdmma_tests "${FD_TEST_LIMIT:-240}" env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider \
    tests/test_fused_dot.py
  step fdmma_bench 150 python3 benchmarks/fused_dot.py --out "$OUT/results/fused_dot" --commit "$KDTREE_COMMIT" \
    --ms "${FD_MS:-1,4,8,9,16,17,32}" --flags 2,10
  # the drafter alone (batch 1: 8 rows, on the tensor cores; 10: 80, XLA's dots) without and with fused_dot
  OPS=tree_build,tree_accept,mla_verify,marlin_moe,moe_route,move_rows,mla_pre,draft_attention
  step drafter 120 env XLA_FLAGS="$FLAGS" python3 benchmarks/ddtree_full_scale.py --layers 2 --drafters 1,10 \
    --time-limit 0 --out "$OUT/results/drafter" --commit "$KDTREE_COMMIT" --ffi-ops "$OPS"
  step drafter_fdot 120 env XLA_FLAGS="$FLAGS" python3 benchmarks/ddtree_full_scale.py --layers 2 --drafters 1,10 \
    --time-limit 0 --out "$OUT/results/drafter_fdot" --commit "$KDTREE_COMMIT+fused_dot" --ffi-ops "$OPS,fused_dot"
  for case in "8 7168 2112" "32 7168 2112 --split 8" "17 7168 384 --n2 512" "9 1024 7168 --adds 1" \
      "8 7168 4608 --gated" "31 256 7168 --adds 2" "4 7168 2112 --flags 8"; do  # (memcheck: no XLA GPU kernels)
    # shellcheck disable=SC2086 (the case is its words)
    step "fdmma_memcheck_${case// /_}" 90 env JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_ALLOCATOR=platform \
      compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/fused_dot_memcheck.py $case
  done
  ;;
gemv)  # the MoE's GEMV decode path (FLAG_GEMV: a warp a weight row, no align) and fused_dot: the GEMV path's GPU
  # tests (marlin_moe's K2-shape cases) and fused_dot's; benchmarks/fixed_cost.py (the MoE at
  # M = 1 on both paths); then the full step (GEMV_CELLS; on an H100 at LAYERS_SMALL layers) of this build as is, with
  # the GEMV path (KDTREE_JAX_MOE_GEMV=1) and with both it and fused_dot, side by side, the XLA flags on all three
  step gemv_tests 240 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider tests/test_marlin_moe.py \
    tests/test_fused_dot.py -k "gemv or (fused_dot and gpu)"
  step fixed 150 python3 benchmarks/fixed_cost.py --out "$OUT/results/fixed_cost" --commit "$KDTREE_COMMIT"
  set_depth
  GEMV_CELLS=${GEMV_CELLS:-4096:1x1,4096:1x17}
  OPS=tree_build,tree_accept,mla_verify,marlin_moe,moe_route,move_rows,mla_pre
  step base "${GEMV_LIMIT:-150}" "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py \
    --out "$OUT/results/base" --cells "$GEMV_CELLS" --profile "${GEMV_PROFILE:-4096:1x1}" --repeats 3 \
    --commit "$KDTREE_COMMIT" --ffi-ops "$OPS" "${DEPTH[@]}"
  step gemv "${GEMV_LIMIT:-150}" "${BIG[@]}" XLA_FLAGS="$FLAGS" KDTREE_JAX_MOE_GEMV=1 python3 benchmarks/full_scale.py \
    --out "$OUT/results/gemv" --cells "$GEMV_CELLS" --profile "${GEMV_PROFILE:-4096:1x1}" --repeats 3 \
    --commit "$KDTREE_COMMIT+moe_gemv" --ffi-ops "$OPS" --base "$OUT/results/base/full_scale.json" "${DEPTH[@]}"
  step gemv_fdot "${GEMV_LIMIT:-150}" "${BIG[@]}" XLA_FLAGS="$FLAGS" KDTREE_JAX_MOE_GEMV=1 python3 \
    benchmarks/full_scale.py --out "$OUT/results/gemv_fdot" --cells "$GEMV_CELLS" --profile "${GEMV_PROFILE:-4096:1x1}" \
    --repeats 3 --commit "$KDTREE_COMMIT+moe_gemv+fused_dot" --ffi-ops "$OPS,fused_dot" \
    --base "$OUT/results/base/full_scale.json" "${DEPTH[@]}"
  ;;
defaults)  # this build's defaults against an older package's (BASE_DIR, with this build's libraries; BASE_SUFFIX
  # names it), alternated twice (ONCE=1: once) (PF_CELLS; on an H100 at LAYERS_SMALL layers), the XLA flags on all
  set_depth
  run_full base "" "$OPS"
  run_older older
  if [ -z "${ONCE:-}" ]; then
    run_full base2 "" "$OPS"
    run_older older2
  fi
  ;;
libs)  # this build's libraries against OLD_LIB's (a directory of an older build's two libraries): the GPU tests
  # marked gpu in LIB_TESTS (files) matching LIB_K (pytest -k; default: mla_verify's and the GEMV path's), then the
  # full step (PF_CELLS, profiles PF_PROFILE, each with its kernels' µs on the path) with each, alternated twice
  # (ONCE=1: once); NCU=1: then gemv_ncu into $OUT/ncu
  read -r -a LT <<< "${LIB_TESTS:-tests/test_mla_verify.py tests/test_marlin_moe.py}"
  step lib_tests 300 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
    -k "${LIB_K:-gemv_path or test_mla_verify}" "${LT[@]}"
  set_depth
  run_full base "" "$OPS"
  run_full oldlib "${OLD_SUFFIX:--oldlib}" "$OPS" KDTREE_JAX_FFI_DIR="$OLD_LIB"
  if [ -z "${ONCE:-}" ]; then
    run_full base2 "" "$OPS"
    run_full oldlib2 "${OLD_SUFFIX:--oldlib}" "$OPS" KDTREE_JAX_FFI_DIR="$OLD_LIB"
  fi
  [ -n "${NCU:-}" ] && OUT=$OUT/ncu bash scripts/gpu_small_m.sh gemv_ncu
  ;;
loop)  # the full step timed one call a step and as LOOP (default 16) steps in one executable (full_scale.py --loop),
  # once for each of LOOP_VARIANTS ("name=extra XLA flags|..."; the first is named base and is the others' base;
  # default: as is; as is, profiled with command buffers on (cbprof: do the profiles differ?); command buffers kept
  # unchanged between calls (NEVER_UPDATE); the loop itself in a command buffer (WHILE); "nocb=
  # --xla_gpu_enable_command_buffer=": none); then the idle stretches of each profiled timeline and what the host
  # did in the longest (benchmarks/timeline.py --gaps --host)
  set_depth
  [ -n "${LOOP_LAYERS:-}" ] && DEPTH=(--layers "$LOOP_LAYERS")  # a quick flag A/B: e.g. LOOP_LAYERS=20 SKIP_DRAFTER=1
  prof=--xla_enable_command_buffers_during_profiling=true
  types=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
  # (each variant its own process: one whose flag this XLA does not know fails alone)
  IFS='|' read -ra VARIANTS <<< "${LOOP_VARIANTS:-base=|cbprof=$prof|never=--xla_gpu_command_buffer_update_mode=NEVER_UPDATE|while=--xla_gpu_enable_command_buffer=$types,WHILE,CONDITIONAL}"
  for v in "${VARIANTS[@]}"; do
    name=${v%%=*}
    suffix="-$name"; [ "$name" = base ] && suffix=""
    LOOP=${LOOP:-16} run_full "$name" "$suffix" "$OPS" XLA_FLAGS="$FLAGS ${v#*=}"
  done
  for t in "$OUT"/results/*/timeline_*.json.gz; do
    h=$(dirname "$t")/host_$(basename "$t" | sed 's/^timeline_//')
    TAIL=60 step "gaps_$(basename "$(dirname "$t")")_$(basename "$t" .json.gz)" 60 python3 benchmarks/timeline.py "$t" \
      --gaps --min-gap 20 --host "$h"
  done
  ;;
timeline)  # the full step as is (PF_CELLS, profiled at PF_PROFILE; on an H100 at LAYERS_SMALL layers), then one
  # layer of each profiled cell kernel by kernel (benchmarks/timeline.py on the timelines full_scale.py keeps)
  set_depth
  run_full base "" "$OPS"
  for t in "$OUT"/results/base/timeline_*.json.gz; do
    TAIL=60 step "layer_$(basename "$t" .json.gz)" 60 python3 benchmarks/timeline.py "$t"
  done
  ;;
gemv_ncu)  # where the GEMV kernels' time goes at M = 1: ncu of GemvUpKernel and GemvDownKernel (one local expert of
  # 48, K2 shapes) and of FusedDotKernel (q_a/kv_a with its norm, and the o projection): sections, then sampled stalls
  cat > "$OUT/results/gemv1.py" <<'PY'
import jax, jax.numpy as jnp
from kdtree_jax.kernels.fused_dot import fused_dot
from kdtree_jax.kernels.marlin_moe import FLAG_GEMV, marlin_moe
from kdtree_jax.quant import Int4Array
key = iter(jax.random.split(jax.random.key(0), 16))
local, d, f, bf = 48, 7168, 2048, jnp.bfloat16
def int4(rows, cols):
    packed = jax.lax.bitcast_convert_type(jax.random.bits(next(key), (local, rows, cols // 8), jnp.uint32), jnp.int32)
    return Int4Array(packed, (0.01 * jnp.ones((local, rows, cols // 32))).astype(bf))
x = jax.random.normal(next(key), (1, d), bf)
ids, wts = jnp.asarray([[3] + [local] * 7], jnp.int32), jnp.asarray([[0.3] + [0.0] * 7], jnp.float32)
ex = (int4(f, d), int4(f, d), int4(d, f))
moe = jax.jit(lambda x: marlin_moe(x, ids, wts, *ex, experts_total=384, flags=FLAG_GEMV))
w, nw = 0.02 * jax.random.normal(next(key), (d, 2112), bf), jnp.ones((d,), bf)
wo, xo = 0.02 * jax.random.normal(next(key), (1024, d), bf), jax.random.normal(next(key), (1, 1024), bf)
qkv = jax.jit(lambda a: fused_dot(a, w, norm=nw, flags=2)[0])
o = jax.jit(lambda a: fused_dot(a, wo, adds=(x,), flags=2)[0])
for _ in range(2):  # 4 matching launches an iteration (GemvUp, GemvDown, FusedDot x 2): ncu skips the first's
    jax.block_until_ready([moe(x), qkv(x), o(xo)])
PY
  ncu_both gemv "regex:GemvUpKernel|GemvDownKernel|FusedDotKernel" 4 4 "$OUT/results/gemv1.py" 12
  ;;
fd_ncu)  # why fused_dot streams its weights at ~1.5 TB/s: benchmarks/fused_dot.py with and without FLAG_L2_LINES
  # (FD_MS), then ncu of FusedDotKernel (q_a/kv_a at M = 1 with both flags, o + residual at M = 1): sections, then
  # sampled stalls per SASS instruction
  step fd_bench 240 python3 benchmarks/fused_dot.py --out "$OUT/results/fused_dot" --commit "$KDTREE_COMMIT" \
    --ms "${FD_MS:-1,4}" --flags 2,6 --calls attn_in,o_res,ffn_in,shared_out
  cat > "$OUT/results/fd1.py" <<'PY'
import jax, jax.numpy as jnp
from kdtree_jax.kernels.fused_dot import fused_dot
key = iter(jax.random.split(jax.random.key(0), 16))
bf = jnp.bfloat16
x, xo = jax.random.normal(next(key), (1, 7168), bf), jax.random.normal(next(key), (1, 1024), bf)
w, nw = 0.02 * jax.random.normal(next(key), (7168, 2112), bf), jnp.ones((7168,), bf)
wo = 0.02 * jax.random.normal(next(key), (1024, 7168), bf)
fns = [jax.jit(lambda a: fused_dot(a, w, norm=nw, flags=2)[0]), jax.jit(lambda a: fused_dot(a, w, norm=nw, flags=6)[0]),
       jax.jit(lambda a: fused_dot(a, wo, adds=(x,), flags=2)[0])]
for _ in range(2):  # 3 launches an iteration: ncu skips the first iteration's
    jax.block_until_ready([fns[0](x), fns[1](x), fns[2](xo)])
PY
  ncu_both fd "regex:FusedDotKernel" 3 3 "$OUT/results/fd1.py" 12
  ;;
pre_ncu)  # why mla_pre's kernel takes ~32 µs a layer in the full step (H100, 40 layers, 1 x 1): fixed_cost.py
  # (hot and cold, the custom call against XLA's operations, M = 1 and 17), then ncu of MlaPreKernel alone at both M
  # (sections, then sampled stalls per SASS instruction)
  step fixed 200 python3 benchmarks/fixed_cost.py --out "$OUT/results/fixed_cost" --commit "$KDTREE_COMMIT"
  cat > "$OUT/results/pre1.py" <<'PY'
import jax, jax.numpy as jnp
from kdtree_jax.kernels.mla_pre import mla_pre
key = iter(jax.random.split(jax.random.key(0), 16))
bf, h, rq, r, dr, s = jnp.bfloat16, 8, 1536, 512, 64, 4096
q_b = (0.03 * jax.random.normal(next(key), (h, 192, rq))).astype(bf)
k_b = (0.1 * jax.random.normal(next(key), (r, h, 128))).astype(bf)
qn, kvn = jnp.ones((rq,), bf), jnp.ones((r,), bf)
fns = []
for n in (1, 17):
    a = jax.random.normal(next(key), (1, n, rq + r + dr), bf)
    ang = jax.random.uniform(next(key), (1, n, dr // 2))
    lat, pe = jax.random.normal(next(key), (1, s, r), bf), jax.random.normal(next(key), (1, s, dr), bf)
    st = jnp.full((1,), s - n, jnp.int32)
    f = jax.jit(lambda a, lat, pe, ang=ang, st=st: mla_pre(a, qn, kvn, q_b, k_b, jnp.cos(ang), jnp.sin(ang), lat, pe,
                                                            st, eps=1e-6)[:2])
    fns.append((f, a, lat, pe))
for _ in range(3):  # 2 launches an iteration: ncu skips the first iteration's
    jax.block_until_ready([f(a, lat, pe) for f, a, lat, pe in fns])
PY
  ncu_both pre "regex:MlaPreKernel" 2 2 "$OUT/results/pre1.py" 25
  ;;
stalls)  # where the small-M custom calls' warps wait (is instruction fetch their fixed cost, as it was mla_pre's?):
  # ncu sections, then sampled stalls per SASS instruction, of MlaVerifyKernel and its combine (1 x 1, 1 x 17, 4k
  # cache), RouteKernel (M = 1, 384 experts) and the MoE's align and combine (M = 1), fixed_cost.py's cases
  cat > "$OUT/results/stalls.py" <<'PY'
import sys, jax
sys.path.insert(0, "benchmarks")
from fixed_cost import cases
picked = [v for k, v in cases(False).items() if k.startswith(("mla_verify", "moe_route", "marlin_moe M=1 (1 local)"))
          and "plain" not in k]
fns = [(jax.jit(fn), inputs) for fn, inputs in picked]
for _ in range(3):  # 7 matching launches an iteration: ncu skips the first iteration's, profiles the second's
    jax.block_until_ready([f(inputs, jax.numpy.float32(0.0)) for f, inputs in fns])
PY
  ncu_both stalls "regex:MlaVerifyKernel|RouteKernel|AlignKernel|CombineKernel" 7 7 "$OUT/results/stalls.py" 12
  ;;
probe)
  step new 230 "${BIG[@]}" python3 benchmarks/full_scale.py --out "$OUT/results/new" --cells "$CELLS" \
    --profile "$PROFILE" --repeats 3 --commit "$KDTREE_COMMIT"
  step flags 150 "${BIG[@]}" XLA_FLAGS="$FLAGS" python3 benchmarks/full_scale.py --out "$OUT/results/flags" \
    --cells "${CELLS%,131072:1x1}" --profile 4096:1x1 --repeats 3 --commit "$KDTREE_COMMIT+flags"
  step hlo 60 python3 benchmarks/full_scale.py --layers 3 --out "$OUT/results/hlo" --cells 4096:10x17,4096:1x1 \
    --profile 4096:10x17,4096:1x1 --hlo --repeats 2
  step ncu_mla 60 ncu --clock-control none --kernel-name regex:MlaVerifyKernel --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats python3 -c "
import jax, jax.numpy as jnp, numpy as np
from kdtree_jax.kernels.mla_verify import mla_verify
r = np.random.default_rng(0)
b, n, h, s = 1, 1, 8, 4113
a = [jnp.asarray(r.standard_normal(x), jnp.bfloat16) for x in ((b, n, h, 512), (b, n, h, 64), (b, s, 512), (b, s, 64))]
lens, mask = jnp.full((b,), s - n, jnp.int32), jnp.ones((b, n, n), bool)
for splits in (16, 64):
    f = jax.jit(lambda *x: mla_verify(*x, 0.1, num_splits=splits))
    for _ in range(2):
        f(*a, lens, mask).block_until_ready()
"
  ;;
ab)
  set_depth  # an H100 runs both sides at LAYERS_SMALL layers (61 do not fit: 2026-12-06, it spent its 260 s out of
  # memory)
  # BASE_DIR: the older commit's kdtree_jax, kdtree_converters and ffi/ (git archive <commit> into a folder the call
  # carries), with its libraries in BASE_DIR/lib (else built here); it runs this commit's benchmark script
  BASE_DIR=${BASE_DIR:?BASE_DIR=<folder of the older commit> is required}
  if ! python3 -c "import ctypes, sys; [ctypes.CDLL(sys.argv[1] + '/lib/' + n) for n in
      ('libkdtree_jax_cpu.so', 'libkdtree_jax_cuda.so')]" "$BASE_DIR" 2>/dev/null; then
    (cmake -S "$BASE_DIR" -B /tmp/base_build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE="$(command -v python3)" && cmake --build /tmp/base_build -j "$(nproc)" &&
      mkdir -p "$BASE_DIR/lib" && cp /tmp/base_build/ffi/*.so "$BASE_DIR/lib/") \
      > "$OUT/results/base_build.log" 2>&1 || { tail -20 "$OUT/results/base_build.log"; exit 1; }
  fi
  cp benchmarks/full_scale.py benchmarks/common.py benchmarks/profile_tools.py "$BASE_DIR/benchmarks/"
  step base 260 "${BIG[@]}" ${AB_FLAGS:+XLA_FLAGS="$FLAGS"} KDTREE_JAX_FFI_DIR="$BASE_DIR/lib" \
    PYTHONPATH="$BASE_DIR" python3 \
    "$BASE_DIR/benchmarks/full_scale.py" --out "$OUT/results/base" --cells "$CELLS" --profile "$PROFILE" \
    --repeats 3 --commit "${BASE_COMMIT:-base}" "${DEPTH[@]}"
  step new 260 "${BIG[@]}" ${AB_FLAGS:+XLA_FLAGS="$FLAGS"} python3 benchmarks/full_scale.py --out "$OUT/results/new" \
    --cells "$CELLS" --profile "$PROFILE" --repeats 3 --commit "$KDTREE_COMMIT" \
    --base "$OUT/results/base/full_scale.json" "${DEPTH[@]}"
  if [ -n "${BENCH:-}" ]; then  # greedy ar / chain / ddtree on the embedded model, tokens compared with ar's
    step bench 150 ${AB_FLAGS:+env XLA_FLAGS="$FLAGS"} python3 -m kdtree_jax.cli bench --kernels ffi \
      --budgets 16,64 --batch 2 --prompt-len 64 --max-new-tokens 48 --repeats 2
  fi
  if [ -n "${NCU:-}" ]; then  # where the custom calls' warps wait, in a 3-layer per-device step at 1 x 1
    step ncu 120 ncu --clock-control none --kernel-name "regex:RouteKernel|MlaVerifyKernel|GemmKernel" \
      --launch-skip 12 --launch-count 4 --section SpeedOfLight --section WarpStateStats --section LaunchStats \
      --section InstructionStats python3 benchmarks/full_scale.py --layers 3 --cells 4096:1x1 --repeats 1 \
      --out /tmp/ncu_fs --profile 1:1x1  # a cell not timed: no jax profiler under ncu
  fi
  ;;
esac
