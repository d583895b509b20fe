#!/usr/bin/env bash
# The GPU session's checks in priority order, each under a time limit, so one short lease yields the most:
# the cuda-marked tests, then the measurements BENCHMARKS.md still lacks. Run from the repository root on an
# NVIDIA machine with MLX's CUDA build importable (the server steps need the `server` extra, or its wheels in
# .ptx-cache/wheels); reports go to ${OUT:-gpu-results}/.
#   bash scripts/gpu_checks.sh [seconds available, default 560]
# Output: log.txt (every step's output) and reports.tgz (the JSON reports, the junit file, the decode profile).
# TESTS narrows the first step (default: every cuda-marked test), e.g. when only defaults changed:
#   TESTS="tests/test_parity_cuda.py tests/test_decode.py" bash scripts/gpu_checks.sh
# TESTS_CAP (seconds; default 200 with TESTS, 300 for the whole set) bounds that step. SKIP, a bash regex, skips the steps whose names match it, e.g. SKIP="server|A/B";
# ONLY runs just the steps whose names match it.
# MLX keeps what NVRTC compiled of its own kernels in MLX_PTX_CACHE_DIR, and reads ours there but never writes them
# (ops/kernel_cache.py writes them when `kernel_cache` is on). The cache comes back as $OUT/ptx.tar.xz (at most
# 15 MB): copied to .ptx-cache/ here and carried (carry [".device", ".ptx-cache"]), the next machine starts with it,
# and with .ptx-cache/lily-kernels.tar.xz (scripts/prebuild_kernels.py) where it exists.
# LENGTHS and PREFILL_VARIANTS replace the prefill step's lengths and its variants and sweeps; PARTS_TOKENS the parts
# step's length; KERNEL_ROWS (a regex) keeps only those kernel-table rows; AB_ARGS replaces the A/B matrix's prompt, generation and round arguments;
# AB_ARMS the arms of the A/B against stock, AB_CAP its time limit (default 240 s); SERVE_ARGS replaces the pipelined and against-stock
# server steps' request arguments; BASELINE (a folder) adds the server step against that older tree.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=${1:-560}
out=${OUT:-gpu-results}
# Every report lands in $res and is tarred into $out/reports.tgz after each step: a device lease returns at most
# 8 files from $OUT, so there (OUT set) the reports themselves stay outside it.
res=${OUT:+/tmp/lily-reports}
res=${res:-$out/reports}
mkdir -p "$out" "$res"
start=$(date +%s)
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}
# cuda_source_files (on): the kernels #include their sources from here by absolute path, which names their modules;
# scripts/prebuild_kernels.py builds them for this same folder.
export LILY_MLX_KERNEL_CACHE=${LILY_MLX_KERNEL_CACHE:-/tmp/lily-kernel-sources}
# kernel_cache (on by default: each kernel built once a machine, not once a process): KERNEL_CACHE=auto (default)
# turns it off after the tests if its cuda tests failed there, 1 keeps it on, 0 turns it off for every step.
kc=${KERNEL_CACHE:-auto}
[ "$kc" = 0 ] && export LILY_MLX_DISABLE=kernel_cache${LILY_MLX_DISABLE:+,$LILY_MLX_DISABLE}
mkdir -p "$MLX_PTX_CACHE_DIR"
[ -f .ptx-cache/ptx.tar.xz ] && tar -C "$MLX_PTX_CACHE_DIR" -xJf .ptx-cache/ptx.tar.xz && \
  echo "ptx cache: $(find "$MLX_PTX_CACHE_DIR" -name '*.ptx' | wc -l) kernels from .ptx-cache/"
# The decode step's kernels built on a machine without a GPU (scripts/prebuild_kernels.py): MLX reads them by name.
[ -f .ptx-cache/lily-kernels.tar.xz ] && tar -C "$MLX_PTX_CACHE_DIR" -xJf .ptx-cache/lily-kernels.tar.xz && \
  echo "ptx cache: $(tar -tJf .ptx-cache/lily-kernels.tar.xz | grep -c '\.ptx$') lily kernels prebuilt"
