#!/usr/bin/env bash
# The main job on the chat model SmolLM2-135M-Instruct (a test extra, installed by
# setup.sh): start cbatch-worker, wait until it is ready, run cbatch-submit over the chat
# requests of scripts/demo_chat.jsonl (decoded together), print the answers, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/cbatch-worker ] || ./scripts/setup.sh

model="$(.venv/bin/python -m cbatch.model smollm2)"  # says what to install when it is missing
workdir="$(mktemp -d)"
export CBATCH_ENDPOINT="ipc://$workdir/cbatch.sock"
.venv/bin/cbatch-worker --model "$model" --parallel 4 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon; rm -rf "$workdir"' EXIT

for _ in $(seq 600); do  # the model's load
    [ -S "$workdir/cbatch.sock" ] && break
    kill -0 $daemon 2>/dev/null || { echo "cbatch-worker exited" >&2; exit 1; }
    sleep 0.5
done
# cbatch-submit exits 1 when a line failed: the example has one bad line on purpose.
.venv/bin/cbatch-submit scripts/demo_chat.jsonl -o "$workdir/results.jsonl" || [ $? -eq 1 ]
.venv/bin/python - "$workdir/results.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "error" in r:
        print(f"[{r['id']}] error {r['error']['code']}: {r['error']['message']}\n")
    else:
        n = r['usage']['completion_tokens']
        print(f"[{r['id']}] ({r['finish_reason']}, {n} token{'' if n == 1 else 's'})\n{r['text'].strip()}\n")
PY
