#!/usr/bin/env bash
# One GPU run: build the CUDA targets, run the GPU tests (decode/append, prefill, graph replay and
# the validation's device pool, plus compute-sanitizer on a subset), run the decode/append and
# prefill benchmarks and PyTorch SDPA on the decode shapes, and write gpu_results.json and
# gpu_results.md (scripts/gpu_report.py) into the output directory, and everything in one
# gpu_out.tgz there (for machines that copy back only a few files).
# BEFORE=path/to/old/decode.cu also times that kernel on the same shapes in the same run
# (scripts/gpu_perf.sh) and adds its column and ratios to the report; BEFORE_TREE=dir does the
# same with a whole older source tree (its own CMake build), for changes beyond decode.cu.
# `graph` runs only the decode-step path: the CUDA-graph replay test, the bfloat16-activation test,
# the engine-tables test, the append/decode and prefill GPU tests, the validation's device pool,
# memcheck on the graph, activation and engine tests, bench_step in its plain, fixed, graph,
# graph-bf16 and engine-graph-bf16 modes, bench_decode's bare kernels, and the BF16-cache
# step it is compared with (bench_sdpa.py --step-layers: cache write + SDPA per layer, in a graph)
# (with BEFORE_TREE, that tree's bench_step right after, built in parallel with this one).
# BEFORE_MODES: the bench_step modes the before tree runs (default plain; the tree must have them).
# `prefill` runs only the prefill path: the warpgroup-MMA and prefill GPU tests, bench_prefill and
# PyTorch's BF16 attention on the same shapes (bench_sdpa.py --prefill-configs), the other tests
# that prefill (engine, bfloat16 activations, graph replay), then memcheck and racecheck on the
# prefill kernels; with BEFORE_TREE, that tree's bench_prefill right after this one's; the times
# side by side in prefill_results.md (scripts/prefill_report.py).
# usage: OUT=dir [BEFORE=old_decode.cu | BEFORE_TREE=old_tree] [BUILD=CMake build dir, default build-gpu]
#        scripts/gpu_run.sh [quick | graph | prefill]
# (PREFILL_CONFIGS / PREFILL_ARGS: bench_prefill's shapes and other arguments in `prefill`;
# TEST_TIMEOUT: seconds per test binary or bench run, default 420 (gpu_test_prefill's CPU references
# take minutes: its first two tests alone ran 75 s on an H100 host); RACECHECK=0 skips racecheck.)
set -u -o pipefail
source "$(dirname "$0")/gpu_common.sh"
BUILD=${BUILD:-$GPU_BUILD}
GPU_BUILD=$BUILD
LOG=$OUT/gpu_log.txt
exec > >(tee -a "$LOG") 2>&1
gpu_provenance

