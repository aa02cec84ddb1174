#!/usr/bin/env bash
# Build llama.cpp natively for this CPU from the sources the llama-cpp-python sdist on PyPI
# vendors (no git clone), for benchmarks/cpu_decode.py's peer row:
#   bash benchmarks/build_llama_bench.sh [DIR] [--full]   (default DIR: ~/.cache/homelab-llm/llamacpp)
# Default: libllama + ggml and benchmarks/llama_mini_bench.cpp linked against them (DIR/llama-mini-bench:
# llama-bench's pp/tg tests and JSON fields, ~15-25 minutes on 2 cores). --full: llama.cpp's own
# llama-bench too (DIR/build/bin/llama-bench; its common library roughly doubles the build).
# Then: LLAMA_BENCH=<binary> python benchmarks/cpu_decode.py
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$HOME/.cache/homelab-llm/llamacpp}
full=${2:-}
mkdir -p "$dir/dl" "$dir/build"
cd "$dir"
ls dl/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
    python3 -m pip download --no-deps --no-binary :all: -d dl llama-cpp-python
sdist=$(ls dl/llama_cpp_python-*.tar.gz | tail -1)
src="$dir/$(basename "$sdist" .tar.gz)/vendor/llama.cpp"
[ -d "$src" ] || tar xzf "$sdist"
cd build
nice -n 10 cmake "$src" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build . --target llama -j "$(nproc)"
nice -n 10 g++ -O2 -std=c++17 -I"$src/include" -I"$src/ggml/include" "$here/llama_mini_bench.cpp" \
    -o "$dir/llama-mini-bench" src/libllama.a ggml/src/libggml.a ggml/src/libggml-cpu.a \
    ggml/src/libggml-base.a -fopenmp -lpthread -ldl
echo "built: $dir/llama-mini-bench"
if [ "$full" = "--full" ]; then
    nice -n 10 cmake --build . --target llama-bench -j "$(nproc)"
    echo "built: $dir/build/bin/llama-bench"
fi
