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
from conftest import REPO, load_script

RUN_TIMEOUT_S = 300
NUMBER = r"\d+(?:\.\d+)?"


def run_script(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), name, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_bench(tmp_path, name: str, *args: str) -> dict:
    """One run through the entry, read back from its JSON line: `tables` (each a title,
    column names and rows of numbers), `notes` (lines of prose) and the printed `output`."""
    runs = tmp_path / f"{name}.jsonl"
    run_script("--json", str(runs), name, *args)
    (record,) = [json.loads(line) for line in runs.read_text().splitlines()]
    return record


def table(record: dict, title: str) -> dict:
    """The one table of the run whose title begins with `title`."""
    (found,) = [table for table in record["tables"] if table["title"].startswith(title)]
    return found


@pytest.mark.slow
def test_bench_decode_step_prints_a_row_per_level(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "decode_step", "--model", tiny_model_path, "--parallel", "1", "2")
    rows = table(record, "Bare llama_decode")["rows"]
    assert [row[0] for row in rows] == [1, 2], record["output"]
    assert all(figure > 0 for row in rows for figure in row[1:]), record["output"]


@pytest.mark.slow
def test_bench_engine_prints_in_turn_and_batched_rows(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "engine", "--model", tiny_model_path, "--parallel", "2", "--prompt-tokens", "16",
                       "--max-tokens", "4", "--modes", "greedy")
    in_turn, batched = table(record, "Generated tokens/s")["rows"]
    assert in_turn[:2] == ["greedy", "in turn"] and in_turn[2] > 0 and in_turn[3] > 0, record["output"]
    assert in_turn[4:] == [None, 1.0], record["output"]
    assert batched[:2] == ["greedy", 2] and all(figure > 0 for figure in batched[2:]), record["output"]


@pytest.mark.parametrize("backend", ["off", "on"])
@pytest.mark.slow
def test_bench_host_work_prints_every_phase(tmp_path, backend):
    record = run_bench(tmp_path, "host_work", "--vocab", "1024", "--model", str(tmp_path / "stand-in.gguf"),
                       "--parallel", "2", "--steps", "2", "--modes", "greedy", "sampled",
                       "--backend-sampling", backend, "--clock", "thread" if backend == "on" else "wall")
    phases = table(record, "ms per decode step")
    assert phases["columns"] == ["mode", "seqs", "backend", "schedule+fill ms", "logits ms", "sample ms", "text ms",
                                 "publish ms", "host total ms", "llama_decode ms", "step ms"]
    assert [row[:3] for row in phases["rows"]] == [["greedy", 2, backend], ["sampled", 2, backend]], record["output"]
    assert all(ms >= 0 for row in phases["rows"] for ms in row[3:]), record["output"]


