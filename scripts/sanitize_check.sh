#!/usr/bin/env bash
# The readers of untrusted files under AddressSanitizer + UndefinedBehaviorSanitizer, as CI runs
# them (ctest's Sanitizers.ReadersUnderAsanUbsan, label cpu): builds the libFuzzer targets of
# tests/fuzz (clang, -DKVCC_FUZZ=ON: formats only, a few minutes), replays every regression input
# of tests/fuzz/regressions through both targets (each reader of artifacts — HDF5 and safetensors —
# and of stats), then fuzzes each target for SECONDS (default 30) from the seeds. Any sanitizer
# report, crash, timeout or allocation past the limit fails it (exit 1). Without clang or its
# fuzzer runtime it reports skipped (exit 77).
#   scripts/sanitize_check.sh [SECONDS]        (BUILD_DIR default build/sanitize)
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-30}
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
cmake --build "$BUILD_DIR" -j "${JOBS:-2}" --target fuzz_artifact fuzz_stats fuzz_make_seeds >"$BUILD_DIR.build.log" 2>&1 ||
  { tail -30 "$BUILD_DIR.build.log"; exit 1; }

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
limits=(-timeout=10 -malloc_limit_mb=1024 -rss_limit_mb=2560)
status=0
regressions=(tests/fuzz/regressions/*.h5)
for target in fuzz_artifact fuzz_stats; do
  # Replay: libFuzzer runs each file once and stops at the first failure.
  if "$BUILD_DIR/tests/fuzz/$target" "${limits[@]}" "${regressions[@]}" >"$BUILD_DIR/$target.replay.log" 2>&1; then
    echo "$target: ${#regressions[@]} regression inputs replayed clean"
  else
    echo "$target: FAILED on the regression inputs"; tail -40 "$BUILD_DIR/$target.replay.log"; status=1
  fi
  seeds="$BUILD_DIR/seeds/$target"
  rm -rf "$seeds" "$BUILD_DIR/crashes/$target"
  mkdir -p "$seeds" "$BUILD_DIR/crashes/$target"
  case "$target" in
    fuzz_artifact)
      find zoo/published -name 'artifact.*.kvcc.h5' -size -1024k -exec cp {} "$seeds/" \;
      # The same artifacts in the safetensors container (read_artifact takes both).
      for a in "$seeds"/*.kvcc.h5; do "$BUILD_DIR/tests/fuzz/fuzz_make_seeds" --safetensors "$a" "${a%.h5}.safetensors"; done
      ;;
    fuzz_stats) "$BUILD_DIR/tests/fuzz/fuzz_make_seeds" "$seeds/stats.h5" >/dev/null ;;
  esac
  if "$BUILD_DIR/tests/fuzz/$target" "$seeds" "${limits[@]}" -max_total_time="$SECONDS_PER_TARGET" -max_len=$((1 << 20)) \
    -artifact_prefix="$BUILD_DIR/crashes/$target/" >"$BUILD_DIR/$target.fuzz.log" 2>&1; then
    echo "$target: fuzzed ${SECONDS_PER_TARGET} s clean ($(grep -o 'stat::number_of_executed_units: [0-9]*' "$BUILD_DIR/$target.fuzz.log" || grep -Eo '#[0-9]+' "$BUILD_DIR/$target.fuzz.log" | tail -1))"
  else
    echo "$target: FAILED while fuzzing (the input is in $BUILD_DIR/crashes/$target/)"; tail -40 "$BUILD_DIR/$target.fuzz.log"; status=1
  fi
done
exit $status
