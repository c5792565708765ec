#!/usr/bin/env bash
# One GPU session: build the CUDA targets, run the GPU tests (plus compute-sanitizer on a subset),
# run the decode/append benchmark and PyTorch SDPA on the same shapes, and write
# $OUT/gpu_results.json and $OUT/gpu_results.md (scripts/gpu_report.py).
# usage: OUT=dir scripts/gpu_run.sh [quick]
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
LOG=$OUT/gpu_log.txt
exec > >(tee -a "$LOG") 2>&1
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
JOBS=$(nproc)

# Build through CMake (only the targets needed); if another library of the project does not
# compile right now, build the runtime's own sources directly (they need headers only).
TEST=$BUILD/tests/gpu_test_cache
BENCH=$BUILD/bench/bench_decode
build_cmake() {
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$BUILD" --target gpu_test_cache bench_decode -j"$JOBS"
}
build_direct() {
  local D=$BUILD-direct
  mkdir -p "$D"
  local NV="nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -DKVCC_HAVE_CUDA=1 -I."
  local CUINC=$(dirname "$(dirname "$(command -v nvcc)")")/include
  for f in runtime/kv_cache.cpp runtime/append_ref.cpp runtime/attention_ref.cpp; do
    g++ -std=c++20 -O2 -DKVCC_HAVE_CUDA=1 -I. -I"$CUINC" -c "$f" -o "$D/$(basename "$f").o" || return 1
  done
  $NV -c runtime/decode.cu -o "$D/decode.o" && $NV -c runtime/append.cu -o "$D/append.o" &&
    $NV -c tests/gpu_test_cache.cu -o "$D/gpu_test_cache.o" && $NV -c bench/bench_decode.cu -o "$D/bench_decode.o" || return 1
  local LIBS="$D/decode.o $D/append.o $D/kv_cache.cpp.o $D/append_ref.cpp.o $D/attention_ref.cpp.o"
  nvcc -arch=sm_90 "$D/gpu_test_cache.o" $LIBS -lgtest -lgtest_main -o "$D/gpu_test_cache" &&
    nvcc -arch=sm_90 "$D/bench_decode.o" $LIBS -o "$D/bench_decode" || return 1
  TEST=$D/gpu_test_cache
  BENCH=$D/bench_decode
}
t0=$(date +%s)
if build_cmake; then echo "built with CMake"; else echo "CMake build failed; building the runtime sources directly"; build_direct || { echo "BUILD FAILED"; exit 1; }; fi
echo "build: $(( $(date +%s) - t0 )) s"

"$TEST" --gtest_output=xml:"$OUT/gpu_tests.xml"
echo "gpu tests exit: $?"
if command -v compute-sanitizer >/dev/null; then
  timeout 240 compute-sanitizer --tool memcheck --log-file "$OUT/sanitizer.txt" "$TEST" \
    --gtest_filter='GpuDecode.Int2MatchesReferenceGqa5OneSplit:GpuDecode.Bf16*:GpuAppend.Rotation*' >/dev/null
  echo "memcheck exit: $? ($(grep -c 'ERROR SUMMARY: 0' "$OUT/sanitizer.txt" 2>/dev/null) clean summaries)"
  timeout 180 compute-sanitizer --tool racecheck "$TEST" --gtest_filter='GpuDecode.Int2MatchesReferenceGqa4:GpuDecode.Int2MatchesReferenceWideRing:GpuDecode.Int2LevelTable*' 2>&1 | grep -E 'RACECHECK|hazard|ERROR' | head -5
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
# Where small-batch time goes (KVCC_STAGES bits: 1 rotate q, 2 attention, 4 merge); not in the table.
for st in 2 1 4; do
  KVCC_STAGES=$st "$BENCH" --configs 32:8:1:4096,32:8:1:32768 --out /tmp/parts.jsonl --reps 20 | grep decode | sed "s/^/stages=$st /"
done
PYTHONUNBUFFERED=1 python3 bench/bench_sdpa.py --configs "$CONFIGS" --out "$OUT/sdpa.jsonl" --reps 30
echo "bench_sdpa exit: $?"
python3 scripts/gpu_report.py "$OUT"
echo "total: $(( $(date +%s) - t0 )) s"
