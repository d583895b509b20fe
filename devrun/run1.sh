set -x
source .device/setup.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
python3 -m bench.launch_cost --json $OUT/launch_cost.json 2>&1 | tail -30
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 8"
(time python3 -m pytest -q -m cuda $N -p no:cacheprovider -x 2>&1 | tail -15) 2>&1
python3 -m bench.random_model --out /tmp/r35 2>&1 | tail -2
python3 -m bench.profile_decode --model /tmp/r35 --context 256 4096 --json $OUT/profile.json 2>&1 | tail -30
python3 -m bench.profile_prefill --model /tmp/r35 --tokens 512 2048 --json $OUT/prefill.json 2>&1 | tail -24
