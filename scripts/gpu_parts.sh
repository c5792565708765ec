#!/usr/bin/env bash
# Time the decode pipeline's parts (KVCC_STAGES bit 0: rotate q, 1: attention, 2: merge) on a few
# shapes; appends to parts.txt in the output directory. usage: OUT=dir scripts/gpu_parts.sh
set -u -o pipefail
source "$(dirname "$0")/gpu_common.sh"
D=build-gpu-profile
gpu_provenance | tee -a "$OUT/parts.txt"
gpu_build_bench_decode "$D" || exit 1
for st in 7 2 1 4; do
  KVCC_STAGES=$st $D/bench_decode --configs 32:8:1:4096,32:8:1:32768,32:8:8:131072 --out "$D/parts.jsonl" --reps 20 |
    grep decode | sed "s/^/stages=$st /" | tee -a "$OUT/parts.txt"
done
