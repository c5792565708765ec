#!/usr/bin/env bash
# Compare decode kernel variants in one run: build runtime/decode.cu under several compile-time
# settings (plus an optional "before" copy of decode.cu), each linked against the CMake build's
# libraries (scripts/gpu_common.sh), run the GPU tests against each tested variant, then
# bench_decode for every variant on the same shapes and PyTorch SDPA once. Results in the output
# directory: perf_<variant>_r<round>.jsonl, sdpa.jsonl, perf_log.txt.
# usage: OUT=dir [BEFORE=old_decode.cu] [ROUNDS=2] [CONFIGS=...] [SWEEP_TARGETS="132 264"] [RACECHECK=variant] [NO_SDPA=1]
#        [PARTS=configs (time the pipeline stages of the first variant)]
#        [SWEEP_ENVS="KVCC_RING=2 KVCC_TARGET_CTAS=396,KVCC_STAGES=2" (the first variant once per setting; commas join assignments)]
#        [SANITIZE_FILTER=gtest filter (racecheck only, on those tests; default: racecheck + memcheck)]
#        [BUILD=dir for the variants' objects (default build-gpu-perf)] [GPU_BUILD=CMake build dir (default build-gpu)]
#   (where the output directory is copied back with a limit on the number of files: ROUNDS,
#   SWEEP_* and variants multiply them)
#        scripts/gpu_perf.sh "name:-DFLAGS" ...
#   each argument is a variant name and its nvcc defines (or @path: another decode.cu); variants
#   named test* also run the tests. A snapshot of decode.cu must match the current
#   runtime/kv_kernels.h and define what the current decode.cu defines (scripts/gpu_common.sh).
set -u -o pipefail
source "$(dirname "$0")/gpu_common.sh"
D=${BUILD:-build-gpu-perf}
mkdir -p "$D"
exec > >(tee -a "$OUT/perf_log.txt") 2>&1
gpu_provenance
CONFIGS=${CONFIGS:-32:8:1:4096,32:8:1:32768,32:8:8:32768,32:8:8:131072,32:8:64:32768,32:8:1:131072}
t0=$(date +%s)
# The benchmark and test the variants are linked into (gpu_link takes their link commands).
gpu_cmake_build bench_decode gpu_test_cache >"$D/cmake_build.txt" 2>&1 &
cmake_pid=$!
# Explicit pids: a bare `wait` would also wait for the tee above, which never ends.
pids=()
names=()
for v in "$@"; do
  name=${v%%:*}
  flags=${v#*:}
  names+=("$name")
  src=runtime/decode.cu
  if [ "$name" = before ]; then src=${BEFORE:?BEFORE must name the old decode.cu}; fi
  # "name:@path/to/decode.cu" builds another copy of decode.cu (a snapshot) without extra flags.
  if [ "${flags#@}" != "$flags" ]; then src=${flags#@}; flags=; fi
  # (the old file includes its headers relative to the repo root, so -I. serves both)
  gpu_nvcc $flags -Xptxas -v -c "$src" -o "$D/decode_$name.o" >"$D/ptxas_$name.txt" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || echo "COMPILE FAILED (pid $p)"; done
wait "$cmake_pid" || { echo "CMAKE BUILD FAILED ($GPU_BUILD)"; tail -20 "$D/cmake_build.txt"; }
for name in "${names[@]}"; do
  grep -A2 'ModeE0' "$D/ptxas_$name.txt" | grep -E 'registers|spill' | sed "s/^/$name int2 kernel: /"
  gpu_link "$D/bench_$name" bench/bench_decode "$D/decode_$name.o" || echo "LINK FAILED $name"
  case $name in
    test*) gpu_link "$D/test_$name" tests/gpu_test_cache "$D/decode_$name.o" || echo "LINK FAILED test $name" ;;
  esac
done
echo "build: $(( $(date +%s) - t0 )) s"
# Static SASS of each variant's INT2 kernel (the page loop is unrolled, so these counts track the
# per-page instruction mix): total and the opcodes that carry the work.
for name in "${names[@]}"; do
  cuobjdump --dump-sass "$D/decode_$name.o" 2>/dev/null |
    awk 'function dump() { if (tot) { printf "%s total %d:", fn, tot; for (o in n) if (n[o] >= 16) printf " %s=%d", o, n[o]; printf "\n" } delete n; tot = 0 }
      /Function :/ { dump(); on = ($0 ~ /ModeE0/); fn = ($0 ~ /Li2E/) ? "ring2" : "ring3" }
      on && /^ +\/\*[0-9a-f]+\*\// { split($2, p, "."); op = p[1]; if (op ~ /^@/) { split($3, p, "."); op = p[1] } n[op]++; tot++ }
      END { dump() }' |
    sed "s/^/$name sass: /"
done
for name in "${names[@]}"; do
  if [ -x "$D/test_$name" ]; then
    "$D/test_$name" --gtest_output=xml:"$OUT/gpu_tests_$name.xml" | grep -E '^\[  (PASSED|FAILED) |FAILED|decode int2' 
    echo "gpu tests $name exit: $?"
  fi
done
if [ -n "${RACECHECK:-}" ] && [ -n "${SANITIZE_FILTER:-}" ] && command -v compute-sanitizer >/dev/null; then
  timeout 120 compute-sanitizer --tool racecheck "$D/test_$RACECHECK" --gtest_filter="$SANITIZE_FILTER" 2>&1 |
    grep -E 'RACECHECK|hazard|ERROR|PASSED|FAILED' | head -5
elif [ -n "${RACECHECK:-}" ] && command -v compute-sanitizer >/dev/null; then
  timeout 120 compute-sanitizer --tool racecheck "$D/test_$RACECHECK" \
    --gtest_filter='GpuDecode.Int2MatchesReferenceGqa4:GpuDecode.Int2MatchesReferenceWideRing:GpuDecode.Int2LevelTable*' 2>&1 |
    grep -E 'RACECHECK|hazard|ERROR' | head -5
  timeout 120 compute-sanitizer --tool memcheck "$D/test_$RACECHECK" \
    --gtest_filter='GpuDecode.Int2*OneSplit:GpuDecode.Int2*WideRing:GpuDecode.Int2LevelTable*:GpuDecode.Bf16*' 2>&1 |
    grep -E 'ERROR SUMMARY' | head -5
fi
# Variants interleaved per round so clock/thermal drift hits all of them alike.
for round in $(seq 1 "${ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    "$D/bench_$name" --configs "$CONFIGS" --out "$OUT/perf_${name}_r$round.jsonl" --reps 30 | grep decode | sed "s/^/r$round $name /"
  done
done
# Where small-batch time goes (KVCC_STAGES bits: 1 rotate q, 2 attention, 4 merge), first variant.
if [ -n "${PARTS:-}" ]; then
  for st in 2 1 4; do
    KVCC_STAGES=$st "$D/bench_${names[0]}" --configs "$PARTS" --out "$D/parts.jsonl" --reps 20 | grep decode | sed "s/^/stages=$st /"
  done
fi
# Split-K plan sweep: the first variant with KVCC_TARGET_CTAS (CTAs the plan aims at) overridden.
for target in ${SWEEP_TARGETS:-}; do
  KVCC_TARGET_CTAS=$target "$D/bench_${names[0]}" --configs "$CONFIGS" --out "$OUT/sweep_$target.jsonl" --reps 30 |
    grep decode | sed "s/^/target=$target /"
done
# Other runtime settings of the first variant (environment assignments, one bench run each).
for e in ${SWEEP_ENVS:-}; do
  env ${e//,/ } "$D/bench_${names[0]}" --configs "$CONFIGS" --out "$OUT/sweep_${e//[^A-Za-z0-9]/_}.jsonl" --reps 30 |
    grep decode | sed "s/^/$e /"
done
if [ -z "${NO_SDPA:-}" ]; then
  PYTHONUNBUFFERED=1 python3 bench/bench_sdpa.py --configs "$CONFIGS" --out "$OUT/sdpa.jsonl" --reps 30 | tail -n 40
fi
echo "total: $(( $(date +%s) - t0 )) s"
