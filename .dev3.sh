python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 benchmarks/kernels_selftest.py -k "fused_moe" 2>&1 | grep -v "^PASS" | tail -4
timeout 60 python3 benchmarks/kernels_selftest.py -k "w4a16_h2" 2>&1 | grep -v "^PASS" | tail -3
timeout 90 python3 benchmarks/w4a16_sweep.py --model 8b --m 1,2 --only 'h2,h2.c4k8s3,dot' --jobs 15 > $OUT/sweep8.txt 2>&1; grep "M= 2 \|TP=1" $OUT/sweep8.txt | cut -c1-220
timeout 200 python3 benchmarks/spec_gpu.py --sections verify --quick 2>&1 | tail -22
timeout 100 python3 benchmarks/w4a16_regress.py 2>&1 | tail -6
