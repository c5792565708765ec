#!/usr/bin/env bash
# Tuning pass for the decode kernel: the two INT2 page-ring builds forced on every shape
# (KVCC_RING=3: 3-stage ring, 3 CTAs/SM; KVCC_RING=2: 2-stage ring, 4 CTAs/SM) against the plan's
# own choice, then Nsight Compute sections for one long-context launch. Appends to profile.txt in
# the output directory. usage: OUT=dir scripts/gpu_profile.sh
set -u -o pipefail
source "$(dirname "$0")/gpu_common.sh"
D=build-gpu-profile
gpu_provenance | tee -a "$OUT/profile.txt"
gpu_build_bench_decode "$D" || exit 1
CONFIGS=32:8:8:131072,32:8:1:32768,32:8:64:32768,32:8:1:131072
for ring in 0 3 2; do
  echo "KVCC_RING=$ring (0: the plan's choice)" | tee -a "$OUT/profile.txt"
  KVCC_RING=$ring $D/bench_decode --configs $CONFIGS --out "$D/p$ring.jsonl" --reps 20 |
    grep decode | tee -a "$OUT/profile.txt"
done
timeout 120 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
  --section InstructionStats --section Occupancy \
  $D/bench_decode --configs 32:8:8:131072 --out "$D/q.jsonl" --reps 3 2>&1 |
  grep -E 'Duration|Throughput|Ipc|Issue Slots|Eligible|Active Warps|Issued Instructions|pipeline|Achieved Occupancy|Stall' >> "$OUT/profile.txt"
echo "ncu exit $?" >> "$OUT/profile.txt"
