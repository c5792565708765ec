#!/usr/bin/env bash
# Time the decode pipeline's parts (KVCC_STAGES bit 0: rotate q, 1: attention, 2: merge) on a few
# shapes. usage: OUT=dir scripts/gpu_parts.sh
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
for st in 7 2 1 4; do
  KVCC_STAGES=$st $D/bench_decode --configs 32:8:1:4096,32:8:1:32768,32:8:8:131072 --out /tmp/s.jsonl --reps 20 |
    grep decode | sed "s/^/stages=$st /" | tee -a "$OUT/parts.txt"
done
