"""The in-process benchmark scripts still run against the code they measure.

They import engine internals (the runner, sequences, the worker's publisher), so a change
there can break a script that no other test runs. Each runs here on the tiny model with
the smallest workload its options allow, and must print a full row of figures. Nothing
here is timed: the figures themselves are read by people, from the README's commands.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

RUN_TIMEOUT_S = 300
NUMBER = r"\d+(?:\.\d+)?"


def run_script(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), name, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_bench_decode_step_prints_a_row_per_level(tiny_model_path):
    out = run_script("decode_step", "--model", tiny_model_path, "--parallel", "1", "2")
    rows = [line.split() for line in out.splitlines() if re.fullmatch(rf"\s*\d+(\s+{NUMBER}){{3}}\s*", line)]
    assert [row[0] for row in rows] == ["1", "2"]


@pytest.mark.slow
def test_bench_engine_prints_in_turn_and_batched_rows(tiny_model_path):
    out = run_script("engine", "--model", tiny_model_path, "--parallel", "2", "--prompt-tokens", "16",
                     "--max-tokens", "4", "--modes", "greedy")
    assert re.search(rf"^greedy\s+in turn\s+\d+\s+{NUMBER}", out, re.M), out
    assert re.search(rf"^greedy\s+2\s+\d+\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}", out, re.M), out


@pytest.mark.parametrize("backend", ["off", "on"])
@pytest.mark.slow
def test_bench_host_work_prints_every_phase(tmp_path, backend):
    out = run_script("host_work", "--vocab", "1024", "--model", str(tmp_path / "stand-in.gguf"),
                     "--parallel", "2", "--steps", "2", "--modes", "greedy", "sampled",
                     "--backend-sampling", backend, "--clock", "thread" if backend == "on" else "wall")
    rows = re.findall(rf"^(greedy|sampled)\s+2\s+{backend}((?:\s+{NUMBER}){{8}})\s*$", out, re.M)
    assert [mode for mode, _ in rows] == ["greedy", "sampled"], out


@pytest.mark.slow
def test_bench_logprobs_prints_each_top_count_and_the_engine_ratio(tiny_model_path):
    out = run_script("logprobs", "--vocab", "1000", "--calls", "3", "--model", tiny_model_path,
                     "--parallel", "2", "--max-tokens", "4", "--rounds", "1")
    assert [int(k) for k in re.findall(rf"^logprobs=(\d+)\s+{NUMBER} ms per token", out, re.M)] == [0, 1, 5, 20]
    assert re.search(rf"^\s+with/without: {NUMBER}$", out, re.M), out


@pytest.mark.slow
def test_bench_serving_prints_every_path_with_its_cpu_per_token(tiny_model_path):
    out = run_script("serving", "--model", tiny_model_path, "--parallel", "2", "--clients", "2",
                     "--requests", "4", "--max-tokens", "2", "--threads", "1")
    # Without llama-server: no ratio, and six CPU columns (caller, front-end, HTTP processes,
    # worker main thread, llama_decode wall, worker other threads) but the server's.
    paths = re.findall(rf"^(\S.*?)\s+({NUMBER})\s+-((?:\s+{NUMBER}){{6}})\s*$", out, re.M)
    assert [name for name, _, _ in paths] == [
        "one Client, generate_batch", "2 threads, a Client each", "AsyncClient, 2 coroutines",
        "cbatch HTTP whole", "cbatch HTTP streamed", "cbatch HTTP whole, new conn"], out
    assert all(float(tok_s) > 0 for _, tok_s, _ in paths), out
    assert all(float(cells.split()[0]) > 0 for _, _, cells in paths), out  # every caller spent some CPU
    assert re.search(rf"note: cbatch HTTP streamed: TTFT p50 {NUMBER} ms", out), out
    steps = re.findall(rf"note: (.+?): worker (\d+) steps, {NUMBER} tokens a step, ({NUMBER}) ms a step: "
                       rf"({NUMBER}) in llama_decode, (-?{NUMBER}) host$", out, re.M)
    assert [name for name, *_ in steps] == [name for name, _, _ in paths], out
    assert all(int(num_steps) > 0 and float(step_ms) >= float(decode_ms) for _, num_steps, step_ms, decode_ms, _
               in steps), out


@pytest.mark.slow
def test_bench_async_client_prints_its_cpu_per_request(tiny_model_path):
    out = run_script("async_client", "--model", tiny_model_path, "--requests", "64", "--max-tokens", "1", "2")
    rows = re.findall(rf"^max_tokens +(\d+): +({NUMBER}) us CPU a request, +({NUMBER}) a token, +(\d+) requests/s$",
                      out, re.M)
    assert [int(max_tokens) for max_tokens, *_ in rows] == [1, 2], out
    assert all(float(per_request) > 0 and int(per_s) > 0 for _, per_request, _, per_s in rows), out


@pytest.mark.slow
def test_bench_priorities_prints_each_phase_and_the_verdict(tiny_model_path):
    """Interactive probes beside a running batch file: the script needs the batch file to
    fill every slot and keep a queue, and ends it when the probes are done."""
    out = run_script("priorities", "--model", tiny_model_path, "--parallel", "2", "--lines", "200",
                     "--batch-tokens", "16", "--max-in-flight", "8", "--probes", "5", "--batch-probes", "2")
    phases = re.findall(rf"^(idle daemon|beside the batch file, interactive|beside the batch file, as batch|"
                        rf"beside it, less the slot wait)\s+-?{NUMBER}\s+-?{NUMBER}$", out, re.M)
    assert len(phases) == 4, out
    assert re.search(r"still queued at the end: True", out), out
    assert re.search(r"^target: .*, (met|missed)$", out, re.M), out


@pytest.mark.slow
def test_bench_preempt_prints_both_settings_idle_and_loaded(tiny_model_path):
    """Probes beside batch streams that hold every slot, with preemption on, then off."""
    out = run_script("preempt", "--model", tiny_model_path, "--parallel", "1", "--probes", "3",
                     "--batch-tokens", "24")
    rows = re.findall(rf"^(on|off)\s+(idle|beside batch load)\s+{NUMBER}\s+{NUMBER}(?:\s+{NUMBER}\s+(\d+))?$",
                      out, re.M)
    assert [row[:2] for row in rows] == [("on", "idle"), ("on", "beside batch load"), ("off", "idle"),
                                         ("off", "beside batch load")], out
    assert int(rows[1][2]) >= 1 and rows[3][2] == "0", out  # probes preempted the batch stream, then none did
    assert re.search(r"^CPU: .+, \d+ usable of \d+ CPUs", out, re.M), out


@pytest.mark.slow
def test_bench_embeddings_prints_each_path_and_the_stream_gaps(tiny_model_path):
    out = run_script("embeddings", "--model", tiny_model_path, "--clients", "1", "--requests", "2",
                     "--batch-sizes", "1", "4", "--parallel", "2", "--max-tokens", "8")
    rows = re.findall(rf"^(cbatch HTTP|cbatch Client)\s+{NUMBER}\s+-\s+{NUMBER}\s+-$", out, re.M)
    assert rows == ["cbatch HTTP", "cbatch Client"], out
    assert re.search(rf"^cbatch: token gap of a 8-token stream: worst {NUMBER} ms .* alone; worst {NUMBER} ms "
                     r".* beside 1 callers embedding batches of 4$", out, re.M), out


@pytest.mark.slow
def test_bench_http_cpu_prints_both_parsers_and_their_ratio(tiny_model_path):
    out = run_script("http_cpu", "--model", tiny_model_path, "--requests", "8", "--callers", "2", "--rounds", "1")
    for parser in ("httptools", "h11"):
        assert re.search(rf"round 1\s+{parser}: +{NUMBER} req/s, HTTP process {NUMBER} ms CPU/request", out), out
    # Eight requests can take under one clock tick of the faster parser's CPU: then the ratio says so.
    assert re.search(rf"h11 / httptools = ({NUMBER}x|not measured \(httptools used under one clock tick)", out), out


@pytest.mark.slow
def test_bench_fair_share_prints_both_settings(tiny_model_path):
    """A light tenant beside a heavy one's backlog, fair share on and then off."""
    out = run_script("fair_share", "--model", tiny_model_path, "--parallel", "2", "--light-clients", "1",
                     "--heavy-factor", "3", "--light-requests", "4", "--max-tokens", "8")
    rows = re.findall(rf"^fair share (on |off): generated tokens heavy ({NUMBER})%, light ({NUMBER})% .+ light TTFT "
                      rf"p50 {NUMBER} ms, p99 {NUMBER} ms; load generators {NUMBER} CPU s", out, re.M)
    assert [row[0] for row in rows] == ["on ", "off"], out
    assert all(abs(float(heavy) + float(light) - 100) < 0.2 for _, heavy, light in rows), out


