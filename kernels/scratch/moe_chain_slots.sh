#!/usr/bin/env bash
# moe_chain's blocks resident at once (twenty-sixth session): the chain traces of the tree in .base and of this one,
# then this one with 16-row gate/up jobs (LILY_MLX_PLAN=moe_gate_up.RPS=4: 609 blocks at 168 registers instead of 897
# at 96), with the timeline of both plans. Run after scripts/gpu_checks.sh on the same machine (its model, caches).
#   bash kernels/scratch/moe_chain_slots.sh MODEL OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
model=$1 out=$2
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx} LILY_MLX_KERNEL_CACHE=${LILY_MLX_KERNEL_CACHE:-/tmp/lily-kernel-sources}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
trace="LILY_MLX_KERNEL_DEFINES=LILY_CHAIN_TRACE=4096"
run() {  # run NAME COMMAND: at most 100 s
  echo "== $1" | tee -a "$out/slots.txt"
  timeout -s ABRT -k 10 100 bash -c "$2" 2>&1 | grep -v "Warning\|_warn_once" | tee -a "$out/slots.txt"
}
[ -d .base/lily_mlx ] && run "chain trace, the tree in .base" \
  "cd .base && PYTHONPATH=$PWD/.base:$PYTHONPATH $trace python3 -m bench.chain_trace --model $model --context 64 --compiled"
run "chain trace, this tree" "$trace python3 -m bench.chain_trace --model $model --context 64 --compiled"
run "chain trace, gate/up RPS 4" \
  "LILY_MLX_PLAN=moe_gate_up.RPS=4 $trace python3 -m bench.chain_trace --model $model --context 64 --compiled"
run "timeline, gate/up RPS 4" "LILY_MLX_PLAN=moe_gate_up.RPS=4 python3 -m bench.gpu_timeline --model $model --context 64"
run "timeline, this tree's plan" "python3 -m bench.gpu_timeline --model $model --context 64"