save_ptx_cache() {  # the compiled kernels without their sources, for the next machine
  [ -n "${OUT:-}" ] || return 0
  tar -C "$MLX_PTX_CACHE_DIR" --exclude='*.cu' -cf - . | xz -T4 -6 > /tmp/ptx.tar.xz
  if [ "$(stat -c %s /tmp/ptx.tar.xz)" -le 15000000 ]; then cp /tmp/ptx.tar.xz "$out/ptx.tar.xz"
  else echo "ptx cache: $(du -h /tmp/ptx.tar.xz | cut -f1) compressed, over 15 MB: not returned"; fi
}
left() { echo $((budget - ($(date +%s) - start))); }
step() {  # step NEED CAP NAME COMMAND...: runs when NEED seconds are left, for at most CAP of them (0: all left)
  local need=$1 cap=$2 name=$3 limit
  shift 3
  if [ -n "${SKIP:-}" ] && [[ "$name" =~ $SKIP ]]; then echo "== $name: skipped (SKIP)"; return; fi
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ $ONLY ]]; then return; fi
  if [ "$(left)" -lt "$need" ]; then echo "== $name: skipped, $(left) s left"; return; fi
  limit=$(left)
  if [ "$cap" -gt 0 ] && [ "$cap" -lt "$limit" ]; then limit=$cap; fi
  echo "== $name ($(left) s left, limit $limit s)" | tee -a "$out/log.txt"
  # SIGABRT at the limit: Python's fault handler then prints where each thread was.
  timeout -s ABRT -k 10 "$limit" "$@" 2>&1 | grep -v "incorrect regex pattern" | tee -a "$out/log.txt"
  tar czf "$out/reports.tgz" -C "$res" .
}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# The copied .git may be stale there: the digest of the code names the tree (python -m bench.ab --digest here).
echo "source digest $(python3 -m bench.ab --digest)"
model=${MODEL:-/tmp/r35}
[ -f "$model/config.json" ] || (python3 -m bench.random_model --out "$model" | tail -1) &
# The bench pins its arms to the GPU's NUMA node where the machine has more than one: say which.
(lscpu | grep -i "numa\|^cpu(s)\|model name"; for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/vendor")" = 0x10de ] && grep -q '^0x03' "$d/class" && echo "GPU $(basename "$d") local CPUs $(cat "$d/local_cpulist")"
done) 2>/dev/null
if [ -n "${TESTS:-}" ]; then
  echo "tests: $TESTS"
  step 90 ${TESTS_CAP:-200} "tests on the GPU" python3 -m pytest -q -n 12 -p no:cacheprovider --junitxml="$res/tests.xml" $TESTS
else
  # The whole cuda-marked suite took longer than 185 s in run 14 (77% done): most of it is compiling instances.
  step 150 ${TESTS_CAP:-300} "cuda tests" python3 -m pytest -q -m cuda -n 12 -p no:cacheprovider --junitxml="$res/tests.xml" \
    --ignore=tests/test_notebooks.py
fi
wait
# kernel_cache (on by default) goes off for the later steps with KERNEL_CACHE=auto if either of its two cuda tests
# failed in the tests step above.
if [ "$kc" = auto ]; then
  python3 - "$res/tests.xml" <<'PY' || kc=0
import sys, xml.etree.ElementTree as ET
try:
    cases = {c.get("name"): c for c in ET.parse(sys.argv[1]).iter("testcase")}
except (OSError, ET.ParseError):
    sys.exit(0)
need = ("test_mlx_loads_the_build_stored_under_its_name_cuda", "test_cached_kernel_equals_mlx_build_cuda")
sys.exit(1 if any(n in cases and any(c.tag in ("failure", "error") for c in cases[n]) for n in need) else 0)
PY
  [ "$kc" = 0 ] && export LILY_MLX_DISABLE=kernel_cache${LILY_MLX_DISABLE:+,$LILY_MLX_DISABLE}
fi
echo "kernel_cache in the later steps: $([ "$kc" = 0 ] && echo off || echo on)"
# Issue 4: a pipelined decode step on the GPU's own timeline (CUPTI kernel records through torch.profiler): the
# unchained step is bound by MLX's dispatch, every chain by its kernels (run 38), and a chain takes longer than its
# parts. Since the twenty-fourth session every chain (with packed, bundled weights and kv_scatter) is CUDA's default
# at one row: LILY_MLX_ENABLE="$chains" names them for trees before that (.base), LILY_MLX_DISABLE="$unchained" is
# the unchained step.
chains=moe_chain,deltanet_chain_out,attn_chain,packed_weights,bundled_weights
unchained=$chains,kv_scatter
# Issue 4's table: decode at contexts 256 and 4096 against stock mlx-lm in the same run, the defaults (every chain)
# and the unchained step. Three arms: a fourth ran out of memory on an 80 GB H100 (run 52).
step 100 ${AB_CAP:-240} "A/B against stock at 256 and 4096 (defaults, unchained)" python3 -m bench.ab --model "$model" \
  -p 256 4096 -g 64 -n 2 --arms "${AB_ARMS:-stock,lily,lily-no-${unchained//,/+}}" --no-progress --json "$res/ab_decode.json" \
  --markdown "$res/ab_decode.md"