@pytest.mark.slow
def test_bench_jobs_prints_every_figure(tiny_model_path):
    out = run_script("jobs", "--model", tiny_model_path, "--parallel", "2", "--lines", "10", "--max-tokens", "4",
                     "--ttft-probes", "6", "--ttft-callers", "2", "--rss-lines", "30", "--kill-lines", "600")
    assert re.search(rf"job / submit {NUMBER}x; caller CPU per line: cbatch-submit {NUMBER} ms, job runner {NUMBER} ms",
                     out), out
    assert re.search(rf"from 2 callers: idle p50 {NUMBER} ms.*; beside a running job p50 {NUMBER} ms.*"
                     rf"\(the job was \w+, \d+ lines done\); p99 beside / idle {NUMBER}x", out), out
    assert re.search(rf"memory, 30 lines of 1 token in 1 jobs: 30 completed .* {NUMBER} MB above idle", out), out
    assert re.search(rf"the first new line {NUMBER} s after the start .* the job then completed with 600 lines",
                     out), out


@pytest.mark.slow
def test_bench_structured_prints_the_row_costs_compile_times_and_each_mode(tiny_model_path):
    out = run_script("structured", "--model", tiny_model_path, "--parallel", "2", "--n", "1", "2",
                     "--rounds", "1", "--max-tokens", "8", "--calls", "3", "--compile-delay", "--probes", "2")
    assert re.search(rf"^one row: llama.cpp GBNF sampler {NUMBER} ms \| llguidance check {NUMBER} ms, mask {NUMBER} ms",
                     out, re.M), out
    assert re.search(rf"^compile: 2\d\d schemas, p50 {NUMBER} ms, p99 {NUMBER} ms", out, re.M), out
    modes = re.findall(rf"^\s+2\s+([12]) (json_schema|json_object|tool call|think\+schema)\s+\d+\s+{NUMBER}\s+"
                       rf"{NUMBER}\s+{NUMBER}x .* (\d+)/(\d+)\s+{NUMBER}\s+{NUMBER}$", out, re.M)
    assert [(n, mode) for n, mode, *_ in modes] == [(n, mode) for n in "12" for mode in
                                                    ("json_schema", "json_object", "tool call", "think+schema")], out
    assert all(int(valid) <= int(stopped) <= 2 for *_, valid, stopped in modes), out
    assert re.search(rf"^compile delay: 1\d\d KB schema answered in \d+ ms .* {NUMBER} ms alone, {NUMBER} ms behind it",
                     out, re.M), out


