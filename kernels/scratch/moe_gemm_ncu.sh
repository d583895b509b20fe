#!/usr/bin/env bash
# On the GPU machine: where moe_gemm's time goes (ncu's stall reasons, pipes, occupancy) on the prefill's shapes,
# then each case timed: default body, staged, gather. Reports to ${1:-ncu-out}/.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-ncu-out}
mkdir -p "$out"
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats"
timeout -k 5 ${NCU_SECONDS:-100} ncu --clock-control none -k regex:moe_gemm --launch-count ${NCU_LAUNCHES:-6} $sections \
  python3 kernels/scratch/moe_gemm_cases.py --cases ${NCU_CASES:-gate512 gate2048 dense2048} --reps 1 --variants default \
  > "$out/ncu.txt" 2>&1
echo "ncu rc=$? ($(wc -l < "$out/ncu.txt") lines)"
timeout -k 5 60 python3 kernels/scratch/moe_gemm_cases.py 2>&1 | tee "$out/cases.txt"