step 60 120 "every chain (the defaults) on the GPU's timeline" python3 -m bench.gpu_timeline \
  --model "$model" --context 64 4096 16384 --json "$res/timeline_chains.json"
# PLANS and DEFINES, space-separated $LILY_MLX_PLAN and $LILY_MLX_KERNEL_DEFINES values: every chain's timeline under
# each, beside the defaults' above (a launch shape's or a kernel experiment's A/B in one tree, e.g.
# PLANS="attn_chain.BLOCKS=512 attn_decode.STAGE_ROWS=1024" DEFINES="LILY_SYNC_SLEEP_NS=0"), at the contexts
# VARIANT_CONTEXTS (default 64 4096; a context more costs a variant ~10 s, a process more ~40).
for variant in ${PLANS:+$(printf 'LILY_MLX_PLAN=%s ' $PLANS)} \
               ${DEFINES:+$(printf 'LILY_MLX_KERNEL_DEFINES=%s ' $DEFINES)}; do
  step 60 120 "every chain on the GPU's timeline, $variant" env "$variant" python3 -m bench.gpu_timeline \
    --model "$model" --context ${VARIANT_CONTEXTS:-64 4096} --json "$res/timeline_${variant//[^A-Za-z0-9]/_}.json"
done
# Where inside a chain: each block's SM, phase, ticket, wait, mark (x' staged or loads issued) and end by %globaltimer
# (bench/chain_trace.py), in the compiled decoder's steps as generate runs them. Early in the order: moe_chain
# (45% of the step) did not move with x first (run 72), and its router phase's wait is the open question.
step 60 150 "inside every chain: blocks' tickets, waits, marks and ends" env LILY_MLX_ENABLE="$chains" \
  LILY_MLX_KERNEL_DEFINES=LILY_CHAIN_TRACE=4096 python3 -m bench.chain_trace --model "$model" --context 64 4096 \
  --compiled --json "$res/chain_trace.json"
# Switch kv_write (on by default on CUDA since run 71): attn_chain writes the new K/V rows into the stacked cache in
# place, so a step has neither the 20 copies that concatenate the layers' rows nor the 2 scatters, nor the copies of
# the whole cache MLX makes for them. Its attribution: lily with and without it, no stock arm (stock beside two arms
# that pack their weights ran out of memory on an 80 GB H100, runs 70-71; two such arms alone are untried).
step 60 120 "every chain on the GPU's timeline, kv_write off" env LILY_MLX_DISABLE=kv_write \
  python3 -m bench.gpu_timeline --model "$model" --context 64 4096 16384 --json "$res/timeline_kv_write_off.json"
step 100 240 "A/B, kv_write on vs off, at 256 and 4096" python3 -m bench.ab --model "$model" -p 256 4096 -g 64 -n 2 \
  --arms lily,lily-no-kv_write --no-progress --json "$res/ab_kv_write.json" --markdown "$res/ab_kv_write.md"
# Every chain's step and the unchained one in an earlier tree, for an A/B of kernel changes in one lease: .base/ holds it, made
# before the lease (git archive <commit> lily_mlx kernels bench pyproject.toml | tar -x -C .base --exclude bench/results)
# and carried (carry [".device", ".ptx-cache", ".base"]); its kernels build there unless the ptx cache has them.
if [ -d .base/lily_mlx ]; then
  base_env="PYTHONPATH=$PWD/.base:$PYTHONPATH"
  step 60 120 "every chain on the GPU's timeline, the tree in .base" env "$base_env" LILY_MLX_ENABLE="$chains" \
    bash -c "cd .base && python3 -m bench.gpu_timeline --model $model --context 64 4096 --json $res/timeline_chains_base.json"
  step 60 120 "every chain on the GPU's timeline, again (the order's effect)" env LILY_MLX_ENABLE="$chains" \
    python3 -m bench.gpu_timeline --model "$model" --context 64 --json "$res/timeline_chains_again.json"
  step 60 120 "decode step on the GPU's timeline (unchained), this tree and .base's" bash -c \
    "LILY_MLX_DISABLE=$unchained python3 -m bench.gpu_timeline --model $model --context 64 --json $res/timeline_new.json \
&& cd .base && $base_env python3 -m bench.gpu_timeline --model $model --context 64 --json $res/timeline_base.json"
fi
# Where deltanet_chain_out's warps stall, instruction by instruction (ncu's PC sampling of one launch; the SASS page
# comes back as a file): its projection phase works 10.4 us a block from DRAM and 8.6 from L2 (run 70), so neither
# bandwidth nor latency of DRAM is what holds it. Run 48's try over 8 chain launches with more sections passed 200 s.
step 60 240 "ncu source counters of deltanet_chain_out (context 64)" env KERNEL=deltanet_chain_out \
  bash kernels/scratch/chain_ncu_source.sh "$model" 64 "$out"