@pytest.mark.slow
def test_bench_logprobs_prints_each_top_count_and_the_engine_ratio(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "logprobs", "--vocab", "1000", "--calls", "3", "--model", tiny_model_path,
                       "--parallel", "2", "--max-tokens", "4", "--rounds", "1")
    computation = table(record, "One logit row")["rows"]
    assert [row[0] for row in computation] == ["argmax", "logprobs=0", "logprobs=1", "logprobs=5", "logprobs=20"]
    assert all(ms > 0 for _, ms, _ in computation), record["output"]
    engine = table(record, "Engine")["rows"]
    assert [row[:2] for row in engine] == [["without", None], ["with", 5]], record["output"]
    assert all(tok_s > 0 and step_ms > 0 for *_, tok_s, step_ms in engine), record["output"]
    assert re.fullmatch(rf"engine tok/s with/without logprobs: {NUMBER}", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_serving_prints_every_path_with_its_cpu_per_token(tiny_model_path, tmp_path):
    record = run_bench(tmp_path, "serving", "--model", tiny_model_path, "--parallel", "2", "--clients", "2",
                       "--requests", "4", "--max-tokens", "2", "--threads", "1")
    paths = table(record, "paths at --threads 1, --parallel 2")
    assert paths["columns"][:3] == ["path", "tok/s", "/server"] and len(paths["columns"]) == 10, paths["columns"]
    assert [row[0] for row in paths["rows"]] == [
        "one Client, generate_batch", "2 threads, a Client each", "AsyncClient, 2 coroutines",
        "cbatch HTTP whole", "cbatch HTTP streamed", "cbatch HTTP whole, new conn"], record["output"]
    # Without llama-server: no ratio, and six CPU figures (caller, front-end, HTTP processes,
    # worker main thread, llama_decode wall, worker other threads) but not the server's.
    for _, tok_s, ratio, *cpu_us, server_us in paths["rows"]:
        assert tok_s > 0 and ratio is None and server_us is None, record["output"]
        assert all(us is not None for us in cpu_us) and cpu_us[0] > 0, record["output"]  # every caller spent CPU
    ttft = table(record, "time to first token at --threads 1, --parallel 2")
    assert [(path, p50 > 0) for path, p50, _, _ in ttft["rows"]] == [("cbatch HTTP streamed", True)], record["output"]
    steps = table(record, "the decode worker's steps at --threads 1, --parallel 2")
    assert steps["columns"] == ["path", "steps", "tokens/step", "step ms", "llama_decode ms", "host ms"]
    assert [row[0] for row in steps["rows"]] == [row[0] for row in paths["rows"]], record["output"]
    assert all(num_steps > 0 and step_ms >= decode_ms for _, num_steps, _, step_ms, decode_ms, _ in steps["rows"]), \
        record["output"]


@pytest.mark.slow
def test_bench_long_prompts_prints_each_run_and_the_workloads_by_config(tiny_model_path, tmp_path):
    """llama-server is left out: a checkout need not have built it."""
    record = run_bench(tmp_path, "long_prompts", "--model", tiny_model_path, "--parallel", "2", "--clients", "2",
                       "--requests", "1", "--workloads", "short", "--configs", "streams,no-cache")
    runs = table(record, "runs, as each ends")
    assert [row[:2] for row in runs["rows"]] == [["streams", "short"], ["no-cache", "short"]], record["output"]
    assert all(rate > 0 and 0 <= hit_rate <= 1 for _, _, rate, hit_rate in runs["rows"]), record["output"]
    (short,) = table(record, "parallel 2, 2 clients x 1 requests")["rows"]
    assert short[0] == "short" and all(figure > 0 for figure in short[1:]) and len(short) == 4, record["output"]


@pytest.mark.slow
def test_bench_http_vs_zmq_prints_every_path_and_their_ratio(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "http_vs_zmq", "--model", tiny_model_path, "--parallel", "2", "--requests", "4",
                       "--max-tokens", "4")
    paths = table(record, "Generated tokens/s")
    rows = {row[0]: dict(zip(paths["columns"][1:], row[1:])) for row in paths["rows"]}
    assert list(rows) == ["one Client, generate_batch", "ZeroMQ Client", "HTTP (cbatch)"], record["output"]
    batch = rows.pop("one Client, generate_batch")
    assert batch["whole tok/s"] > 0 and batch["TTFT p50 ms"] is None, batch  # a batch is not streamed
    for row in rows.values():
        assert row["whole tok/s"] > 0 and row["streamed tok/s"] > 0 and row["TTFT p50 ms"] > 0, row
    assert re.fullmatch(rf"HTTP \(cbatch\) / ZeroMQ: {NUMBER} whole, {NUMBER} streamed; HTTP server process CPU "
                        r"\d+% of one core", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_async_client_prints_its_cpu_per_request(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "async_client", "--model", tiny_model_path, "--requests", "64",
                       "--max-tokens", "1", "2")
    figures = table(record, "The AsyncClient's own CPU")
    assert figures["columns"] == ["max_tokens", "CPU us/request", "CPU us/token", "requests/s"]
    assert [max_tokens for max_tokens, *_ in figures["rows"]] == [1, 2], record["output"]
    assert all(per_request > 0 and per_s > 0 for _, per_request, _, per_s in figures["rows"]), record["output"]


@pytest.mark.slow
def test_bench_priorities_prints_each_phase_and_the_verdict(tmp_path, tiny_model_path):
    """Interactive probes beside a running batch file: the script needs the batch file to
    fill every slot and keep a queue, and ends it when the probes are done."""
    record = run_bench(tmp_path, "priorities", "--model", tiny_model_path, "--parallel", "2", "--lines", "200",
                       "--batch-tokens", "16", "--max-in-flight", "8", "--probes", "5", "--batch-probes", "2")
    ttfts = table(record, "interactive TTFT")
    assert ttfts["columns"] == ["phase", "p50 ms", "p99 ms"]
    assert [row[0] for row in ttfts["rows"]] == ["idle daemon", "beside the batch file, interactive",
                                                 "beside the batch file, as batch", "beside it, less the slot wait"]
    # Less its slot wait, a probe's figure may dip a little below zero (see the bench): only the others are > 0.
    assert all(p50 > 0 and p99 > 0 for _, p50, p99 in ttfts["rows"][:3]), record["output"]
    assert any(note.endswith("still queued at the end: True") for note in record["notes"]), record["notes"]
    assert re.fullmatch(r"target: .*, (met|missed)", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_preempt_prints_both_settings_idle_and_loaded(tmp_path, tiny_model_path):
    """Probes beside batch streams that hold every slot, with preemption on, then off."""
    record = run_bench(tmp_path, "preempt", "--model", tiny_model_path, "--parallel", "1", "--probes", "3",
                       "--batch-tokens", "24")
    ttfts = table(record, "interactive TTFT")
    assert ttfts["columns"] == ["preemption", "daemon", "TTFT p50 ms", "TTFT p99 ms", "batch request p50 s",
                                "preemptions"]
    rows = ttfts["rows"]
    assert [row[:2] for row in rows] == [["on", "idle"], ["on", "beside batch load"], ["off", "idle"],
                                         ["off", "beside batch load"]], record["output"]
    assert all(p50 > 0 and p99 > 0 for _, _, p50, p99, _, _ in rows), record["output"]
    assert rows[1][4] > 0 and rows[3][4] > 0, record["output"]
    assert rows[1][5] >= 1 and rows[3][5] == 0, record["output"]  # probes preempted the batch stream, then none did
    assert re.match(r"CPU: .+, \d+ usable of \d+ CPUs", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_embeddings_prints_each_path_and_the_stream_gaps(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "embeddings", "--model", tiny_model_path, "--clients", "1", "--requests", "2",
                       "--batch-sizes", "1", "4", "--parallel", "2", "--max-tokens", "8")
    rates = table(record, "Inputs embedded per second")
    assert [(path, size) for path, size, *_ in rates["rows"]] == [
        ("cbatch HTTP", 1), ("cbatch HTTP", 4), ("cbatch Client", 1), ("cbatch Client", 4)], record["output"]
    assert all(per_s > 0 and ratio is None for *_, per_s, ratio in rates["rows"]), record["output"]  # no llama-server
    gaps = table(record, "Gaps between the token events of a 8-token stream")
    assert gaps["title"].endswith("(beside 1 callers embedding batches of 4)"), gaps["title"]
    assert [(server, load) for server, load, *_ in gaps["rows"]] == [("cbatch", "alone"), ("cbatch", "loaded")]
    assert all(worst_ms is not None and median_ms is not None for *_, worst_ms, median_ms in gaps["rows"]), \
        record["output"]


@pytest.mark.slow
def test_bench_http_cpu_prints_both_parsers_and_their_ratio(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "http_cpu", "--model", tiny_model_path, "--requests", "8", "--callers", "2",
                       "--rounds", "1")
    figures = table(record, "round 1")
    assert figures["columns"] == ["parser", "req/s", "HTTP CPU ms/req", "daemon CPU ms/req", "load generator cores"]
    assert [row[0] for row in figures["rows"]] == ["httptools", "h11"], record["output"]
    # Eight requests can take under one clock tick of CPU: only the rate is sure to be above zero.
    assert all(per_s > 0 and http_ms >= 0 for _, per_s, http_ms, _, _ in figures["rows"]), record["output"]
    # Then the ratio says so.
    assert re.fullmatch(rf"round 1: HTTP CPU per request h11 / httptools = ({NUMBER}x|not measured "
                        r"\(httptools used under one clock tick.*)", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_fair_share_prints_both_settings(tmp_path, tiny_model_path):
    """A light tenant beside a heavy one's backlog, fair share on and then off."""
    record = run_bench(tmp_path, "fair_share", "--model", tiny_model_path, "--parallel", "2", "--light-clients", "1",
                       "--heavy-factor", "3", "--light-requests", "4", "--max-tokens", "8")
    runs = table(record, "the tokens generated")
    assert runs["columns"] == ["fair share", "heavy tokens %", "light tokens %", "tokens", "run s",
                               "light TTFT p50 ms", "light TTFT p99 ms", "loadgen CPU s", "loadgen cores"]
    assert [row[0] for row in runs["rows"]] == ["on", "off"], record["output"]
    for _, heavy, light, tokens, run_s, p50, p99, cpu_s, _ in runs["rows"]:
        assert abs(heavy + light - 100) < 1e-3 and tokens > 0 and run_s > 0, record["output"]
        assert 0 < p50 <= p99 and cpu_s > 0, record["output"]


@pytest.mark.slow
def test_bench_jobs_prints_every_figure(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "jobs", "--model", tiny_model_path, "--parallel", "2", "--lines", "10",
                       "--max-tokens", "4", "--ttft-probes", "6", "--ttft-callers", "2", "--rss-lines", "30",
                       "--kill-lines", "600")
    throughput = table(record, "Throughput, 10 lines x 4 tokens")
    assert [way for way, *_ in throughput["rows"]] == ["cbatch-submit", "batch job"], record["output"]
    assert all(run_1 > 0 and run_2 > 0 and cpu_ms >= 0 for _, run_1, run_2, cpu_ms in throughput["rows"]), \
        record["output"]
    ttft = table(record, "Interactive TTFT, 6 streamed requests from 2 callers")
    assert [load for load, *_ in ttft["rows"]] == ["idle", "beside a running job"], record["output"]
    assert all(p50 > 0 for _, p50, _, _ in ttft["rows"]), record["output"]
    assert any(re.fullmatch(rf"batch job / cbatch-submit, tok/s over both runs: {NUMBER}x", line)
               for line in record["notes"]), record["notes"]
    assert any(re.fullmatch(rf"TTFT p99 beside a running job / idle {NUMBER}x \(the job was \w+, \d+ lines done\)",
                            line) for line in record["notes"]), record["notes"]
    (memory,) = table(record, "Memory")["rows"]
    assert memory[:3] == [30, 1, 30] and memory[-1] >= 0, record["output"]  # lines, jobs, completed; MB above idle
    (restart,) = table(record, "Restart after kill -9")["rows"]
    lines, _, first_new_line_s, _, job_then, lines_done = restart
    assert (lines, job_then, lines_done) == (600, "completed", 600) and first_new_line_s > 0, record["output"]


@pytest.mark.slow
def test_bench_structured_prints_the_row_costs_compile_times_and_each_mode(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "structured", "--model", tiny_model_path, "--parallel", "2", "--n", "1", "2",
                       "--rounds", "1", "--max-tokens", "8", "--calls", "3", "--compile-delay", "--probes", "2")
    one_row = table(record, "One logit row")["rows"]
    assert [way for way, _ in one_row] == ["llama.cpp GBNF sampler", "llguidance check", "llguidance mask"]
    assert all(ms > 0 for _, ms in one_row), record["output"]
    ((_, num_schemas, p50_ms, p99_ms, _),) = table(record, "Schema compile times")["rows"]
    assert 200 <= num_schemas < 300 and 0 < p50_ms <= p99_ms, record["output"]
    modes = table(record, "Each mode")
    rows = [dict(zip(modes["columns"], row)) for row in modes["rows"]]
    assert [(row["round"], row["parallel"], row["n"], row["mode"]) for row in rows] == [
        (1, 2, n, mode) for n in (1, 2) for mode in ("json_schema", "json_object", "tool call", "think+schema")]
    assert all(row["tok/s"] > 0 and row["plain tok/s"] > 0 and row["valid"] <= row["stopped"] <= 2 for row in rows)
    first_token = table(record, "A small request's first token")["rows"]
    assert [row[0] for row in first_token] == ["alone", "behind the schema"], record["output"]
    assert all(median_ms > 0 for _, median_ms, _ in first_token), record["output"]
    assert re.fullmatch(rf"compile delay: 1\d\d KB schema answered in \d+ ms .* [+-]{NUMBER} ms behind it",
                        record["notes"][-1]), record["notes"]


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
        summary = json.loads((out / "summary.json").read_text())
        assert (out / "table.txt").read_text() in done.stdout, done.stdout
        return summary, {name: stage["status"] for name, stage in summary["stages"].items()}

    summary, stages = rehearse(tmp_path / "out", 240)
    assert stages == {"versions": "ok", "build": "skipped", "llama-server": "skipped", "serving 2": "ok",
                      "host-work": "ok", "long": "ok"}, stages
    # Each bench stage's figures are read from the JSON line it wrote, its tables kept beside them.
    serving = summary["stages"]["serving 2"]
    assert re.search(rf"cbatch HTTP whole {NUMBER} tok/s", serving["figures"]), serving
    assert re.search(r"TTFT p50 .+ host .+ ms a step", serving["figures"]), serving
    assert re.search(rf"greedy 2 backend off: host {NUMBER} of {NUMBER} ms", summary["stages"]["host-work"]["figures"])
    assert re.search(rf"short: streams {NUMBER}", summary["stages"]["long"]["figures"]), summary["stages"]["long"]
    assert all(summary["stages"][name]["tables"] for name in ("serving 2", "host-work", "long")), summary
    assert summary["versions"]["cbatch"] and (tmp_path / "out" / "serving-2.jsonl").exists()
    _, short = rehearse(tmp_path / "short", 5)
    assert [short[name] for name in ("serving 2", "host-work", "long")] == ["skipped"] * 3, short


def test_bench_images_prints_each_load_and_the_shared_image_encoded_once(tmp_path, tiny_tools_model_path,
                                                                        tiny_projector_path):
    record = run_bench(tmp_path, "images", "--model", tiny_tools_model_path, "--mmproj", tiny_projector_path,
                       "--parallel", "4", "--streams", "1", "--max-tokens", "24", "--image-callers", "1")
    streams = table(record, "Text streams' gaps between token events")
    assert [run for run, *_ in streams["rows"]] == [
        "alone", "beside 1 callers sending text", "beside 1 callers sending images"], record["output"]
    assert all(gap_p50_ms >= 0 for _, gap_p50_ms, *_ in streams["rows"]), record["output"]
    concurrent = table(record, "8 concurrent requests with images")
    assert [(images, encoder_runs) for images, _, encoder_runs in concurrent["rows"]] == [
        ("one same new image", 1), ("8 new images", 8)], record["output"]
    assert all(wall_ms > 0 for _, wall_ms, _ in concurrent["rows"]), record["output"]


def test_bench_request_path_prints_both_sides_of_every_body(tmp_path):
    record = run_bench(tmp_path, "request_path", "--repeat", "20", "--rounds", "1")
    figures = table(record, "CPU per request")
    assert figures["columns"] == ["body", "front-end us", "worker us"]
    assert [row[0] for row in figures["rows"]] == ["short prompt", "chat, 4 messages", "every parameter",
                                                   "64 KiB prompt"], record["output"]
    assert all(front_us > 0 and worker_us > 0 for _, front_us, worker_us in figures["rows"]), record["output"]
    assert re.fullmatch(rf"CPU used by this run: {NUMBER} s .*", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_conversations_prints_every_figure_and_the_restart(tmp_path, tiny_model_path):
    """llama-server is left out: a checkout need not have built it."""
    record = run_bench(tmp_path, "conversations", "--model", tiny_model_path, "--conversations", "3", "--turns", "2",
                       "--parallel", "1", "--system-tokens", "20", "--history-tokens", "60", "--answer-tokens", "4",
                       "--configs", "cbatch,cbatch-no-tier", "--restart", "1")
    servers = table(record, "Run 1: each server")
    rows = {row[0]: dict(zip(servers["columns"], row)) for row in servers["rows"]}
    assert list(rows) == ["cbatch", "cbatch-no-tier"], record["output"]
    for row in rows.values():
        assert all(row[column] > 0 for column in ("wall s", "TTFT median s", "TTFT p99 s", "RSS MB")), row
        assert row["turn 1 computed"] > 0 and row["callers CPU s"] >= 0, row
    assert rows["cbatch"]["host hits"] >= 1 and rows["cbatch-no-tier"]["host bytes"] is None, rows
    restart = table(record, "Run 1: restart after turn 1, turn 2")
    assert [daemon for daemon, *_ in restart["rows"]] == ["cold", "from --cache-dir"], record["output"]
    assert all(ttft_s > 0 for _, ttft_s, *_ in restart["rows"]), record["output"]


def test_bench_tenants_prints_both_runs_and_what_the_tenants_cost(tmp_path):
    record = run_bench(tmp_path, "tenants", "--tenants", "10", "--parallel", "4", "--steps", "50", "--queue", "20",
                       "--repeats", "1")
    rows = table(record, "Scheduler CPU per step")["rows"]
    assert [num_tenants for num_tenants, _ in rows] == [1, 10], record["output"]
    assert all(ms > 0 for _, ms in rows), record["output"]
    assert re.fullmatch(rf"fair share among 10 tenants costs [+-]{NUMBER} ms per step", record["notes"][-1])


@pytest.mark.slow
def test_bench_system_prints_every_path_the_delivery_latency_and_the_idle_reader(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "system", "--model", tiny_model_path, "--parallel", "2", "--requests", "2",
                       "--prompt-tokens", "16", "--max-tokens", "2")
    paths = table(record, "Throughput by path")["rows"]
    assert [name for name, *_ in paths] == ["in-process engine (mean of 2)", "cbatch-submit", "1 Client, stream_batch",
                                            "2 concurrent Clients (threads)"], record["output"]
    assert all(tok_s > 0 and ratio > 0 for _, tok_s, ratio in paths), record["output"]
    latency = table(record, "Delivery latency")["rows"]
    assert [row[0] for row in latency] == ["1 Client", "2 Clients"], record["output"]
    assert all(num_reads > 0 and 0 <= p50_ms <= p99_ms <= max_ms for _, num_reads, p50_ms, p99_ms, max_ms in latency)
    idle = table(record, "Idle reader CPU")["rows"]
    assert [row[0] for row in idle] == ["none", "2 other requests streaming"], record["output"]
    assert all(percent >= 0 for _, percent in idle), record["output"]


@pytest.mark.slow
def test_bench_state_moves_prints_the_steps_with_and_without_a_move(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "state_moves", "--model", tiny_model_path, "--streams", "2", "--slots", "1",
                       "--conversations", "3", "--turns", "2", "--history-words", "40", "--ctx-per-seq", "512")
    steps = {(kind, moved): figures for kind, moved, *figures in table(record, "Step times")["rows"]}
    count, median_ms, slowest_ms, ratio = steps["with prompt tokens", "yes"]
    assert count > 0 and 0 < median_ms <= slowest_ms and ratio > 0, record["output"]
    assert re.fullmatch(rf"target: .*: {NUMBER}x, (met|missed)", record["notes"][-1]), record["notes"]
    moves = table(record, "State moves")["rows"]
    assert [row[0] for row in moves] == ["saves", "restores"], record["output"]
    assert all(count > 0 and median_ms > 0 for _, count, median_ms, *_ in moves), record["output"]


@pytest.mark.slow
def test_bench_busy_host_prints_each_setting_on_a_busy_and_a_quiet_host(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "busy_host", "--model", tiny_model_path, "--requests", "4", "--max-tokens", "16")
    assert record["notes"][0].startswith("4 concurrent requests of 16 tokens"), record["notes"]
    for host in ("busy", "quiet"):
        runs = table(record, f"{host} host (")
        assert runs["columns"] == ["threads", "wall s", "compute threads at the end"]
        assert [row[0] for row in runs["rows"]][:2] == ["default", "-t 1"], record["output"]
        assert re.fullmatch(r"-t \d+", runs["rows"][2][0]) and len(runs["rows"]) == 3, record["output"]
        assert all(wall_s > 0 and num_threads >= 1 for _, wall_s, num_threads in runs["rows"]), record["output"]
        assert any(re.fullmatch(rf"{host} host: default / best fixed -t {NUMBER}x", note)
                   for note in record["notes"]), record["notes"]
    assert re.fullmatch(rf"client CPU: {NUMBER} s", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_stalled_readers_prints_the_idle_figure_and_both_kinds_of_stalled_readers(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "stalled_readers", "--model", tiny_model_path, "--parallel", "2", "--park-after",
                       "1", "--probes", "2")
    ttfts = table(record, "time to first token of 2 probes beside 2 stalled readers")
    assert ttfts["columns"] == ["stalled readers", "first ms", "median ms", "max ms", "parks", "streams whole"]
    idle, *stalled = ttfts["rows"]
    assert idle[0] == "none (idle)" and all(ms > 0 for ms in idle[1:4]), record["output"]
    assert [row[0] for row in stalled] == ["zmq", "sse"], record["output"]
    for _, first_ms, median_ms, max_ms, num_parks, num_whole in stalled:
        assert first_ms > 0 and median_ms > 0 and max_ms > 0 and num_parks >= 1, record["output"]
        assert num_whole == 2, record["output"]  # every stalled stream held every token once read
    assert re.fullmatch(rf"target: .* = {NUMBER} s: zmq (met|missed), sse (met|missed)", record["notes"][0]), \
        record["notes"]
    assert re.fullmatch(rf"CPU: the script used {NUMBER} s", record["notes"][-1]), record["notes"]


@pytest.mark.slow
def test_bench_flood_prints_each_phase_and_the_daemon_outlives_the_flooder(tmp_path, tiny_model_path):
    record = run_bench(tmp_path, "flood", "--model", tiny_model_path, "--parallel", "1", "--requests", "2",
                       "--max-tokens", "2", "--flood-s", "0.5")
    latencies = table(record, "the well-behaved client's requests")
    assert latencies["columns"] == ["phase", "median s", "p90 s", "max s", "finished", "failed"]
    assert [row[0] for row in latencies["rows"]] == ["quiet", "while one floods", "flooder killed"], record["output"]
    assert all(finished + failed == 2 for *_, finished, failed in latencies["rows"]), record["output"]
    assert latencies["rows"][0][1] > 0 and latencies["rows"][2][1] > 0, record["output"]
    assert re.fullmatch(rf"the flooder's requests were gone {NUMBER} s after it was killed", record["notes"][-2])
    assert record["notes"][-1] == "daemon alive: True", record["notes"]


def test_the_entry_lists_every_bench_and_writes_a_json_line_a_run(tmp_path):
    listing = subprocess.run([sys.executable, "scripts/bench.py"], cwd=REPO, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S).stdout
    named = {line.split()[0] for line in listing.splitlines() if line.startswith("  ")}
    assert {path.stem for path in (REPO / "scripts" / "benches").glob("*.py")} - named == {
        "__init__", "callers", "loadgen", "options", "peers", "proc_cpu", "report", "schema_suite"}
    runs = tmp_path / "runs.jsonl"
    out = run_script("--json", str(runs), "request_path", "--repeat", "5", "--rounds", "1")
    (record,) = [json.loads(line) for line in runs.read_text().splitlines()]
    assert record["bench"] == "request_path" and record["argv"] == ["--repeat", "5", "--rounds", "1"]
    assert len(record["commit"]) == 12 and record["machine"]["cores"] >= 1 and record["machine"]["memory_gib"] > 0
    assert record["cpu_self_s"] > 0 and record["wall_s"] > 0 and record["output"] == out.splitlines()
    assert record["status"] == 0 and [table["title"] for table in record["tables"]] == [
        "CPU per request, the best of --rounds"] and len(record["notes"]) == 1
    unknown = subprocess.run([sys.executable, "scripts/bench.py", "nope"], cwd=REPO, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_S)
    assert unknown.returncode != 0 and "no bench named 'nope'" in unknown.stderr


def test_a_table_keeps_numbers_as_json_and_refuses_a_cell_that_is_not_one(capsys):
    """numpy's scalars become Python numbers and a NaN becomes None in the kept row (the
    JSON line stays strict), small figures keep their digits on the terminal, and a cell
    that is no number, text or None is refused at its row, not when the line is written."""
    import numpy as np

    report = load_script("benches/report")
    figures = report.Table("figures", "name", "count", "share", "missing", "tiny")
    figures.row("first", np.int64(3), np.float32(0.5), float("nan"), 4.2e-05)
    with pytest.raises(TypeError, match="a table cell is a number, text or None, got list"):
        figures.row("second", [1], 1, 1, 1)
    report.note("a note")
    kept = json.loads(json.dumps(report.kept(), allow_nan=False))
    assert kept == {"tables": [{"title": "figures", "columns": ["name", "count", "share", "missing", "tiny"],
                                "rows": [["first", 3, 0.5, None, 4.2e-05]]}], "notes": ["a note"]}
    assert capsys.readouterr().out.splitlines()[2].split() == ["first", "3", "0.5", "-", "4.2e-05"]
