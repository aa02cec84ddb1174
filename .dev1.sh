python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc
timeout 90 python3 benchmarks/kernels_selftest.py -k kdot 2>&1 | tail -4
timeout 290 python3 benchmarks/w4a16_sweep.py --model 27b --m 1,2,5,8,16,40 --only 'h2,dot,kdot*' --jobs 15 > $OUT/sweep27.txt 2>&1
grep -v "^\[" $OUT/sweep27.txt | tail -20
timeout 100 python3 benchmarks/w4a16_sweep.py --model 8b --m 1,8 --only 'h2,dot,kdot*' --jobs 15 > $OUT/sweep8.txt 2>&1
grep -v "^\[" $OUT/sweep8.txt | tail -12
timeout 90 python3 benchmarks/moe_gpu.py --sections prefill 2>&1 | tail -12
