#!/usr/bin/env bash
# Profiling pass for the decode kernel: SASS instruction mix of the INT2 kernel, Nsight Compute
# sections for one long-context launch, and timings under a few split-K CTA targets.
# Writes $OUT/profile.txt and $OUT/sass_hist.txt. usage: OUT=dir scripts/gpu_profile.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
D=build-gpu-direct
mkdir -p $D
NV="nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -DKVCC_HAVE_CUDA=1 -I."
CUINC=$(dirname "$(dirname "$(command -v nvcc)")")/include
g++ -std=c++20 -O2 -DKVCC_HAVE_CUDA=1 -I. -I"$CUINC" -c runtime/kv_cache.cpp -o $D/kv_cache.o &
$NV -c runtime/append.cu -o $D/append.o &
$NV -c bench/bench_decode.cu -o $D/bench_decode.o &
$NV -Xptxas -v -c runtime/decode.cu -o $D/decode.o 2>&1 | grep -E 'registers|spill' > "$OUT/profile.txt"
wait
nvcc -arch=sm_90 $D/bench_decode.o $D/decode.o $D/append.o $D/kv_cache.o -o $D/bench_decode || exit 1
cuobjdump -sass $D/decode.o > $D/decode.sass
python3 - "$D/decode.sass" > "$OUT/sass_hist.txt" <<'PY'
import re, sys, collections
text = open(sys.argv[1]).read()
for fn in re.split(r"\n\s+Function : ", text)[1:]:
    name = fn.split("\n")[0]
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?", fn)
    c = collections.Counter(ops)
    print(name, "total", len(ops))
    print("  ", ", ".join(f"{k}:{v}" for k, v in c.most_common(40)))
PY
for t in 0 256 264 512 1056; do
  echo "target_ctas=$t" >> "$OUT/profile.txt"
  KVCC_TARGET_CTAS=$t $D/bench_decode --configs 32:8:8:131072,32:8:1:32768 --out /tmp/p.jsonl --reps 20 | grep decode >> "$OUT/profile.txt"
done
timeout 200 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
  --section SchedulerStats --section WarpStateStats --section InstructionStats --section LaunchStats \
  $D/bench_decode --configs 32:8:8:131072 --out /tmp/q.jsonl --reps 3 >> "$OUT/profile.txt" 2>&1
echo "ncu exit $?" >> "$OUT/profile.txt"
tail -c 20000 "$OUT/profile.txt"
