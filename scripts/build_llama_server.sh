#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` from the llama.cpp source vendored in the pinned
# llama-cpp-python sdist, for side-by-side figures (scripts/bench.py long_prompts finds it
# at build/llama-server/bin/llama-server). Same AMX rule as scripts/setup.sh. ~10 minutes
# on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

out="build/llama-server"
pin="$(python3 -c 'import re; print(re.search(r"\"llama-cpp-python==([^\"]+)\"", open("pyproject.toml").read()).group(1))')"
mkdir -p "$out/src"
if [ ! -d "$out/src/llama_cpp_python-$pin" ]; then
    echo "fetching the llama-cpp-python $pin sdist" >&2
    python3 -m pip download --quiet --no-binary :all: --no-deps -d "$out/src" "llama-cpp-python==$pin"
    tar -xzf "$out/src/llama_cpp_python-$pin.tar.gz" -C "$out/src"
fi
flags=""
[ "${CBATCH_ALLOW_AMX:-0}" = "1" ] || flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
echo "building llama-server (about 10 minutes on 2 cores)" >&2
cmake -S "$out/src/llama_cpp_python-$pin/vendor/llama.cpp" -B "$out/cmake" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" ${CMAKE_ARGS:-} > "$out/cmake.log"
cmake --build "$out/cmake" --target llama-server -j "$(nproc)" > "$out/build.log"
mkdir -p "$out/bin"
cp "$out/cmake/bin/llama-server" "$out/bin/"
echo "built $out/bin/llama-server" >&2
