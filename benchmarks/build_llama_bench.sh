#!/usr/bin/env bash
# Build llama.cpp's llama-bench natively for this CPU, from the sources the llama-cpp-python sdist
# on PyPI vendors (no git clone needed), for benchmarks/cpu_decode.py's peer row.
#   bash benchmarks/build_llama_bench.sh [DIR]      (default DIR: ~/.cache/homelab-llm/llamacpp)
# Then: LLAMA_BENCH=DIR/build/bin/llama-bench python benchmarks/cpu_decode.py
# Needs cmake, a C++ compiler and ~25-40 minutes on 2 cores (it runs under nice).
set -euo pipefail
dir=${1:-$HOME/.cache/homelab-llm/llamacpp}
mkdir -p "$dir/dl" "$dir/build"
cd "$dir"
ls dl/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
    python3 -m pip download --no-deps --no-binary :all: -d dl llama-cpp-python
sdist=$(ls dl/llama_cpp_python-*.tar.gz | tail -1)
src="$dir/$(basename "$sdist" .tar.gz)"
[ -d "$src" ] || tar xzf "$sdist"
cd build
nice -n 10 cmake "$src/vendor/llama.cpp" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build . --target llama-bench -j "$(nproc)"
echo "built: $dir/build/bin/llama-bench"
