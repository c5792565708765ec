#!/usr/bin/env bash
# The readers of untrusted files under AddressSanitizer + UndefinedBehaviorSanitizer, as CI runs
# them (ctest's Sanitizers.ReadersUnderAsanUbsan, label cpu): builds the libFuzzer targets of
# tests/fuzz (clang, -DKVCC_FUZZ=ON; the list is FUZZ_TARGETS in tests/fuzz/seeds.sh: artifacts,
# stats, safetensors weights and index, config.json, llama2.c model and tokenizer, tokenizer.json,
# torch .pt files and their pickles, the zoo index, token-id files), replays the regression inputs
# of tests/fuzz/regressions through the targets they belong to (the HDF5 ones through both HDF5
# targets), then fuzzes each target for SECONDS (default 20) from its seeds, and last runs the
# file formats' unit tests built with the same sanitizers (tests/fuzz/CMakeLists.txt). A sanitizer
# report, crash, timeout or allocation past the limit on a regression input, or a failing unit
# test, fails it (exit 1). What the short random exploration finds is reported (FINDING, with the
# input kept under BUILD_DIR/crashes) but does not fail it: a new defect found at random would
# fail CI at random; a finding goes to tests/fuzz/regressions/ once fixed, tests/fuzz/open/ until
# then. Without clang or its fuzzer runtime it reports skipped (exit 77).
#   scripts/sanitize_check.sh [SECONDS]        (BUILD_DIR default build/sanitize)
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-20}
BUILD_DIR=${BUILD_DIR:-build/sanitize}
CC=${CC:-clang}
CXX=${CXX:-clang++}
if ! command -v "$CXX" >/dev/null || ! echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long){return 0;}' |
  "$CXX" -x c++ -fsanitize=fuzzer,address,undefined -o /dev/null - 2>/dev/null; then
  echo "sanitize_check: skipped: $CXX with libFuzzer and ASan/UBSan runtimes not found (Debian: clang, libclang-rt-dev)"
  exit 77
fi
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  CC=$CC CXX=$CXX cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCC_CUDA=OFF \
    -DKVCC_FUZZ=ON -DBUILD_TESTING=OFF >"$BUILD_DIR.configure.log" 2>&1 ||
    { cat "$BUILD_DIR.configure.log"; exit 1; }
fi
source tests/fuzz/seeds.sh
SANITIZED_TESTS=(test_formats_h5 test_formats_sha256 test_formats_model_config test_formats_artifact test_formats_stats
  test_formats_mutations test_artifact_safetensors test_model_file)
cmake --build "$BUILD_DIR" -j "${JOBS:-2}" --target "${FUZZ_TARGETS[@]}" fuzz_make_seeds \
  "${SANITIZED_TESTS[@]/#/sanitized_}" >"$BUILD_DIR.build.log" 2>&1 ||
  { tail -30 "$BUILD_DIR.build.log"; exit 1; }

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
limits=(-timeout=10 -malloc_limit_mb=1024 -rss_limit_mb=2560)
status=0
for target in "${FUZZ_TARGETS[@]}"; do
  # Replay: libFuzzer runs each file once and stops at the first failure.
  mapfile -t regressions < <(fuzz_regressions "$target")
  if [ ${#regressions[@]} -eq 0 ]; then
    echo "$target: no regression inputs"
  elif "$BUILD_DIR/tests/fuzz/$target" "${limits[@]}" "${regressions[@]}" >"$BUILD_DIR/$target.replay.log" 2>&1; then
    echo "$target: ${#regressions[@]} regression inputs replayed clean"
  else
    echo "$target: FAILED on the regression inputs"; tail -40 "$BUILD_DIR/$target.replay.log"; status=1
  fi
  seeds="$BUILD_DIR/seeds/$target"
  rm -rf "$seeds" "$BUILD_DIR/crashes/$target"
  mkdir -p "$seeds" "$BUILD_DIR/crashes/$target"
  fuzz_seeds "$target" "$seeds"
  if "$BUILD_DIR/tests/fuzz/$target" "$seeds" "${limits[@]}" -max_total_time="$SECONDS_PER_TARGET" \
    -max_len="$(fuzz_max_len "$target")" -artifact_prefix="$BUILD_DIR/crashes/$target/" >"$BUILD_DIR/$target.fuzz.log" 2>&1; then
    echo "$target: fuzzed ${SECONDS_PER_TARGET} s clean ($(grep -o 'stat::number_of_executed_units: [0-9]*' "$BUILD_DIR/$target.fuzz.log" || grep -Eo '#[0-9]+' "$BUILD_DIR/$target.fuzz.log" | tail -1))"
  else
    echo "$target: FINDING while fuzzing (input in $BUILD_DIR/crashes/$target/; not failing: see the header)"
    grep -m1 -E "ERROR: |SUMMARY: " "$BUILD_DIR/$target.fuzz.log"
  fi
done
# The formats' own unit tests, built with the same sanitizers: any failure or report fails.
for t in "${SANITIZED_TESTS[@]}"; do
  if OPENBLAS_NUM_THREADS=1 "$BUILD_DIR/tests/fuzz/sanitized_$t" >"$BUILD_DIR/$t.log" 2>&1; then
    echo "$t under ASan + UBSan: $(grep -Eo '\[  PASSED  \] [0-9]+ tests?' "$BUILD_DIR/$t.log")"
  else
    echo "$t under ASan + UBSan: FAILED"; grep -E "ERROR: |runtime error|FAILED|Failure" "$BUILD_DIR/$t.log" | head -20; status=1
  fi
done
exit $status