# chain_prefetch's L2 hints, issued for the first time since kernels.expand keeps the chains' hooks (twenty-first
# session; the nineteenth's A/B timed kernels without them): every chain with and without them, and their cuda tests.
step 60 120 "cuda tests of the chains' prefetch" python3 -m pytest -q -m cuda -n 12 -p no:cacheprovider -k prefetch \
  tests/test_moe_chain.py tests/test_deltanet_chain.py tests/test_attn_chain.py
step 60 120 "every chain on the GPU's timeline, chain_prefetch on" env LILY_MLX_ENABLE="$chains,chain_prefetch" \
  python3 -m bench.gpu_timeline --model "$model" --context 64 4096 --json "$res/timeline_chains_prefetch.json"
# Is it the waiting blocks' polls (up to ~500 thread 0s on one counter line, LILY_SYNC_SLEEP_NS = 64 ns apart)? The
# chains' kernel times with pure spinning (0) and 1024 ns; each new value is a fresh NVRTC compile of the chains.
for sleep in 0 1024; do
  step 60 150 "every chain on the GPU's timeline, LILY_SYNC_SLEEP_NS=$sleep" env LILY_MLX_ENABLE="$chains" \
    LILY_MLX_KERNEL_DEFINES=LILY_SYNC_SLEEP_NS=$sleep python3 -m bench.gpu_timeline --model "$model" \
    --context 64 4096 --json "$res/timeline_chains_sleep$sleep.json"
done
step 60 120 "the unchained decode step on the GPU's timeline" env LILY_MLX_DISABLE="$unchained" \
  python3 -m bench.gpu_timeline --model "$model" --context 64 4096 --json "$res/timeline.json"
# Why attn_decode takes ~20 us a layer at context 64 for a few positions a block (34-66 blocks), and where
# moe_gate_up, moe_down_combine and deltanet_step (32 blocks: 12% of the SMs) stall: ncu's warp states, occupancy
# and memory sections, one decode step's 12 launches of them (4 layers), clocks and caches as they run.
step 60 120 "ncu stall reasons of attn_decode, moe_gate_up, moe_down_combine, deltanet_step (context 64)" bash -c \
  "ncu --profile-from-start off --cache-control none --clock-control none -c 12 \
-k 'regex:attn_decode|moe_gate_up|moe_down_combine|deltanet_step' --section SpeedOfLight --section Occupancy \
--section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
python3 kernels/scratch/prefill_ncu.py --model $model --tokens 64 --layers 4 --decode-steps 2 \
> $res/ncu_stalls_64.txt 2>&1; grep -E 'custom_kernel|Duration|Achieved Occupancy|Waves Per SM|Registers Per|Stall|Memory Throughput' \
$res/ncu_stalls_64.txt | head -150"
# MLX builds every custom kernel with NVRTC in every process (it reads its disk cache but never writes custom
# kernels to it); kernel_cache writes them there. Fresh processes' decode profiles with it off and on, each twice on
# one cache folder (the second finds MLX's own kernels, and with it on ours, built).
step 60 300 "cold start: a process's kernel builds with kernel_cache off and on" python3 -m bench.cold_start \
  --model "$model" --json "$res/cold_start.json"
# Correctness before speed: issue 5's perplexity parity on the GPU path (moe_gemm takes the embedded model's 4-bit
# experts at 512 tokens x 8), stock mlx-lm vs lily_mlx on the last 400 docstrings of the bundled corpus, bf16 (as
# stored) and float32. A cold machine needed over 100 s for the bf16 one (run 27).
python3 -c 'import json, pathlib; r = [json.loads(l) for l in pathlib.Path("lily_mlx/assets/corpus/stdlib_docstrings.jsonl").read_text().splitlines()]; pathlib.Path("/tmp/docs.txt").write_text("\n\n".join(x["doc"] for x in r[-400:]))'
for dt in bfloat16 float32; do
  step 60 200 "perplexity, embedded 4-bit, $dt" python3 -m bench.perplexity --model embedded-4bit --text /tmp/docs.txt \
    --context-length 512 --max-tokens 16384 --compare --dtype "$dt" --json "$res/perplexity_$dt.json"