@pytest.mark.slow
def test_gpu_compare_rehearsal_runs_every_stage_and_skips_what_the_budget_cannot_hold(tiny_model_path, tmp_path):
    """The GPU comparison's CPU rehearsal: no build, every measuring stage run once on the tiny model, the
    table and summary written to $OUT; then a budget too short for any measuring stage skips each with a note."""
    def rehearse(out, budget_s):
        done = subprocess.run([str(REPO / "scripts" / "gpu_compare.sh"), "rehearse", "--model", tiny_model_path,
                               "--parallel", "2", "--clients", "2", "--requests", "4", "--max-tokens", "2",
                               "--steps", "2", "--threads", "1", "--budget-s", str(budget_s)], cwd=REPO,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={**os.environ, "OUT": str(out), "STAGE_DIR": str(tmp_path / "no-stage")})
        assert done.returncode == 0, f"gpu_compare failed:\n{done.stdout}\n{done.stderr}"
        return {row[0]: row[1] for row in re.findall(r"^(\S+(?: \d+)?)\s+(ok|skipped|failed \(\d+\)|out of time)\s",
                                                      done.stdout, re.M)}

    stages = rehearse(tmp_path / "out", 240)
    assert stages == {"versions": "ok", "build": "skipped", "llama-server": "skipped", "serving 2": "ok",
                      "host-work": "ok", "long": "ok"}, stages
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert re.search(rf"cbatch HTTP whole {NUMBER} tok/s", summary["stages"]["serving 2"]["figures"]), summary
    assert re.search(r"TTFT p50 .+ host .+ ms a step", summary["stages"]["serving 2"]["figures"]), summary
    assert summary["versions"]["cbatch"] and (tmp_path / "out" / "table.txt").exists()
    short = rehearse(tmp_path / "short", 5)
    assert [short[name] for name in ("serving 2", "host-work", "long")] == ["skipped"] * 3, short


def test_bench_images_prints_each_load_and_the_shared_image_encoded_once(tiny_tools_model_path, tiny_projector_path):
    out = run_script("images", "--model", tiny_tools_model_path, "--mmproj", tiny_projector_path,
                     "--parallel", "4", "--streams", "1", "--max-tokens", "24", "--image-callers", "1")
    for load in ("alone", "beside 1 callers sending text", "beside 1 callers sending images"):
        assert re.search(rf"^text streams {load}: token gap median {NUMBER} ms", out, re.M), out
    assert re.search(rf"^8 concurrent requests, one same new image: {NUMBER} ms, 1 encoder runs$", out, re.M), out
    assert re.search(rf"^8 concurrent requests, 8 new images: {NUMBER} ms, 8 encoder runs$", out, re.M), out


def test_bench_request_path_prints_both_sides_of_every_body():
    out = run_script("request_path", "--repeat", "20", "--rounds", "1")
    rows = re.findall(rf"^ *([A-Za-z0-9 ,]+?) +({NUMBER}) +({NUMBER})$", out, re.M)
    assert [name for name, *_ in rows] == ["short prompt", "chat, 4 messages", "every parameter", "64 KiB prompt"], out
    assert all(float(front_us) > 0 for _, front_us, _ in rows), out


