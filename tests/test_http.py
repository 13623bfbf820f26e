"""The OpenAI-compatible HTTP endpoint through the official openai package, against a
real daemon started with --http on the tiny model (content does not matter here)."""

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
from daemonkit import SCRIPTS_DIR, serve_module, wait_until
from httpkit import HttpDaemon

MODEL_ID = "tiny-llama.gguf"


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    yield from serve_module(HttpDaemon(tiny_model_path, "--parallel", "4"))


def test_models_lists_the_served_model(api):
    assert [m.id for m in api.models.list().data] == [MODEL_ID]


def test_completion_with_usage(api):
    result = api.completions.create(model=MODEL_ID, prompt="Hello there", max_tokens=7, temperature=0)
    assert result.object == "text_completion" and len(result.choices) == 1
    assert result.choices[0].finish_reason == "length" and result.choices[0].text
    assert result.usage.completion_tokens == 7
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7


def test_streamed_completion_ends_with_usage_chunk(api):
    chunks = list(api.completions.create(model=MODEL_ID, prompt="Hello there", max_tokens=9, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks[:-1])
    whole = api.completions.create(model=MODEL_ID, prompt="Hello there", max_tokens=9, temperature=0)
    assert text == whole.choices[0].text


def test_stop_string_ends_the_completion_before_it(api):
    text = api.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=24, temperature=0).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    result = api.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=24, temperature=0, stop=[stop])
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == text[:text.index(stop)]


def test_seed_reproduces_a_sampled_completion(api):
    def sample(seed):
        return api.completions.create(model=MODEL_ID, prompt="Tell me", max_tokens=16, temperature=1.0,
                                      seed=seed).choices[0].text

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_n_gives_n_choices_and_a_prompt_list_one_per_prompt(api):
    result = api.completions.create(model=MODEL_ID, prompt="Tell me", max_tokens=5, n=3, seed=3, temperature=1.0)
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 15
    both = api.completions.create(model=MODEL_ID, prompt=["a b", "c d"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in both.choices) == [0, 1]


def test_streamed_n_gives_every_choice_its_chunks_and_one_finish(api):
    greedy = api.completions.create(model=MODEL_ID, prompt="Tell me", max_tokens=6, temperature=0).choices[0].text
    chunks = list(api.completions.create(model=MODEL_ID, prompt="Tell me", max_tokens=6, temperature=0, n=3,
                                         stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    by_index = {index: [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index] for index in range(3)}
    assert sum(map(len, by_index.values())) == len(chunks) - 1
    for choices in by_index.values():
        assert [c.finish_reason for c in choices if c.finish_reason] == ["length"] and choices[-1].finish_reason
        assert "".join(c.text for c in choices) == greedy


def test_response_format_json_object_constrains_the_output(api):
    reply = api.completions.create(model=MODEL_ID, prompt="data:", max_tokens=12, temperature=1.0, seed=5,
                                   extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].text.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL_ID, prompt="x", max_tokens=2,
                               extra_body={"response_format": {"type": "xml"}})
    assert caught.value.body["code"] == "invalid_request"


def test_a_json_object_with_a_schema_beside_it_follows_that_schema(api):
    """instructor's JSON_SCHEMA mode sends the schema beside json_object: it is enforced; and
    an error about the schema names the field the caller sent, response_format."""
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"enum": [7, 8]}}}
    reply = api.completions.create(model=MODEL_ID, prompt="data:", max_tokens=24, temperature=0,
                                   extra_body={"response_format": {"type": "json_object", "schema": schema}})
    assert json.loads(reply.choices[0].text)["n"] in (7, 8)
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert caught.value.body["code"] == "invalid_request" and caught.value.body["param"] == "response_format"


