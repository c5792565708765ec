#!/usr/bin/env bash
# Tuning pass for the decode kernel: the two INT2 page-ring builds forced on every shape
# (KVCC_RING=3: 3-stage ring, 3 CTAs/SM; KVCC_RING=2: 2-stage ring, 4 CTAs/SM) against the plan's
# own choice, then Nsight Compute sections for one long-context launch. Appends to
# $OUT/profile.txt. usage: OUT=dir scripts/gpu_profile.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
D=build-gpu-profile
mkdir -p $D
CUINC=$(dirname "$(dirname "$(command -v nvcc)")")/include
NV="nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -DKVCC_HAVE_CUDA=1 -I."
g++ -std=c++20 -O2 -DKVCC_HAVE_CUDA=1 -I. -I"$CUINC" -c runtime/kv_cache.cpp -o $D/kv_cache.o &
$NV -c runtime/append.cu -o $D/append.o &
$NV -c bench/bench_decode.cu -o $D/bench.o &
$NV -c runtime/decode.cu -o $D/decode.o &
wait
nvcc -arch=sm_90 $D/bench.o $D/decode.o $D/append.o $D/kv_cache.o -o $D/bench_decode || exit 1
CONFIGS=32:8:8:131072,32:8:1:32768,32:8:64:32768,32:8:1:131072
for ring in 0 3 2; do
  echo "KVCC_RING=$ring (0: the plan's choice)" | tee -a "$OUT/profile.txt"
  KVCC_RING=$ring $D/bench_decode --configs $CONFIGS --out /tmp/p$ring.jsonl --reps 20 |
    grep decode | tee -a "$OUT/profile.txt"
done
timeout 120 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --section Occupancy \
  $D/bench_decode --configs 32:8:8:131072 --out /tmp/q.jsonl --reps 3 2>&1 |
  grep -E 'Duration|Throughput|Ipc|Issue Slots|Eligible|Active Warps|Issued Instructions|pipeline|Achieved Occupancy|Stall' >> "$OUT/profile.txt"
echo "ncu exit $?" >> "$OUT/profile.txt"
