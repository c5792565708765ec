#!/usr/bin/env bash
# Tuning pass for the decode kernel: the INT2 page pipelines (KVCC_DECODE_PREFETCH 2: cp.async ring; 1: two pages
# in registers, 2 CTAs/SM; 0: one page, 3 CTAs/SM) on long and short contexts, then Nsight
# Compute sections for one long-context launch of the default build. Appends to $OUT/profile.txt.
# usage: OUT=dir scripts/gpu_profile.sh
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
D=build-gpu-profile
mkdir -p $D
CUINC=$(dirname "$(dirname "$(command -v nvcc)")")/include
g++ -std=c++20 -O2 -DKVCC_HAVE_CUDA=1 -I. -I"$CUINC" -c runtime/kv_cache.cpp -o $D/kv_cache.o &
for v in 0 1 2; do
  NV="nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr -lineinfo -DKVCC_HAVE_CUDA=1 -DKVCC_DECODE_PREFETCH=$v -I."
  ( $NV -c runtime/append.cu -o $D/append$v.o && $NV -c bench/bench_decode.cu -o $D/bench$v.o &&
    $NV -c runtime/decode.cu -o $D/decode$v.o ) &
done
wait
for v in 0 1 2; do
  nvcc -arch=sm_90 $D/bench$v.o $D/decode$v.o $D/append$v.o $D/kv_cache.o -o $D/bench_decode$v || exit 1
done
for v in 0 1 2; do
  echo "KVCC_DECODE_PREFETCH=$v" | tee -a "$OUT/profile.txt"
  $D/bench_decode$v --configs 32:8:8:131072,32:8:1:32768,32:8:64:32768,32:8:1:131072 --out /tmp/p$v.jsonl --reps 20 |
    grep decode | tee -a "$OUT/profile.txt"
done
timeout 120 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --section Occupancy \
  $D/bench_decode2 --configs 32:8:8:131072 --out /tmp/q.jsonl --reps 3 2>&1 |
  grep -E 'Duration|Throughput|Ipc|Issue Slots|Eligible|Active Warps|Issued Instructions|pipeline|Achieved Occupancy|Stall' >> "$OUT/profile.txt"
echo "ncu exit $?" >> "$OUT/profile.txt"