def test_strict_makes_every_property_required_and_lenient_takes_keywords_it_cannot_enforce(daemon, api):
    schema = {"type": "object", "properties": {"n": {"enum": [7, 8]}, "word": {"enum": ["yes", "no"]}},
              "required": ["n"]}
    strict = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    reply = api.completions.create(model=MODEL_ID, prompt="data:", max_tokens=40, temperature=0,
                                   extra_body={"response_format": strict})
    assert set(json.loads(reply.choices[0].text)) == {"n", "word"}  # strict: every property, as OpenAI's
    unique = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "maxItems": 3}
    lenient = {"type": "json_schema", "json_schema": {"name": "x", "schema": unique}}
    reply = httpx.post(f"{daemon.base_url}/v1/completions", timeout=60, json={
        "prompt": "data:", "max_tokens": 40, "temperature": 0, "response_format": lenient})
    assert isinstance(json.loads(reply.json()["choices"][0]["text"]), list)  # taken, uniqueItems left unenforced
    assert reply.headers["x-cbatch-unenforced-keywords"] == "uniqueItems"  # and named
    with httpx.stream("POST", f"{daemon.base_url}/v1/completions", timeout=60, json={
            "prompt": "data:", "max_tokens": 4, "stream": True, "response_format": lenient}) as streamed:
        assert streamed.headers["x-cbatch-unenforced-keywords"] == "uniqueItems"
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=MODEL_ID, prompt="data:", max_tokens=4, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unique, "strict": True}}})
    assert "uniqueItems" in refused.value.body["message"]


def test_a_number_under_a_schema_ends_within_its_digits(api):
    """min_tokens keeps the model from ending the number (and a bias from a leading 0, which
    ends it): it stops at 16 digits, complete, where it would write 60."""
    integer = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    zero = str(3 + ord("0"))  # the tiny model's byte tokens start at id 3
    reply = api.completions.create(model=MODEL_ID, prompt="data:", max_tokens=60, temperature=0,
                                   logit_bias={zero: -100}, extra_body={"response_format": integer, "min_tokens": 40})
    text = reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop" and len(text.lstrip("-")) <= 16 and int(text) == json.loads(text)


def test_logit_bias_and_min_tokens_pass_through(api):
    eos_id = "2"  # </s> of the tiny model: +100 makes it the greedy pick, min_tokens holds it off
    reply = api.completions.create(model=MODEL_ID, prompt="x", max_tokens=10, temperature=0,
                                   logit_bias={eos_id: 100}, extra_body={"min_tokens": 3})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 3


def test_bad_value_is_400_with_code_and_param(api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL_ID, prompt="x", max_tokens=4, temperature=-1)
    error = caught.value.body
    assert error["code"] == "invalid_request" and error["param"] == "temperature"
    assert "temperature" in error["message"]