done
# Each kernel alone against MLX's path (or its switch off) at the 35B shapes: new, moe_combine and moe_gemm_staged
# against the default moe_gemm in one process.
step 60 120 "kernel table" python3 -m bench.kernels ${KERNEL_ROWS:+--rows "$KERNEL_ROWS"} --json "$res/kernels.json"
# Issue 4: moe_chain (a MoE block in one launch) on vs off in the decode step, alternating in one process; and the
# same under MLX_MAX_MB_PER_BUFFER raised in a second process. MLX commits its CUDA graph once the inputs of its
# launches pass 1000 "MB" (H100/H200 default; it adds up data_size, elements, not bytes), and each MoE launch lists
# every expert's weights (~126 M elements): by default a decode step commits about every 8 MoE layers.
for mb in "" 1000000; do
  step 60 110 "decode step, moe_chain on vs off${mb:+, MLX_MAX_MB_PER_BUFFER=$mb}" env ${mb:+MLX_MAX_MB_PER_BUFFER=$mb} \
    python3 -m bench.profile_decode --model "$model" --context 64 --steps 16 --no-ops --ab-switch moe_chain \
    --json "$res/decode_ab_moe_chain${mb:+_mb}.json"
done
# The DeltaNet chains, each on vs off with moe_chain on in both arms (107 primitives a step with both on).
for sw in deltanet_chain_out deltanet_chain; do
  step 60 110 "decode step, $sw on vs off (moe_chain on)" env LILY_MLX_ENABLE=moe_chain \
    python3 -m bench.profile_decode --model "$model" --context 64 --steps 16 --no-ops --ab-switch "$sw" \
    --json "$res/decode_ab_$sw.json"
done
# Each quantized weight one kernel input instead of three (ops/packing.py: 724 fewer inputs a default step), with the
# defaults and with every chain; then MLX's dispatch of the step without the GPU's work (stand-in kernels).
step 60 150 "decode step, packed_weights on vs off" python3 -m bench.profile_decode --model "$model" --context 64 4096 \
  --steps 16 --no-ops --ab-switch packed_weights --json "$res/decode_ab_packed_weights.json"
step 60 110 "decode step, packed_weights on vs off (every chain on)" \
  env LILY_MLX_ENABLE=moe_chain,deltanet_chain_out,attn_chain python3 -m bench.profile_decode --model "$model" \
  --context 64 --steps 16 --no-ops --ab-switch packed_weights --json "$res/decode_ab_packed_weights_chains.json"
# A chain launch's constants (weights, norms, DeltaNet params) one input (436 kernel inputs a chained step, not 936);
# again in a second process with MLX's CUDA graph committed by its 100 nodes only, not every ~1000 M input elements
# (about every 9 MoE launches: ~5 commits a chained step instead of 1).
for mb in "" 1000000; do
  step 60 110 "decode step, bundled_weights on vs off (every chain, packed_weights on)${mb:+, MLX_MAX_MB_PER_BUFFER=$mb}" \
    env ${mb:+MLX_MAX_MB_PER_BUFFER=$mb} LILY_MLX_ENABLE=moe_chain,deltanet_chain_out,attn_chain,packed_weights \
    python3 -m bench.profile_decode --model "$model" --context 64 --steps 16 --no-ops --ab-switch bundled_weights \
    --json "$res/decode_ab_bundled${mb:+_mb}.json"
done
step 30 60 "decode step dispatch, kernels as stand-ins" python3 -m bench.step_dispatch --json "$res/step_dispatch.json"
# The K/V writes as a scatter vs MLX's dynamic slice update (whose CUDA grid covers the whole cache).
step 60 150 "decode step, kv_scatter on vs off" python3 -m bench.profile_decode --model "$model" --context 64 4096 \
  --steps 16 --no-ops --ab-switch kv_scatter --json "$res/decode_ab_kv_scatter.json"
# attn_decode with a lane's dims consecutive (16-byte cache loads) vs strided lanes, at a short and a long cache.
step 60 150 "decode step, attn_decode_wide on vs off" python3 -m bench.profile_decode --model "$model" --context 64 4096 \
  --steps 16 --no-ops --ab-switch attn_decode_wide --json "$res/decode_ab_attn_decode_wide.json"
# attn_chain on vs off with the other chains on in both arms (87 primitives a step with all on); context 4096 takes
# its attn_chain_long variant (the cache split in 256, merged by attn_combine's phase).
step 60 150 "decode step, attn_chain on vs off (moe_chain, deltanet_chain_out on)" \
  env LILY_MLX_ENABLE=moe_chain,deltanet_chain_out python3 -m bench.profile_decode --model "$model" --context 64 4096 \
  --steps 16 --no-ops --ab-switch attn_chain --json "$res/decode_ab_attn_chain.json"
