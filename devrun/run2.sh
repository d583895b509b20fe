set -x
START=$(date +%s); left() { echo $(( 585 - ($(date +%s) - START) )); }
source .device/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
(python3 -m bench.random_model --out /tmp/r35 2>&1 | tail -1) &
(time timeout 200 python3 -m pytest -q -m cuda -n 8 -p no:cacheprovider --ignore=tests/test_notebooks.py 2>&1 | tail -25) 2>&1
wait
timeout 100 python3 -m bench.profile_decode --model /tmp/r35 --context 256 4096 --no-ops --json $OUT/decode_files.json 2>&1 | grep -v regex
LILY_MLX_DISABLE=cuda_source_files timeout 60 python3 -m bench.profile_decode --model /tmp/r35 --context 256 --no-ops 2>&1 | grep -v regex
timeout 100 python3 -m bench.profile_prefill --model /tmp/r35 --tokens 2048 --json $OUT/prefill.json 2>&1 | grep -v regex
timeout $(( $(left) - 100 )) python3 -m bench.ab --model /tmp/r35 -p 256 4096 -g 128 -n 3 --arms stock,lily --json $OUT/ab.json --markdown $OUT/ab.md --no-progress 2>&1 | tail -20
timeout $(( $(left) - 5 )) python3 bench/serve_load.py --model /tmp/r35 --concurrency 1,8,32 --requests-per-client 2 --max-tokens 64 --json $OUT/serve.json 2>&1 | tail -15
