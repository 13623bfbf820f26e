#!/usr/bin/env bash
# Creates .venv in the repository and installs cbatch (editable) with its test extras.
#
# llama-cpp-python is compiled from source. The build is native (-DGGML_NATIVE=ON) but
# with AMX code generation switched off: some virtual machines advertise AMX in cpuid
# yet trap its instructions, and ggml's AMX kernels then die with SIGILL/SIGSEGV.
# Set CBATCH_ALLOW_AMX=1 on a CPU whose OS really lets you use AMX to keep it.
# Set CBATCH_GPU=cuda to build with CUDA instead (needs nvcc; ggml's CPU code is then
# built generic, not native); CBATCH_CUDA_ARCHS picks the GPU architectures, e.g. 90
# (default: those of the GPUs in this machine). Another backend: CBATCH_GPU=NAME with the
# backend's CMAKE_ARGS, e.g. CBATCH_GPU=vulkan CMAKE_ARGS="-DGGML_VULKAN=ON".
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip

no_amx_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [ "${CBATCH_GPU:-}" = "cuda" ]; then
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=ON -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=${CBATCH_CUDA_ARCHS:-native}}"
else
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
fi
llama_pin="$(python -c 'import re,sys; print(re.search(r"\"(llama-cpp-python==[^\"]+)\"", open("pyproject.toml").read()).group(1))')"
if [ "${CBATCH_ALLOW_AMX:-0}" != "1" ]; then
    export CFLAGS="${CFLAGS:-} $no_amx_flags" CXXFLAGS="${CXXFLAGS:-} $no_amx_flags"
fi
if [ "${CBATCH_ALLOW_AMX:-0}" = "1" ] || [ -n "${CBATCH_GPU:-}" ]; then
    # pip's wheel cache does not key on compiler flags: rebuild instead of reusing the
    # cached AMX-free CPU wheel, and keep this build out of the cache.
    python -m pip install --no-cache-dir --force-reinstall --no-deps "$llama_pin"
fi
python -m pip install --quiet -e ".[test]"
python -c "import llama_cpp, cbatch; print('cbatch ready: llama-cpp-python', llama_cpp.__version__)"
