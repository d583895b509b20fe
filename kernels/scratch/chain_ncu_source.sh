#!/usr/bin/env bash
# Where attn_chain's warps stall, instruction by instruction: ncu's source counters (PC sampling) and warp states over
# one compiled decode step's attention launch (4 layers: three DeltaNet, one attention; every chain on), written as the
# SASS source page (CSV) and the details page, both xz'd into OUTDIR for reading off the device. (Eight chain launches
# with five sections took over 200 s in run 48.)
#   bash kernels/scratch/chain_ncu_source.sh MODEL CONTEXT OUTDIR
set -uo pipefail
model=$1 ctx=$2 out=$3
rep=/tmp/chains_src_$ctx
env LILY_MLX_ENABLE=moe_chain,deltanet_chain_out,attn_chain,packed_weights,bundled_weights \
  ncu --profile-from-start off --cache-control none --clock-control none -c 1 -f -o "$rep" \
  -k 'regex:attn_chain' --section SourceCounters --section WarpStateStats \
  python3 kernels/scratch/prefill_ncu.py --model "$model" --tokens "$ctx" --layers 4 --decode-steps 1 2>&1 | tail -5
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -6 > "$out/ncu_sass_$ctx.csv.xz"
ncu -i "$rep.ncu-rep" --page details --print-details all 2>&1 | xz -6 > "$out/ncu_details_$ctx.txt.xz"
ls -la "$out"/ncu_*_"$ctx".*
xz -dc "$out/ncu_details_$ctx.txt.xz" | grep -E "_chain|Duration|Stall|Warp Cycles Per Issued|Registers Per|Achieved Occupancy" | head -60