if [ "${1:-}" = prefill ]; then
  t0=$(date +%s)
  if [ -n "${BEFORE_TREE:-}" ]; then
    (cd "$BEFORE_TREE" && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
      cmake --build build-before --target bench_prefill -j"$(( JOBS / 2 ))" >"$OUT/before_build.txt" 2>&1) &
    before_pid=$!
    JOBS=$(( JOBS / 2 ))
  fi
  gpu_cmake_build gpu_test_wgmma gpu_test_prefill gpu_test_engine gpu_test_activations gpu_test_graph bench_prefill ||
    { echo "BUILD FAILED"; exit 1; }
  [ -n "${BEFORE_TREE:-}" ] && { wait "$before_pid" || { tail -20 "$OUT/before_build.txt"; echo "BEFORE_TREE BUILD FAILED"; }; }
  echo "build: $(( $(date +%s) - t0 )) s"
  run_tests() {
    for t in "$@"; do
      mkdir -p /tmp/gpu_logs
      timeout "${TEST_TIMEOUT:-420}" "$BUILD/tests/$t" --gtest_output=xml:"/tmp/$t.xml" 2>&1 | tee "/tmp/gpu_logs/$t.log" |
        grep -E '^\[  (FAILED|PASSED) |^[^ ].*worst|Failure|error|Expected|Which is' | head -60
      local rc=${PIPESTATUS[0]}
      echo "$t exit: $rc"
      [ "$rc" = 124 ] && hung=1
    done
  }
  hung=0
  run_tests gpu_test_wgmma gpu_test_prefill
  if [ "$hung" = 1 ]; then  # a kernel that hangs would hang every later step too
    echo "a test ran past TEST_TIMEOUT: the rest of the run is skipped"
    tar czf /tmp/gpu_out.tgz --warning=no-file-changed -C "$OUT" . -C /tmp gpu_logs
    mv /tmp/gpu_out.tgz "$OUT/gpu_out.tgz"
    exit 1
  fi
  PREFILL_CONFIGS=${PREFILL_CONFIGS:-32:8:4096:2048,32:8:32768:16,32:8:32768:64,32:8:32768:256,32:8:32768:2048,32:8:131072:2048}
  timeout "${TEST_TIMEOUT:-420}" "$BUILD/bench/bench_prefill" --configs "$PREFILL_CONFIGS" ${PREFILL_ARGS:-} |
    tee "$OUT/bench_prefill.jsonl"
  echo "bench_prefill exit: $?"
  if [ -n "${BEFORE_TREE:-}" ]; then
    "$BEFORE_TREE/build-before/bench/bench_prefill" --configs "$PREFILL_CONFIGS" ${BEFORE_PREFILL_ARGS:-} |
      sed "s/^/before /" | tee "$OUT/bench_prefill_before.jsonl"
  fi
  python3 bench/bench_sdpa.py --prefill-configs "$PREFILL_CONFIGS" --out "$OUT/sdpa_prefill.jsonl" --reps 20
  echo "sdpa prefill exit: $?"
  python3 scripts/prefill_report.py "$OUT"  # prefill_results.md: kvcc beside SDPA (and BEFORE_TREE) per shape
  run_tests gpu_test_engine gpu_test_activations gpu_test_graph
  if command -v compute-sanitizer >/dev/null; then
    timeout ${SANITIZER_TIMEOUT:-150} compute-sanitizer --tool memcheck --log-file "$OUT/sanitizer_prefill.txt" "$BUILD/tests/gpu_test_prefill" \
      --gtest_filter='GpuPrefill.MatchesReferenceGqa8*:GpuPrefill.ManySplits*:GpuPrefill.TwoCtas*:GpuPrefill.RuntimeDeviceMatchesHost' >/dev/null
    echo "memcheck prefill exit: $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer_prefill.txt" 2>/dev/null) clean summaries)"
    if [ "${RACECHECK:-1}" = 1 ]; then
      timeout ${SANITIZER_TIMEOUT:-150} compute-sanitizer --tool racecheck --log-file "$OUT/racecheck_prefill.txt" "$BUILD/tests/gpu_test_prefill" \
        --gtest_filter='GpuPrefill.MatchesReferenceGqa8*:GpuPrefill.ManySplits*:GpuPrefill.TwoCtas*' >/dev/null
      echo "racecheck prefill exit: $? ($(grep -c 'RACECHECK SUMMARY: 0 hazards' "$OUT/racecheck_prefill.txt" 2>/dev/null) clean summaries)"
    fi
  fi
  echo "total: $(( $(date +%s) - t0 )) s"
  # (the tests' whole output travels in the archive only: few files come back from a device)
  tar czf /tmp/gpu_out.tgz --warning=no-file-changed -C "$OUT" . -C /tmp gpu_logs
  mv /tmp/gpu_out.tgz "$OUT/gpu_out.tgz"
  exit 0
fi

