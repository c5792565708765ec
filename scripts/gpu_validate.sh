#!/usr/bin/env bash
# `kvcc validate --cache runtime` on the GPU: builds kvcc and test_validate with CUDA, runs the
# device-pool test (ValidateRuntime.DevicePoolMatchesHostPool: the GPU runtime's NLL/KL against
# the host pool's on a synthetic d = 128 model), and, when a real model was copied into the
# git-ignored .device/ (.device/gutenberg-27m, or .device/gutenberg-27m.tar.xz when the copy must
# be small, and held-out documents as token ids, .device/gutenberg_heldout_half.ids from
# `kvcc tokenize`, for a GPU machine without PCRE2, which this model's tokenizer needs), times the
# same validation (the zoo's gutenberg-27m oscar artifact unless ART is set) on the GPU runtime,
# the CPU runtime and the codec path. (scripts/gpu_run.sh runs the device-pool test only.)
# usage: OUT=dir [RUNS="runtime:gpu runtime:cpu codec:auto"] [BUILD=CMake build dir, default build-gpu]
#        scripts/gpu_validate.sh   (writes validate_*.txt / .json into the output directory)
# Another model and its run: M=model dir, IDS=token ids, ART="a.kvcc.h5 b.kvcc.h5" (every artifact
# in one validate), WINDOWS="--sink 16 --recent 128 --page-size 64" (the default; the artifacts' own:
# WINDOWS=""; the GPU kernels take windows in multiples of 16 tokens),
# LENGTH="--tokens 8192" (or e.g. "--max-seq-len 16384 --late-from 8192": whole long documents).
set -u -o pipefail
source "$(dirname "$0")/gpu_common.sh"
BUILD=${BUILD:-$GPU_BUILD}
GPU_BUILD=$BUILD
gpu_provenance
t0=$(date +%s)
gpu_cmake_build kvcc test_validate >"$OUT/validate_build.txt" 2>&1 ||
  { echo "validate BUILD FAILED (see $OUT/validate_build.txt)"; tail -20 "$OUT/validate_build.txt"; exit 1; }
echo "validate build: $(( $(date +%s) - t0 )) s"
"$BUILD/tests/test_validate" --gtest_filter='ValidateRuntime.*' | tee "$OUT/validate_device_test.txt" |
  grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) *\]|KL host'
M=${M:-.device/gutenberg-27m}
[ -d "$M" ] || [ ! -f "$M.tar.xz" ] || tar -C "$(dirname "$M")" -xJf "$M.tar.xz"
if [ -d "$M" ]; then
  IDS=${IDS:-.device/gutenberg_heldout_half.ids}
  ART=${ART:-$(ls zoo/published/gutenberg-27m/oscar-*/artifact.*.kvcc.h5 | head -1)}
  arts=()
  for a in $ART; do arts+=(-a "$a"); done
  for run in ${RUNS:-runtime:gpu runtime:cpu codec:auto}; do
    set -- ${run/:/ }
    s=$(date +%s%N)
    "$BUILD/cli/kvcc" validate --model "$M" "${arts[@]}" --ids "$IDS" ${LENGTH:---tokens ${TOKENS:-8192}} \
      ${WINDOWS---sink 16 --recent 128 --page-size 64} --cache "$1" --device "$2" \
      --json "$OUT/validate_$1_$2.json" > "$OUT/validate_$1_$2.txt" 2>&1
    echo "validate --cache $1 --device $2: exit $?, $(( ($(date +%s%N) - s) / 1000000 )) ms wall"
    tail -n 4 "$OUT/validate_$1_$2.txt"
  done
fi
