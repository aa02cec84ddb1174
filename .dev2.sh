python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc
timeout 120 python3 benchmarks/kernels_selftest.py -k fused_moe 2>&1 | tail -4
timeout 150 python3 benchmarks/moe_gpu.py --sections prefill 2>&1 | tail -12
timeout 200 python3 benchmarks/moe_gpu.py --sections sweep > $OUT/moesweep.txt 2>&1; grep "t2048" $OUT/moesweep.txt | grep "\.ms" | sort -k2 -g | head -30
timeout 100 python3 benchmarks/w4a16_sweep.py --model 27b --m 1,2 --only 'h2,h2.s*,h2.c*,dot' --jobs 15 > $OUT/h2split.txt 2>&1; grep -v "^\[" $OUT/h2split.txt | grep "TP=1"