if [ "${1:-}" = graph ]; then
  t0=$(date +%s)
  if [ -n "${BEFORE_TREE:-}" ]; then
    [ -e "$BEFORE_TREE/bench/bench_step.cu" ] || cp bench/bench_step.cu bench/bench_args.h "$BEFORE_TREE/bench/"
    (cd "$BEFORE_TREE" && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
      cmake --build build-before --target bench_step -j"$(( JOBS / 2 ))" >"$OUT/before_build.txt" 2>&1) &
    before_pid=$!
  fi
  [ -n "${BEFORE_TREE:-}" ] && JOBS=$(( JOBS / 2 ))
  gpu_cmake_build gpu_test_graph gpu_test_activations gpu_test_engine gpu_test_cache gpu_test_prefill gpu_test_compaction gpu_test_scores \
    test_validate bench_step bench_decode ${EXTRA_TARGETS:-} ||
    { echo "BUILD FAILED"; exit 1; }
  [ -n "${BEFORE_TREE:-}" ] && { wait "$before_pid" || { tail -20 "$OUT/before_build.txt"; echo "BEFORE_TREE BUILD FAILED"; }; }
  echo "build: $(( $(date +%s) - t0 )) s"
  for t in gpu_test_graph gpu_test_activations gpu_test_engine gpu_test_cache gpu_test_prefill gpu_test_compaction gpu_test_scores; do
    "$BUILD/tests/$t" --gtest_output=xml:"/tmp/$t.xml" 2>&1 |
      grep -E '^\[  (FAILED|PASSED) |graph replay|engine tables:|Failure|error|Expected|Which is' | head -20
    echo "$t exit: ${PIPESTATUS[0]}"
  done
  "$BUILD/tests/test_validate" --gtest_filter='ValidateRuntime.DevicePool*' 2>&1 | grep -E '^\[  (FAILED|PASSED) '
  echo "gpu validate test exit: ${PIPESTATUS[0]}"
  if command -v compute-sanitizer >/dev/null; then
    for t in gpu_test_graph gpu_test_activations gpu_test_engine; do
      timeout 120 compute-sanitizer --tool memcheck --log-file "$OUT/sanitizer_$t.txt" "$BUILD/tests/$t" >/dev/null
      echo "memcheck $t exit: $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer_$t.txt" 2>/dev/null) clean summaries)"
    done
  fi
  STEP_CONFIGS=${STEP_CONFIGS:-32:8:1:32768,32:8:8:131072,32:8:64:32768}
  "$BUILD/bench/bench_step" --steps 200 --configs "$STEP_CONFIGS" --modes plain,fixed,graph,graph-bf16,engine-graph-bf16 |
    tee "$OUT/bench_step.txt"
  echo "bench_step exit: $?"
  # The bare decode kernels (rotate q, attention, merge) on the same shapes: what the step adds.
  "$BUILD/bench/bench_decode" --configs "$STEP_CONFIGS" --out "$OUT/bench_decode.jsonl" --reps 30 |
    tee "$OUT/bench_decode.txt"
  echo "bench_decode exit: $?"
  python3 bench/bench_sdpa.py --configs "$STEP_CONFIGS" --step-layers 4 --out "$OUT/sdpa_step.jsonl" |
    tee "$OUT/sdpa_step.txt"
  echo "sdpa step exit: $?"
  if [ -n "${BEFORE_TREE:-}" ]; then
    "$BEFORE_TREE/build-before/bench/bench_step" --steps 200 --configs "$STEP_CONFIGS" --modes "${BEFORE_MODES:-plain}" |
      sed "s/^/before /" | tee "$OUT/bench_step_before.txt"
    "$BUILD/bench/bench_step" --steps 200 --configs "$STEP_CONFIGS" --modes "${BEFORE_MODES:-plain},graph" |
      sed "s/^/again /" | tee -a "$OUT/bench_step.txt"
  fi
  echo "total: $(( $(date +%s) - t0 )) s"
  exit 0
fi

# Build through CMake (only the targets needed).
TEST=$BUILD/tests/gpu_test_cache
PREFILL_TEST=$BUILD/tests/gpu_test_prefill
BENCH=$BUILD/bench/bench_decode
t0=$(date +%s)
gpu_cmake_build gpu_test_cache gpu_test_prefill gpu_test_graph gpu_test_compaction gpu_test_scores test_validate bench_decode bench_prefill \
  bench_step ||
  { echo "BUILD FAILED"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

"$TEST" --gtest_output=xml:"$OUT/gpu_tests.xml"
echo "gpu tests exit: $?"
"$PREFILL_TEST" --gtest_output=xml:"$OUT/gpu_tests_prefill.xml"
echo "gpu prefill tests exit: $?"
# A decode step captured in a CUDA graph and replayed against the uncaptured Runtime.
"$BUILD/tests/gpu_test_graph" --gtest_output=xml:"$OUT/gpu_tests_graph.xml"
echo "gpu graph test exit: $?"
# Token eviction's page compaction on the device pool against the host reference's bytes.
"$BUILD/tests/gpu_test_compaction" --gtest_output=xml:"$OUT/gpu_tests_compaction.xml"
echo "gpu compaction test exit: $?"
# Token scores from the cache (attention_scores) against the host reference on the device's bytes.
"$BUILD/tests/gpu_test_scores" --gtest_output=xml:"$OUT/gpu_tests_scores.xml"
echo "gpu scores test exit: $?"
# kvcc validate through the device pool (its CPU tests run in CI; this one needs the GPU).
"$BUILD/tests/test_validate" --gtest_filter='ValidateRuntime.DevicePool*' --gtest_output=xml:"$OUT/gpu_tests_validate.xml"
echo "gpu validate test exit: $?"
if command -v compute-sanitizer >/dev/null; then
  timeout 240 compute-sanitizer --tool memcheck --log-file "$OUT/sanitizer.txt" "$TEST" \
    --gtest_filter='GpuDecode.Int2MatchesReferenceGqa5OneSplit:GpuDecode.Bf16*:GpuAppend.Rotation*' >/dev/null
  echo "memcheck exit: $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer.txt" 2>/dev/null) clean summaries)"
  timeout 180 compute-sanitizer --tool racecheck "$TEST" --gtest_filter='GpuDecode.Int2MatchesReferenceGqa4:GpuDecode.Int2MatchesReference*Ring:GpuDecode.Int2LevelTable*' 2>&1 | grep -E 'RACECHECK|hazard|ERROR' | head -5
