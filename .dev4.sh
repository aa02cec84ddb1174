python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc
timeout 150 python3 benchmarks/kernels_selftest.py -k "fused_moe" > $OUT/moetest.txt 2>&1; grep -v "^PASS" $OUT/moetest.txt | grep -B2 -A3 "FAIL\|Error" | head -40; tail -1 $OUT/moetest.txt
timeout 250 python3 benchmarks/spec_gpu.py --sections verify --quick > $OUT/verify.txt 2>&1; grep "Qwen\|27B" $OUT/verify.txt | grep "step_ms\|ratio" | head -30