@pytest.mark.slow
def test_bench_conversations_prints_every_figure_and_the_restart(tiny_model_path):
    """llama-server is left out: a checkout need not have built it."""
    out = run_script("conversations", "--model", tiny_model_path, "--conversations", "3", "--turns", "2",
                     "--parallel", "1", "--system-tokens", "20", "--history-tokens", "60", "--answer-tokens", "4",
                     "--configs", "cbatch,cbatch-no-tier", "--restart", "1")
    rows = {name: line for name in ("cbatch ", "cbatch-no-tier") for line in out.splitlines()
            if line.strip().startswith(name)}
    for line in rows.values():
        assert re.search(rf"wall +{NUMBER} s .*TTFT median +{NUMBER} s, p99 +{NUMBER} s .*RSS {NUMBER} MB .*"
                         rf"callers' CPU {NUMBER} s", line), line
    assert re.search(r"'host hits': [1-9]", rows["cbatch "]) and "'host bytes'" not in rows["cbatch-no-tier"]
    assert re.search(rf"restart after turn 1: turn 2 TTFT median cold {NUMBER} s, from --cache-dir {NUMBER} s", out)


@pytest.mark.slow
def test_bench_state_moves_prints_the_steps_with_and_without_a_move(tiny_model_path):
    out = run_script("state_moves", "--model", tiny_model_path, "--streams", "2", "--slots", "1",
                     "--conversations", "3", "--turns", "2", "--history-words", "40", "--ctx-per-seq", "512")
    assert re.search(rf"with prompt tokens: .*a state moved \d+ steps, median {NUMBER} ms", out), out
    assert re.search(rf"saves: \d+, median {NUMBER} ms.*restores: \d+, median {NUMBER} ms", out, re.S), out


@pytest.mark.slow
def test_bench_busy_host_prints_each_setting_on_a_busy_and_a_quiet_host(tiny_model_path):
    out = run_script("busy_host", "--model", tiny_model_path, "--requests", "4", "--max-tokens", "16")
    for host in ("busy", "quiet"):
        for name in ("default", "-t 1", r"-t \d+"):
            assert re.search(rf"^{host} host, {name}: {NUMBER} s for 4 x 16 tokens, ending on \d+ compute threads",
                             out, re.M), out
        assert re.search(rf"^{host} host \(\d+ busy loops beside the daemon\): default / best fixed -t {NUMBER}x",
                         out, re.M), out
    assert re.search(rf"^client CPU: {NUMBER} s$", out, re.M), out


@pytest.mark.slow
def test_bench_stalled_readers_prints_the_idle_figure_and_both_kinds_of_stalled_readers(tiny_model_path):
    out = run_script("stalled_readers", "--model", tiny_model_path, "--parallel", "2", "--park-after", "1",
                     "--probes", "2")
    assert re.search(rf"^idle: time to first token median {NUMBER} ms, max {NUMBER} ms \(2 probes\)", out, re.M), out
    for name in ("zmq", "sse"):
        assert re.search(rf"^{name}: 2 stalled readers, time to first token first {NUMBER} s, median {NUMBER} ms, "
                         rf"max {NUMBER} s; [1-9]\d* parks; stalled streams whole once read: True; "
                         rf"target (met|missed)$", out, re.M), out
    assert re.search(rf"^CPU: the script used {NUMBER} s$", out, re.M), out


def test_the_entry_lists_every_bench_and_writes_a_json_line_a_run(tmp_path):
    listing = subprocess.run([sys.executable, "scripts/bench.py"], cwd=REPO, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S).stdout
    named = {line.split()[0] for line in listing.splitlines() if line.startswith("  ")}
    assert {path.stem for path in (REPO / "scripts" / "benches").glob("*.py")} - named == {
        "__init__", "callers", "loadgen", "peers", "proc_cpu", "schema_suite"}
    runs = tmp_path / "runs.jsonl"
    out = run_script("--json", str(runs), "request_path", "--repeat", "5", "--rounds", "1")
    (record,) = [json.loads(line) for line in runs.read_text().splitlines()]
    assert record["bench"] == "request_path" and record["argv"] == ["--repeat", "5", "--rounds", "1"]
    assert len(record["commit"]) == 12 and record["machine"]["cores"] >= 1 and record["machine"]["memory_gib"] > 0
    assert record["cpu_self_s"] > 0 and record["wall_s"] > 0 and record["output"] == out.splitlines()
    unknown = subprocess.run([sys.executable, "scripts/bench.py", "nope"], cwd=REPO, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert unknown.returncode != 0 and "no bench named 'nope'" in unknown.stderr
