#!/usr/bin/env bash
# Warp stall reasons and issue statistics of the INT2 decode kernel (one launch per shape), from
# Nsight Compute (with per-pipe instruction counts and busy %); one stalls_<shape>.txt per shape in
# the output directory. usage: OUT=dir [CONFIGS="32:8:8:131072 32:8:1:32768"] scripts/gpu_stalls.sh
set -u -o pipefail
source "$(dirname "$0")/gpu_common.sh"
D=build-gpu-profile
gpu_provenance
gpu_build_bench_decode "$D" || exit 1
for cfg in ${CONFIGS:-32:8:8:131072}; do
  timeout 150 ncu --clock-control none --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 1 \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,regex:smsp__inst_executed_pipe_[a-z_]+\.sum$,regex:sm__pipe_[a-z_]+_cycles_active\.avg\.pct_of_peak_sustained_active$,dram__bytes_read.sum,gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_elapsed.avg' \
    $D/bench_decode --configs "$cfg" --out "$D/q.jsonl" --reps 3 > "$OUT/stalls_${cfg//:/_}.txt" 2>&1
  echo "== $cfg (ncu exit $?)"
  grep -E 'stalled|pipe|inst_executed|issue_active|warps_|bytes|duration|cycles' "$OUT/stalls_${cfg//:/_}.txt" |
    awk '{ if ($NF+0 > 0.05 || $0 !~ /stalled/) print $1, $NF }'
done
