#!/usr/bin/env bash
# Where a fused kernel's warps wait (H200 experiment, session 6): Nsight Compute's per-reason
# warp stall counts (cycles per issued instruction, summing to "Warp Cycles Per Issued
# Instruction") and the occupancy limits, for the default configuration and any given ones.
#   bash .ci/gpu-run notebooks/results/experiments/stalls.sh   (or: bash stalls.sh M K N 'CFG_JSON'...)
# The split post-norm's GEMM (profile_kernel.py's split mode; EPILOGUE stats, chain or plain):
#   MODE=split EPILOGUE=chain bash stalls.sh 16384 256 1024 '{"stage_tiles": true}'
set -u
cd "$(dirname "$0")"
shape=${1:-4096}; K=${2:-768}; N=${3:-768}; shift $(( $# > 3 ? 3 : $# ))
ncu=${NCU:-/usr/local/cuda/bin/ncu}
for cfg in "" "$@"; do
  echo "== $shape x $K x $N ${cfg:-default}"
  if [ "${MODE:-}" = split ]; then args=(split "${cfg:-{\}}" "${EPILOGUE:-stats}"); kernel=gemm_elementwise
  else args=(${cfg:+"$cfg"}); kernel=main_kernel; fi
  "$ncu" -k "regex:$kernel" -c 1 --section Occupancy --section LaunchStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__average_warp_latency_per_inst_issued.ratio,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum" \
    python3 profile_kernel.py "$shape" "$K" "$N" "${args[@]}" 2>&1 | grep -v "^==PROF==\|Warning\|did not apply" \
    | awk '/stalled/ && $NF+0 < 0.05 {next} {print}'
done