def test_unknown_model_is_404_and_unknown_fields_are_ignored(api, daemon):
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    reply = httpx.post(f"{daemon.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "u",
                                                                  "some_future_field": {"a": 1}})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_null_max_completion_tokens_leaves_max_tokens_in_force(daemon):
    reply = httpx.post(f"{daemon.base_url}/v1/completions",
                       json={"prompt": "x", "max_tokens": 3, "max_completion_tokens": None, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_not_json_is_400(daemon):
    reply = httpx.post(f"{daemon.base_url}/v1/completions", content=b"{nope")
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"


def _num_disconnects(daemon) -> float:
    samples = daemon.metrics()
    return samples.get(("cbatch_http_disconnects_total", (("endpoint", "completions"),)), 0)


def test_streamed_client_disconnect_frees_the_slot(daemon):
    num_before = _num_disconnects(daemon)
    body = {"prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
    assert daemon.wait_idle(2.0) < 2.0
    wait_until(lambda: _num_disconnects(daemon) >= num_before + 1, 60)  # an earlier stream may be counted late too


def test_waiting_client_disconnect_frees_the_slot(daemon):
    num_before = _num_disconnects(daemon)
    body = {"prompt": "go", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{daemon.base_url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.5))
    assert daemon.wait_idle(2.0) < 2.0
    wait_until(lambda: _num_disconnects(daemon) >= num_before + 1, 60)  # an earlier stream may be counted late too


def test_concurrent_clients(daemon):
    def one(i):
        with daemon.openai() as api:
            return api.completions.create(model=MODEL_ID, prompt=f"client {i}", max_tokens=12 + i, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert [r.usage.completion_tokens for r in results] == [12 + i for i in range(8)]


def test_metrics_parse_and_move(daemon, api):
    before = daemon.metrics()
    api.completions.create(model=MODEL_ID, prompt="metric me", max_tokens=6, temperature=0)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL_ID, prompt="x", max_tokens=0)
    after = daemon.metrics()
    finished = ("cbatch_http_requests_total", (("endpoint", "completions"), ("finish_reason", "length")))
    assert after[finished] == before.get(finished, 0) + 1
    bad = ("cbatch_http_errors_total", (("code", "invalid_request"), ("endpoint", "completions"), ("status", "400")))
    assert after[bad] == before.get(bad, 0) + 1
    tokens = ("cbatch_http_generated_tokens_total", ())
    assert after[tokens] == before.get(tokens, 0) + 6
    ttft = ("cbatch_http_time_to_first_token_seconds_count", ())
    assert after[ttft] == before.get(ttft, 0) + 1
    assert after[("cbatch_http_inter_token_latency_seconds_count", ())] >= 5
    for name in ("cbatch_queue_depth", "cbatch_active_sequences", "cbatch_decode_steps_total",
                 "cbatch_prompt_tokens_reused_total", "cbatch_preemptions_total"):
        assert (name, ()) in after, name
    assert after[("cbatch_decode_steps_total", ())] > before[("cbatch_decode_steps_total", ())]


def test_prompt_tokens_metric_counts_a_prompt_once_for_its_n_choices(daemon, api):
    def prompt_tokens() -> float:
        return daemon.metrics().get(("cbatch_http_prompt_tokens_total", ()), 0)

    before = prompt_tokens()
    reply = api.completions.create(model=MODEL_ID, prompt="count me once", max_tokens=2, n=3, temperature=0)
    assert prompt_tokens() - before == reply.usage.prompt_tokens


def test_completion_logprobs(api):
    result = api.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == 5 and len(logprobs.token_logprobs) == 5
    assert all(len(top) <= 3 and lp <= 0.0 for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset[0] == 0
    # greedy: the chosen token is the most likely alternative
    assert all(max(top.values()) == pytest.approx(lp, abs=1e-4)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_logprobs_out_of_range_is_400(api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, logprobs=21)
    assert caught.value.body["param"] == "logprobs"


def test_full_queue_is_429_with_retry_after(tiny_model_path):
    daemon = HttpDaemon(tiny_model_path, "--parallel", "1", "--max-queue", "0", "--ctx-size", "32768", "--drain-grace",
                        "0")
    # A whole response, so the running request never waits on this test reading its stream.
    body = {"prompt": "go", "max_tokens": 30000, "ignore_eos": True}

    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut off when the daemon stops
            httpx.post(f"{daemon.base_url}/v1/completions", json=body, timeout=120)

    running = threading.Thread(target=run)
    try:
        running.start()
        with daemon.client() as client:
            wait_until(lambda: client.stats()["num_in_flight"] == 1, 120)  # it took the one slot: no queue left
        with pytest.raises(openai.RateLimitError) as caught:
            daemon.openai().completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
        assert caught.value.body["code"] == "queue_full"
        assert caught.value.response.headers["retry-after"] == "1"
    finally:
        daemon.stop()
        running.join()
        daemon.remove_workdir()


def test_drain_answers_503_while_in_flight_streams_finish(tiny_model_path):
    # A long stream, so it still runs when the 503 is asked for, and a grace long enough
    # for it to finish on a loaded machine.
    daemon = HttpDaemon(tiny_model_path, "--parallel", "2", "--drain-grace", "300")
    try:
        body = {"prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, timeout=300) as running:
            lines = running.iter_lines()
            next(lines)
            daemon.process.send_signal(signal.SIGTERM)
            daemon.wait_http_status(503, timeout_s=60.0)
            with pytest.raises(openai.APIStatusError) as caught:
                daemon.openai().completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
            assert caught.value.status_code == 503 and caught.value.body["code"] == "shutting_down"
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert daemon.process.wait(60) == 0
    finally:
        daemon.stop()
        daemon.remove_workdir()


def test_killed_http_server_is_restarted(daemon, api):
    num_started = len(daemon.http_pids())
    os.kill(daemon.http_pids()[-1], signal.SIGKILL)
    wait_until(lambda: len(daemon.http_pids()) > num_started, 120)
    daemon.wait_http_status(200)
    assert api.completions.create(model=MODEL_ID, prompt="again", max_tokens=3).usage.completion_tokens == 3


@pytest.mark.parametrize("flags, message", [
    (["--http", "0.0.0.0:8000"], "--allow-remote"), (["--http", "80x"], "[HOST:]PORT"),
    (["--http", "70000"], "port must be"), (["--http", "0.0.0.0:8000", "--allow-remote"], "--api-key"),
    (["--http", "8000", "--api-key-file", "/nonexistent/key"], "--api-key-file")])
def test_bad_http_flags_are_usage_errors(flags, message):
    result = subprocess.run([str(SCRIPTS_DIR / "cbatch-worker"), *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr


def test_a_server_that_falls_behind_sends_a_rounds_tokens_in_one_event(daemon):
    """Tokens that arrived by one wake-up go out as one SSE event: held up for a moment,
    the server catches up with a few large events, which reassemble to the same text."""
    body = {"model": MODEL_ID, "prompt": "behind", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    events = []
    with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
        lines = (line for line in reply.iter_lines() if line.startswith("data: {"))
        events.append(json.loads(next(lines)[len("data: "):]))
        os.kill(daemon.http_pids()[-1], signal.SIGSTOP)  # the decode worker goes on meanwhile
        time.sleep(0.5)
        os.kill(daemon.http_pids()[-1], signal.SIGCONT)
        events += [json.loads(line[len("data: "):]) for line in lines]
    tokens_per_event = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e["choices"][0]["logprobs"]]
    assert sum(tokens_per_event) == 300 and max(tokens_per_event) > 1
    streamed_text = "".join(e["choices"][0]["text"] for e in events)
    assert streamed_text == "".join(token for e in events if e["choices"][0]["logprobs"]
                                    for token in e["choices"][0]["logprobs"]["tokens"])
    whole = httpx.post(f"{daemon.base_url}/v1/completions", json=body, timeout=60).json()
    assert streamed_text == whole["choices"][0]["text"]


@pytest.mark.parametrize("body, message", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
    (b'{"prompt": "x", "temperature": NaN}', "not JSON"),  # NaN is not JSON, whatever Python's json reads
    (b'[1, 2]', "JSON object"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "best_of": 3}', "best_of"),
    (b'{"prompt": "x", "suffix": "!"}', "suffix"),
])
def test_a_body_cbatch_cannot_serve_is_a_400_in_openai_shape_and_logs_no_traceback(daemon, body, message):
    reply = httpx.post(f"{daemon.base_url}/v1/completions", content=body, timeout=30,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_request" and message in error["message"]
    assert "Traceback" not in daemon.log()


def test_unknown_routes_and_methods_answer_in_openai_shape(daemon):
    missing = httpx.post(f"{daemon.base_url}/v1/moderations", json={"input": "x"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{daemon.base_url}/v1/completions", timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_a_request_for_too_many_completions_is_refused_before_it_costs_anyone(daemon):
    """5,000 prompts in one body: a 400 naming the limit, at once, while another caller's
    stream runs on to its end."""
    body = {"prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        flood = httpx.post(f"{daemon.base_url}/v1/completions", timeout=30,
                           json={"prompt": ["hi"] * 5000, "max_tokens": 1})
        events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert flood.status_code == 400 and "at most 256" in flood.json()["error"]["message"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_the_http_server_replaces_a_broken_connection_to_the_daemon(daemon):
    """A client whose pump died is replaced: /health answers 503 meanwhile, then 200."""
    from cbatch.http_api.state import HttpState

    async def run() -> tuple[str, str]:
        state = HttpState(daemon.endpoint, MODEL_ID)
        await state.connect()
        assert await state.status() == "ok"
        broken = state.client
        broken._pump_task.cancel()  # as if it had died
        await asyncio.sleep(0.05)
        status_while_broken = await state.status()
        await state.replace_broken_client()
        assert state.client is not broken and not state.client.is_broken
        status_after = await state.status()
        await state.client.close()
        return status_while_broken, status_after

    assert asyncio.run(run()) == ("unavailable", "ok")


def test_connections_that_send_no_request_headers_in_time_are_closed(daemon):
    """A silent connection and one that sends its headers a byte at a time are closed
    once HEADER_TIMEOUT_S has passed; other callers are served meanwhile."""
    import socket

    from cbatch.http_api.connection import HEADER_TIMEOUT_S

    silent = socket.create_connection(("127.0.0.1", daemon.port))
    dribbling = socket.create_connection(("127.0.0.1", daemon.port))
    started = time.monotonic()
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    is_closed = {silent: False, dribbling: False}
    for sock in is_closed:
        sock.settimeout(0.5)
    for i in range(int(3 * HEADER_TIMEOUT_S)):
        if all(is_closed.values()):
            break
        if not is_closed[dribbling]:
            try:
                dribbling.send(request[i % len(request):i % len(request) + 1])
            except OSError:
                is_closed[dribbling] = True
        for sock in is_closed:
            try:
                is_closed[sock] = is_closed[sock] or sock.recv(1) == b""
            except socket.timeout:
                pass
            except OSError:
                is_closed[sock] = True
    elapsed_s = time.monotonic() - started
    assert httpx.get(f"{daemon.base_url}/health", timeout=5).status_code == 200
    assert all(is_closed.values()) and elapsed_s < 2 * HEADER_TIMEOUT_S
    silent.close()
    dribbling.close()


def test_a_router_finds_the_load_it_asks_for(daemon):
    """GET /v1/loads in SGLang's worker format, and the vLLM gauge names gateways scrape."""
    body = {"prompt": "busy", "max_tokens": 4000, "ignore_eos": True, "stream": True}  # runs while polled
    with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        wait_until(lambda: httpx.get(f"{daemon.base_url}/v1/loads",
                                     timeout=5).json()["loads"][0]["num_running_reqs"] >= 1, 60)
        (load,) = httpx.get(f"{daemon.base_url}/v1/loads", timeout=5).json()["loads"]
        metrics = {name: value for (name, _), value in daemon.metrics().items() if name.startswith("vllm:")}
        for _ in lines:
            pass
    assert load["num_waiting_reqs"] == 0 and 0 < load["token_usage"] <= 1
    assert metrics["vllm:num_requests_running"] >= 1 and metrics["vllm:num_requests_waiting"] == 0
    assert 0 < metrics["vllm:kv_cache_usage_perc"] <= 1


def test_an_api_key_is_required_and_checked_except_for_health(tiny_model_path, tmp_path):
    (tmp_path / "key").write_text("s3cret-key\n")
    daemon = HttpDaemon(tiny_model_path, "--parallel", "2", "--api-key-file", str(tmp_path / "key"))
    try:
        body = {"prompt": "x", "max_tokens": 2}
        url = f"{daemon.base_url}/v1/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}):
            refused = httpx.post(url, json=body, headers=headers, timeout=10)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        assert httpx.get(f"{daemon.base_url}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{daemon.base_url}/health", timeout=10).status_code == 200
        reply = daemon.openai(api_key="s3cret-key").completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
        assert reply.usage.completion_tokens == 2
        assert "s3cret-key" not in " ".join(open(f"/proc/{pid}/cmdline").read() for pid in daemon.http_pids())
    finally:
        daemon.stop()
        daemon.remove_workdir()
