#!/usr/bin/env bash
# Where a chain's warps stall, instruction by instruction: ncu's source counters (PC sampling), warp states, occupancy
# and its limiters over one launch of KERNEL (default attn_chain) in a compiled decode step (4 layers: three DeltaNet,
# one attention; every chain on), written as the SASS source page (CSV) and the details page, both xz'd into OUTDIR
# for reading off the device. (Eight chain launches with five sections took over 200 s in run 48.)
#   [KERNEL=moe_chain] bash kernels/scratch/chain_ncu_source.sh MODEL CONTEXT OUTDIR
set -uo pipefail
model=$1 ctx=$2 out=$3 kernel=${KERNEL:-attn_chain}
rep=/tmp/${kernel}_src_$ctx
env LILY_MLX_ENABLE=moe_chain,deltanet_chain_out,attn_chain,packed_weights,bundled_weights \
  ncu --profile-from-start off --cache-control none --clock-control none -c 1 -f -o "$rep" \
  -k "regex:$kernel" --section SourceCounters --section WarpStateStats --section Occupancy --section LaunchStats \
  python3 kernels/scratch/prefill_ncu.py --model "$model" --tokens "$ctx" --layers 4 --decode-steps 1 2>&1 | tail -5
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -6 > "$out/ncu_sass_${kernel}_$ctx.csv.xz"
ncu -i "$rep.ncu-rep" --page details --print-details all 2>&1 | xz -6 > "$out/ncu_details_${kernel}_$ctx.txt.xz"
ls -la "$out"/ncu_*_"${kernel}_$ctx".*
xz -dc "$out/ncu_details_${kernel}_$ctx.txt.xz" | grep -E "_chain|Duration|Stall|Warp Cycles Per Issued|Registers Per|Occupancy|Block Limit|Shared Memory" | head -80
