#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, ASan + UBSan) and runs each for a while.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default 300 s; default targets: all of
#                                                         FUZZ_TARGETS in tests/fuzz/seeds.sh)
#
# Seeds (tests/fuzz/seeds.sh): the project's real files of each kind (published artifacts and
# zoo index, the test models' safetensors, configs and index, the demo's llama2.c model and
# tokenizer, the models' tokenizer.json under SHARED (../shared), the OSCAR .pt fixtures and
# their pickles, a stats file and token-id files written here) plus the target's files kept under
# tests/fuzz/regressions. The corpus grows in BUILD_DIR/corpus/TARGET (kept between runs). A crash,
# a timeout (-timeout, default 10 s) or an allocation past -malloc_limit_mb (default 1024) is saved
# as tests/fuzz/regressions/TARGET-KIND-HASH.EXT, which scripts/sanitize_check.sh replays (and
# tests/test_formats_mutations.cpp too, for the HDF5 ones).
# libFuzzer runs in fork mode and goes on after a finding (-ignore_crashes etc.), so one known
# defect does not end the run; at most KEEP (5) findings per target are copied to
# tests/fuzz/regressions, the rest stay in BUILD_DIR/crashes/TARGET.
# Environment: BUILD_DIR (build-fuzz), JOBS (2, build jobs), WORKERS (1, fuzzing processes per
# target), KEEP (5), SHARED, FUZZ_FLAGS (libFuzzer flags replacing the fork-mode defaults).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET=${1:-300}
shift || true
TARGETS=("$@")
BUILD_DIR=${BUILD_DIR:-build-fuzz}
source tests/fuzz/seeds.sh
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=("${FUZZ_TARGETS[@]}")
JOBS=${JOBS:-2}
REGRESSIONS=tests/fuzz/regressions
KEEP=${KEEP:-5}
WORKERS=${WORKERS:-1}
FUZZ_FLAGS=${FUZZ_FLAGS:--fork=$WORKERS -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1}

if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  CC=${CC:-clang} CXX=${CXX:-clang++} cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVCC_CUDA=OFF -DKVCC_FUZZ=ON -DBUILD_TESTING=OFF
fi
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]}" fuzz_make_seeds

mkdir -p "$REGRESSIONS"
for target in "${TARGETS[@]}"; do
  seeds="$BUILD_DIR/seeds/$target" corpus="$BUILD_DIR/corpus/$target" artifacts="$BUILD_DIR/crashes/$target/"
  rm -rf "$seeds" "$artifacts"
  mkdir -p "$seeds" "$corpus" "$artifacts"
  fuzz_seeds "$target" "$seeds"
  echo "== $target: ${SECONDS_PER_TARGET}s, seeds $(ls "$seeds" | wc -l), corpus $(ls "$corpus" | wc -l)"
  # ASan's allocator_may_return_null keeps a refused huge allocation a bad_alloc (caught by the
  # target as a failure only through -malloc_limit_mb, which reports it with its stack).
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    "$BUILD_DIR/tests/fuzz/$target" "$corpus" "$seeds" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 \
    -malloc_limit_mb=1024 -rss_limit_mb=2560 -max_len="$(fuzz_max_len "$target")" -print_final_stats=1 \
    -artifact_prefix="$artifacts" $FUZZ_FLAGS 2>&1 | tee "$BUILD_DIR/$target.log" | grep -Ev '^#[0-9]+.*(NEW|REDUCE|pulse)|NEW_FUNC' || true
  found=0
  for f in "$artifacts"*; do
    [ -f "$f" ] || continue
    found=$((found + 1))
    [ "$found" -le "$KEEP" ] || continue
    name=$(basename "$f")
    kept="$REGRESSIONS/$target-${name%%-*}-$(sha256sum "$f" | cut -c1-12).$(fuzz_extension "$target")"
    cp "$f" "$kept"
    echo "kept $kept"
  done
  echo "== $target: $found findings in $artifacts, corpus $(ls "$corpus" | wc -l) files ($(du -sh "$corpus" | cut -f1))"
done
