#!/usr/bin/env bash
# The GPU session's checks in priority order, each under a time limit, so one short lease yields the most:
# the cuda-marked tests, then the measurements BENCHMARKS.md still lacks. Run from the repository root on an
# NVIDIA machine with MLX's CUDA build importable (the server step needs the `server` extra); reports go
# to ${OUT:-gpu-results}/.
#   bash scripts/gpu_checks.sh [seconds available, default 560]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=${1:-560}
out=${OUT:-gpu-results}
mkdir -p "$out"
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
step() {  # step NEED CAP NAME COMMAND...: runs when NEED seconds are left, for at most CAP of them (0: all left)
  local need=$1 cap=$2 name=$3 limit
  shift 3
  if [ "$(left)" -lt "$need" ]; then echo "== $name: skipped, $(left) s left"; return; fi
  limit=$(left)
  if [ "$cap" -gt 0 ] && [ "$cap" -lt "$limit" ]; then limit=$cap; fi
  echo "== $name ($(left) s left, limit $limit s)"
  timeout "$limit" "$@" 2>&1 | grep -v "incorrect regex pattern"
}
model=${MODEL:-/tmp/r35}
[ -f "$model/config.json" ] || (python3 -m bench.random_model --out "$model" | tail -1) &
step 150 200 "cuda tests" python3 -m pytest -q -m cuda -n 12 -p no:cacheprovider --ignore=tests/test_notebooks.py
wait
step 60 80 "decode step, stacked_kv on vs off" python3 -m bench.profile_decode --model "$model" --context 256 4096 \
  --no-ops --ab-switch stacked_kv --json "$out/decode_ab.json"
step 60 70 "decode step, cuda_source_files on vs off" python3 -m bench.profile_decode --model "$model" --context 256 \
  --no-ops --ab-switch cuda_source_files --json "$out/decode_ab_source_files.json"
# MLX's CUDA backend records kernels into CUDA graphs (at most 100 per graph on sm_90); a CPU-bound step may do
# better with one graph per step or with plain launches. Each setting is read once per process.
for graphs in "MLX_MAX_OPS_PER_BUFFER=400" "MLX_USE_CUDA_GRAPHS=0"; do
  step 50 60 "decode step with $graphs" env "$graphs" python3 -m bench.profile_decode --model "$model" --context 256 \
    --no-ops --json "$out/decode_${graphs%%=*}.json"
done
step 60 90 "prefill, dequant v2 flipped" python3 -m bench.profile_prefill --model "$model" --tokens 2048 \
  --ab-switch dequant --json "$out/prefill.json"
# 512 decoded tokens a round: longer rounds average out more of the VM's CPU-speed drift (the 3% rule).
step 100 170 "A/B matrix" python3 -m bench.ab --model "$model" -p 512 2048 -g 512 -n 3 --arms stock,lily \
  --no-progress --json "$out/ab.json" --markdown "$out/ab.md" --plot "$out/ab.png"
step 60 120 "kernel table" python3 -m bench.kernels --json "$out/kernels.json"
for enable in "" "batched_attn_decode"; do
  step 120 150 "server at 8 clients${enable:+, $enable}" env LILY_MLX_ENABLE="$enable" python3 bench/serve_load.py \
    --model "$model" --concurrency 8 --requests-per-client 2 --max-tokens 64 --json "$out/serve8${enable:+_$enable}.json"
done
step 60 0 "prefill at 65,536 tokens" python3 -m bench.profile_prefill --model "$model" --tokens 65536 --whole-only \
  --json "$out/prefill_long.json"
echo "== done in $(($(date +%s) - start)) s; reports in $out/"