fi

if [ "${1:-}" = quick ]; then
  CONFIGS="32:8:1:32768,32:8:8:131072"
else
  CONFIGS="32:8:1:4096,32:8:8:4096,32:8:32:4096,32:8:64:4096,32:8:1:16384,32:8:8:16384,32:8:32:16384,32:8:64:16384"
  CONFIGS="$CONFIGS,32:8:1:32768,32:8:8:32768,32:8:32:32768,32:8:64:32768,32:8:1:65536,32:8:8:65536,32:8:32:65536"
  CONFIGS="$CONFIGS,32:8:1:131072,32:8:8:131072"
  CONFIGS="$CONFIGS,64:8:1:32768,64:8:8:32768,64:8:1:131072,64:8:8:131072"
  CONFIGS="$CONFIGS,40:8:1:32768,40:8:8:32768,40:8:1:131072,40:8:8:131072"
fi
"$BENCH" --configs "$CONFIGS" --out "$OUT/bench_decode.jsonl" --reps 30
echo "bench_decode exit: $?"
"$BUILD/bench/bench_prefill" | tee "$OUT/bench_prefill.txt"
echo "bench_prefill exit: $?"
# A whole decode step through the Runtime API (begin_append, then append + decode per layer).
"$BUILD/bench/bench_step" | tee "$OUT/bench_step.txt"
echo "bench_step exit: $?"
# Where small-batch time goes (KVCC_STAGES bits: 1 rotate q, 2 attention, 4 merge); not in the table.
for st in 2 1 4; do
  KVCC_STAGES=$st "$BENCH" --configs 32:8:1:4096,32:8:1:32768 --out "$BUILD/parts.jsonl" --reps 20 | grep decode | sed "s/^/stages=$st /"
done
PYTHONUNBUFFERED=1 python3 bench/bench_sdpa.py --configs "$CONFIGS" --out "$OUT/sdpa.jsonl" --reps 30
echo "bench_sdpa exit: $?"
REPORT_ARGS=()
if [ -n "${BEFORE_TREE:-}" ]; then
  # A whole older source tree (e.g. `git archive OLD | tar x -C DIR`): its own CMake build of
  # bench_decode, timed on the same shapes right after this tree's, for the before column.
  mkdir -p "$OUT/before"
  # bench_step uses the public Runtime API only: this tree's file times the older Runtime too.
  [ -e "$BEFORE_TREE/bench/bench_step.cu" ] || cp bench/bench_step.cu "$BEFORE_TREE/bench/"
  (cd "$BEFORE_TREE" && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build build-before --target bench_decode bench_step -j"$JOBS" >/dev/null) || echo "BEFORE_TREE BUILD FAILED"
  "$BEFORE_TREE/build-before/bench/bench_decode" --configs "$CONFIGS" --out "$OUT/before/perf_before_r1.jsonl" --reps 30 |
    grep decode | sed "s/^/before /"
  echo "before tree ($BEFORE_TREE) exit: $?"
  "$BEFORE_TREE/build-before/bench/bench_step" | sed "s/^/before /" | tee "$OUT/before/bench_step.txt"
  REPORT_ARGS=(--before before/perf_before_r1.jsonl)
elif [ -n "${BEFORE:-}" ]; then
  OUT=$OUT/before GPU_BUILD=$BUILD BUILD=build-gpu-perf BEFORE=$BEFORE ROUNDS=1 NO_SDPA=1 CONFIGS=$CONFIGS scripts/gpu_perf.sh before: >/dev/null 2>&1
  echo "before ($BEFORE) exit: $?"
  REPORT_ARGS=(--before before/perf_before_r1.jsonl)
fi
python3 scripts/gpu_report.py "$OUT" "${REPORT_ARGS[@]}"
echo "total: $(( $(date +%s) - t0 )) s"
# (the log is still being written: tar's "file changed" warning is expected)
tar czf /tmp/gpu_out.tgz --warning=no-file-changed -C "$OUT" . ; mv /tmp/gpu_out.tgz "$OUT/gpu_out.tgz"