# MTP speculative decoding: the compiled verify forward over 2 and 3 tokens against the one-token step (a verify
# launches what a decode step launches; tests/test_speculative.py counts them), on the GPU's timeline (each kernel's
# time at 2-3 rows) and by wall time with its dispatch. The chains take one row and a 2-token verify by default
# (ops.chain_takes): "chains at every row" opts them in for 3 tokens too.
rows_chains=moe_chain,deltanet_chain_out,attn_chain
step 60 150 "MTP verify forward on the GPU's timeline (defaults)" python3 -m bench.gpu_timeline --model "$model" \
  --context 64 4096 --tokens 2 3 --json "$res/timeline_verify.json"
step 60 150 "MTP verify forward on the GPU's timeline (chains at every row)" env LILY_MLX_ENABLE=$rows_chains \
  python3 -m bench.gpu_timeline --model "$model" --context 64 4096 --tokens 2 3 \
  --json "$res/timeline_verify_chains.json"
# The chains' input projections at 2 tokens: rows a lane segment under 12 / (2 x chunks) by default (qmv.plan_chained),
# 3 where they were 4 (deltanet_chain_out spilled 424 bytes a lane at 4 and spent 44 of its 61 us in that phase, H100
# run 87; attn_chain 288 -> 384 blocks). The verify at context 64 with the defaults, the earlier 4 (both; attn_chain's
# alone), attn_chain's 5 (231 blocks, two waves, 12 bytes spilled) and deltanet_chain's 2: "IN_RPS" in ONLY picks them.
for plan in IN_RPS:defaults deltanet_chain.IN_RPS=4,attn_chain.IN_RPS=4 attn_chain.IN_RPS=4 attn_chain.IN_RPS=5 \
    deltanet_chain.IN_RPS=2; do
  step 60 120 "MTP verify forward on the GPU's timeline, $plan" env LILY_MLX_PLAN=${plan#IN_RPS:defaults} \
    python3 -m bench.gpu_timeline --model "$model" --context 64 --tokens 2 \
    --json "$res/timeline_verify_${plan//[.,=:]/_}.json"
done
step 60 170 "inside the chains at 1 and 2 tokens (eager steps)" env LILY_MLX_KERNEL_DEFINES=LILY_CHAIN_TRACE=4096 \
  python3 -m bench.chain_trace --model "$model" --context 64 --tokens 1 2 --steps 2 --json "$res/chain_trace_tokens.json"
step 60 150 "MTP verify step vs decode step (defaults)" python3 -m bench.profile_decode --model "$model" \
  --context 64 4096 --steps 16 --no-ops --verify-tokens 2 3 --json "$res/decode_verify.json"
# MTP end to end at a set acceptance (the random model's head is untrained: bench.mtp swaps in the plain decoder's
# own token after the head has run), against plain greedy decoding in the same process: the defaults (on CUDA the
# GPU decides each draft: mtp_resident, verify_keep), the host's loop with and without verify_keep, and every chain
# at every row; then the GPU's timeline of the defaults' MTP decoding (a step: a verify forward and its draft).
step 60 300 "MTP decoding at acceptance 0 / 0.5 / 0.8 / 1 (defaults, the host's loop, chains at every row)" \
  env LILY_MLX_DISABLE=mtp_resident,verify_keep python3 -m bench.mtp --model "$model" --tokens 128 --accept 0 0.5 0.8 1 --rounds 3 \
  --with mtp_resident verify_keep mtp_resident,$rows_chains --json "$res/mtp.json"
step 60 150 "MTP decoding on the GPU's timeline at acceptance 0.8 and 1 (defaults)" python3 -m bench.gpu_timeline \
  --model "$model" --mtp 0.8 1 --json "$res/timeline_mtp.json"
# Each kernel's GPU time and DRAM bytes in decode steps at context 64 and 4096 (ncu, no launch gaps; the first 8
# layers), the defaults and every chain: run 33 found attn_decode at 255 us a layer at 4096 (33 GB/s); run 36 (H100)
# the chained step's kernels 8% slower than the unchained ones they replace, and both at 0.1-1 TB/s but the lm_head.
# Only the second run's decode steps are profiled (--profile-from-start off), so the DRAM metric's replays stay cheap;
# caches are not flushed between kernels (run 36 flushed them: ~2x a small qmv's time in back-to-back replays).
for cfg in "64:$unchained" "64:" "4096:$unchained" "4096:"; do
  c=${cfg%%:*} disable=${cfg#*:}
  label=${disable:+unchained}
  step 60 100 "ncu kernel times of decode steps, context $c, ${label:=every chain}" bash -c "env ${disable:+LILY_MLX_DISABLE=$disable} \
ncu --profile-from-start off --cache-control none --clock-control none --print-units base --csv --metrics \
gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size \
python3 kernels/scratch/prefill_ncu.py --model $model --tokens $c --layers 8 --decode-steps 4 > /tmp/ncu$c${label// /_}.csv 2>/dev/null; \
python3 kernels/scratch/prefill_ncu.py --summarize /tmp/ncu$c${label// /_}.csv --decode | tee $res/ncu_decode_${c}_${label// /_}.txt"
done
# The defaults end to end by length, each also with one switch flipped (prefill_overlap, moe_route, moe_combine_shared
# and moe_sort off; the opt-in moe_gemm_bounded on), and with dense projections dequantized from 4M weights only
# (before run 20), the MoE block part by part, and the routed experts' paths by rows: one process, so the 20 GB
# model loads once (about 25 s a load), every configuration timed in interleaved rounds; the report is rewritten
# after every length.
step 60 ${PREFILL_CAP:-300} "prefill by length, defaults vs ${PREFILL_VARIANTS:-each switch flipped, 4M dense threshold; sweeps}" \
  python3 -m bench.profile_prefill --model "$model" --tokens ${LENGTHS:-512 2048 8192 16384 65536} --whole-only \
  --headroom ${PREFILL_VARIANTS---ab-switch prefill_overlap moe_gemm_bounded moe_route moe_combine_shared moe_sort --dense-min-weights 4194304 \
  --moe-parts --sweep} \
  --json "$res/prefill_defaults.json"
# Stock mlx-lm and lily in one process (issue 4 and 5's "vs stock in the same run"). Each round records the
# hypervisor's CPU steal: the A/B rows' spread has so far been the VM's (BENCHMARKS.md).
step 100 200 "A/B matrix" python3 -m bench.ab --model "$model" ${AB_ARGS:--p 512 2048 -g 64 -n 3} --arms stock,lily \
  --no-progress --json "$res/ab.json" --markdown "$res/ab.md" --plot "$res/ab.png"
# Where a 2048-token (PARTS_TOKENS) prefill's time goes now, part by part (the next kernel to write for issue 5).
step 60 120 "prefill parts at ${PARTS_TOKENS:-2048} tokens" python3 -m bench.profile_prefill --model "$model" \
  --tokens ${PARTS_TOKENS:-2048} --no-bounded \
  --json "$res/prefill_parts.json"
# The memory bound with the opt-in headroom on top of the default layer bound (<= weights + 3 GB at 8192 tokens).
step 60 150 "prefill at 8192 tokens, headroom capped" python3 -m bench.profile_prefill --model "$model" --tokens 8192 \
  --whole-only --headroom 0.5 1 --json "$res/prefill_capped.json"
# Where the decode step's CPU time goes inside MLX: py-spy (carried in as a wheel: pip download py-spy==0.4.3
# --no-deps -d .ptx-cache) on the warm decode loop only.
for whl in .ptx-cache/py_spy-*.whl; do
  [ -f "$whl" ] && python3 -m pip install -q --no-deps --target /tmp/pyspy "$whl" && export PATH="/tmp/pyspy/bin:$PATH"
done
if command -v py-spy >/dev/null; then
  step 60 150 "native CPU profile of the decode step" python3 -m bench.profile_decode --model "$model" --context 64 \
    --steps 16 --no-ops --py-spy "$res/decode_native.txt.gz" --py-spy-seconds 20 --json "$res/decode_native.json"
fi
# A decode step passes ~2,200 arrays to its ~250 launches: what each input and output costs on the CPU.
step 60 90 "launch cost by arity" python3 -m bench.launch_cost --sweep arity --json "$res/launch_cost.json"
# The server extra's pure-Python wheels where the machine lacks them (pip download --no-deps -d .ptx-cache/wheels
# uvicorn h11 click starlette anyio sniffio prometheus-client), behind what the machine has.
if ! python3 -c "import uvicorn, starlette, prometheus_client" 2>/dev/null && ls .ptx-cache/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --target /tmp/server-deps .ptx-cache/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/server-deps"
fi
# The server switches on against off, alternating, a fresh server per arm and round (batched_prefill is on by default
# on CUDA, batched_attn_decode opt-in).
for arm in lily-no-batched_prefill lily-with-batched_attn_decode; do
  switch=${arm#lily-*-}
  step 150 240 "server at 8 clients, $switch on vs off" python3 -m bench.serve_load --model "$model" \
    --arms "lily,$arm" --rounds 2 --concurrency 8 --requests-per-client 2 --max-tokens 64 \
    --json "$res/serve8_$switch.json"
done
# The engine's decode steps pipelined (server_pipeline: the next step queued before the host reads the last) and not.
for disable in "" server_pipeline; do
  step 120 150 "server at 1 and 8 clients${disable:+, $disable off}" env LILY_MLX_DISABLE="$disable" python3 \
    -m bench.serve_load --model "$model" --concurrency 1,8 ${SERVE_ARGS:---requests-per-client 2 --max-tokens 64} \
    --json "$res/serve_pipeline${disable:+_off}.json"
done
# The same load served by stock mlx-lm's server (its batching generator) and lily's, alternating, 2 rounds each.
step 150 300 "server at 1 and 8 clients against stock mlx-lm's server" python3 -m bench.serve_load --model "$model" \
  --arms lily,stock --rounds 2 --concurrency 1,8 ${SERVE_ARGS:---requests-per-client 2 --max-tokens 64} \
  --json "$res/serve_vs_stock.json"
# With BASELINE=DIR (an older tree: `git archive REV lily_mlx kernels | tar -x -C DIR`; baseline/ is ignored, so carry it), the
# same load from that tree's server and this one's, alternating.
if [ -n "${BASELINE:-}" ]; then
  step 150 300 "server at 1 and 8 clients against the baseline tree" python3 -m bench.serve_load --model "$model" \
    --arms lily,baseline --baseline "$BASELINE" --rounds 2 --concurrency 1,8 \
    ${SERVE_ARGS:---requests-per-client 2 --max-tokens 64} --json "$res/serve_vs_baseline.json"
fi
# The warm-up alone with MLX's kernel cache empty, each piece logged with its time and the kernels it built (ours,
# MLX's): run 92 (H100) took 281 s, 207 of them the prefills of 16-64 tokens (MLX's own kernels). Then with 8 worker
# processes holding 4 layers each running the pieces side by side (--warm-up-workers), each in a fresh cache folder.
for workers in 8 0; do
  step 120 ${COLD_CAP:-300} "server warm-up, cold, piece by piece, $workers workers" env MLX_PTX_CACHE_DIR="$(mktemp -d)" \
    python3 -m lily_mlx.server --model "$model" --warm-up-only --warm-up-workers $workers
done
# A cold start: the server with MLX's kernel cache empty (no prebuilt kernels), its warm-up building every kernel
# before /health (the "ready in" line), then one client: the first request's TTFT is its level's warm_up row.
step 150 420 "server cold start: warm-up, then the first request" env MLX_PTX_CACHE_DIR="$(mktemp -d)" \
  python3 -m bench.serve_load --model "$model" --concurrency 1 --requests-per-client 2 --max-tokens 64 \
  --json "$res/serve_cold.json"
# The server's 8-row decode step on the GPU's timeline, compiled (8 slots taken) and eager (compiled_decode off): 8
# clients decoded 336 tok/s in all (H100 run 89, before the slots), ~55 a sequence, against ~480 for one.
for disable in "" compiled_decode; do
  step 60 120 "the server's 8-row step on the GPU's timeline${disable:+, $disable off}" env LILY_MLX_DISABLE="$disable" \
    python3 -m bench.gpu_timeline --model "$model" --context 64 --batch 8 --json "$res/timeline_batch8${disable:+_eager}.json"
done
# qmv at 8 rows is 3.7 of the 8-slot step's 7.9 ms (run 90): 222-255 registers a lane, one 8-warp block an SM
# (`scripts/cuda_registers.py --decode-step --rows 8`); no RPS / WARPS plan gets past 8 warps an SM. Capped at 128
# registers: 2 blocks, 16 warps (64 bytes spilled, the lm_head's 612); at 168 with 4-warp blocks: 3, 12 warps.
for plan in qmv.MAXREG=128 qmv.MAXREG=168,qmv.WARPS=4; do
  step 60 120 "the server's 8-row step on the GPU's timeline, LILY_MLX_PLAN=$plan" env LILY_MLX_PLAN="$plan" \
    python3 -m bench.gpu_timeline --model "$model" --context 64 --batch 8 --json "$res/timeline_batch8_${plan//[.,=]/_}.json"
done
save_ptx_cache
echo "== done in $(($(date +%s) - start)) s; reports in $out/"
