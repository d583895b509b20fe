START=$(date +%s); el() { echo "[$(( $(date +%s) - START )) s]"; }
source .device/setup.sh
(python3 -m bench.random_model --out /tmp/r35 2>&1 | tail -1) &
timeout 100 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/test_deltanet_chunk.py 2>&1 | tail -8
wait; el
timeout 80 python3 -m bench.profile_decode --model /tmp/r35 --context 256 --steps 32 --no-ops --ab-switch cuda_source_files --json $OUT/decode_ab.json 2>&1 | grep -v regex; el
LILY_MLX_ENABLE=deltanet_chunk timeout 70 python3 -m bench.profile_prefill --model /tmp/r35 --tokens 2048 --json $OUT/prefill_chunk.json 2>&1 | grep -v regex | head -14; el
