"""Many tenants on one daemon, through the real daemon: named API keys (--api-keys-file),
fair share of the decode steps by weight, limits per key (429 rate_limited with a
Retry-After from the key's budget), usage per tenant, and a SIGHUP reload of the keys."""

import concurrent.futures
import json
import math
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from daemonkit import SCRIPTS_DIR, wait_until
from httpkit import HttpDaemon

KEYS = """# name key options
heavy key-heavy weight=1
light key-light weight=2   # twice heavy's share
capped key-capped max_concurrent=1
metered key-metered tokens_per_min=120
bursty key-bursty tokens_per_min=60
scraper key-scraper metrics=1  # the operator's: may read /metrics
"""
PARALLEL = 2  # small, so that both tenants keep requests waiting
MAX_TOKENS = 12
TIMEOUT_S = 300.0


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer key-{tenant}"}


def complete(daemon: HttpDaemon, key_of: str, **body) -> httpx.Response:
    """A completion sent with `key_of`'s key."""
    body = {"prompt": "tenants", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{daemon.base_url}/v1/completions", json=body, headers=auth(key_of), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def daemon(tiny_model_path, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(KEYS)
    daemon = HttpDaemon(tiny_model_path, "--parallel", str(PARALLEL), "--max-queue", "1000",
                        "--api-keys-file", str(keys_file))
    yield daemon
    daemon.stop()
    daemon.remove_workdir()


def test_backlogged_tenants_get_tokens_in_proportion_to_their_weights(daemon):
    """heavy queues ten times light's requests; while both have requests waiting, light
    (weight 2) gets two thirds of the tokens served, heavy (weight 1) one third."""
    num_light = 40
    items = []
    for i in range(num_light * 11):  # light's among heavy's, so both are queued from the start
        tenant = "light" if i % 11 == 0 else "heavy"
        items.append({"prompt": f"share {i}", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                      "tenant": tenant, "id": tenant})
    served = {"heavy": 0, "light": 0}
    num_light_done = 0
    with daemon.client() as client:
        for position, chunk in client.stream_batch(items, max_in_flight=len(items)):
            assert not isinstance(chunk, Exception), chunk
            if not chunk.finish_reason:
                continue
            tenant = items[position]["tenant"]
            served[tenant] += chunk.usage["prompt_tokens"] + chunk.usage["completion_tokens"]
            num_light_done += tenant == "light"
            if num_light_done == num_light - PARALLEL:  # light still has requests waiting or running
                break
    light_share = served["light"] / (served["light"] + served["heavy"])
    assert abs(light_share - 2 / 3) <= 0.1 * 2 / 3, served


def test_a_tenant_past_max_concurrent_gets_429_and_the_others_are_served(daemon):
    body = {"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, headers=auth("capped"),
                      timeout=TIMEOUT_S) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept open: the request runs while the caller is there
        assert next(line for line in lines if line.startswith("data: {")).startswith('data: {"id"')  # it runs
        refused = complete(daemon, "capped")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
        assert refused.headers["Retry-After"] == "1" and "max_concurrent" in refused.json()["error"]["message"]
        assert complete(daemon, "heavy").status_code == 200  # another tenant is not held back
    wait_until(lambda: complete(daemon, "capped").status_code == 200, timeout_s=60)  # its request ended


def test_more_choices_than_a_keys_max_concurrent_are_refused_as_they_stand(daemon):
    """n (or a list of prompts) past the key's max_concurrent could never be admitted whole:
    a 400 that says which setting, not a 429 that no retry would end; nothing is charged."""
    for extra in ({"n": 2}, {"prompt": ["one", "two"]}):
        refused = complete(daemon, "capped", **extra)
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "invalid_request", refused.text
        assert "max_concurrent" in error["message"] and "Retry-After" not in refused.headers
    assert complete(daemon, "capped", n=1).status_code == 200
    assert complete(daemon, "heavy", n=2).json()["usage"]["completion_tokens"] == 2 * MAX_TOKENS


def test_a_tenant_past_tokens_per_min_gets_a_retry_after_from_its_budget(daemon):
    """metered's bucket holds 120 tokens, refilled at 2 a second; a request that costs more
    takes it below zero, and the next waits until the bucket holds a token again."""
    used = complete(daemon, "metered", max_tokens=200)
    finished_s = time.monotonic()
    assert used.status_code == 200
    cost = used.json()["usage"]["total_tokens"]
    refused = complete(daemon, "metered")
    elapsed_s = time.monotonic() - finished_s
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
    owed = cost - 120 + 1  # tokens the bucket must regain, at 2 a second, less what came back meanwhile
    retry_after_s = int(refused.headers["Retry-After"])
    assert math.ceil(owed / 2 - elapsed_s) - 1 <= retry_after_s <= math.ceil(owed / 2)
    assert f"retry in {retry_after_s} s" in refused.json()["error"]["message"]
    assert complete(daemon, "light").status_code == 200


def test_a_full_bucket_lets_in_a_burst_of_its_size_not_hundreds(daemon):
    """Each request reserves its max_tokens in the bucket as it is let in: at a full bucket
    of 60, eight requests of 30 at once get two in (a third if a token came back meanwhile),
    the rest a 429, where charging only at the end let every one in."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = [r.status_code for r in pool.map(lambda i: complete(daemon, "bursty", prompt=f"burst {i}",
                                                                       max_tokens=30), range(8))]
    assert 2 <= statuses.count(200) <= 3 and statuses.count(429) == 8 - statuses.count(200), statuses


def test_a_wrong_key_is_a_401_that_names_no_tenant(daemon):
    refused = complete(daemon, "nobody")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    assert not any(name in refused.text for name in ("heavy", "light", "capped", "metered"))


def metrics(daemon: HttpDaemon) -> dict:
    """/metrics as {(sample name, sorted label pairs): value}, read with the operator's key."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{daemon.base_url}/metrics", headers=auth("scraper"), timeout=60).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_key_sets_the_tenant_whatever_the_body_says_and_counters_add_up(daemon):
    before = metrics(daemon)
    assert complete(daemon, "light", tenant="heavy").status_code == 200  # not a field the HTTP API forwards
    assert complete(daemon, "heavy", max_tokens=5).status_code == 200
    wait_until(lambda: re.search(r'127\.0\.0\.1 light "POST /v1/completions" 200', daemon.log()), timeout_s=60)
    after = metrics(daemon)

    def grew(name: str, tenant: str) -> float:
        key = (name, (("tenant", tenant),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("cbatch_tenant_requests_total", "light") == grew("cbatch_tenant_requests_total", "heavy") == 1
    tokens = "cbatch_tenant_generated_tokens_total"
    assert (grew(tokens, "light"), grew(tokens, "heavy")) == (MAX_TOKENS, 5)
    def grew_all(name: str) -> float:
        return sum(value - before.get(key, 0.0) for key, value in after.items() if key[0] == name)

    # Only HTTP requests ran meanwhile: what the tenants were served is what the HTTP server served.
    for tenant_name, total_name in (("cbatch_tenant_prompt_tokens_total", "cbatch_http_prompt_tokens_total"),
                                    ("cbatch_tenant_generated_tokens_total", "cbatch_http_generated_tokens_total"),
                                    ("cbatch_tenant_requests_total", "cbatch_http_requests_total")):
        assert grew_all(tenant_name) == grew_all(total_name) > 0, tenant_name
    with daemon.client() as client:
        status = subprocess.run([str(SCRIPTS_DIR / "cbatch-status"), "--endpoint", daemon.endpoint],
                                capture_output=True, text=True, timeout=60).stdout
        light = client.stats()["tenants"]["light"]
    assert re.search(rf"^tenant light: 0 in flight, {light['num_requests']} requests? finished, "
                     rf"{light['num_prompt_tokens']} prompt \+ {light['num_generated_tokens']} generated tokens$",
                     status, re.MULTILINE)


def test_only_a_key_with_metrics_1_reads_every_tenants_usage(daemon):
    assert complete(daemon, "light", max_tokens=1).status_code == 200
    refused = httpx.get(f"{daemon.base_url}/metrics", headers=auth("light"), timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert "metrics=1" in refused.json()["error"]["message"] and "cbatch_tenant" not in refused.text
    assert httpx.get(f"{daemon.base_url}/v1/loads", headers=auth("light"), timeout=60).status_code == 200
    assert metrics(daemon)[("cbatch_tenant_requests_total", (("tenant", "light"),))] >= 1


def test_embeddings_count_in_the_tenants_usage_and_limits(daemon):
    def embed(key_of: str, inputs) -> httpx.Response:
        return httpx.post(f"{daemon.base_url}/v1/embeddings", json={"input": inputs}, headers=auth(key_of),
                          timeout=TIMEOUT_S)

    before = metrics(daemon)
    long_list = [f"item {i}" for i in range(40)]  # two messages to the daemon: still one request of the tenant
    replies = [embed("light", "one input"), embed("light", long_list), embed("capped", long_list)]
    assert [reply.status_code for reply in replies] == [200, 200, 200]
    after = metrics(daemon)

    def grew(name: str, tenant: str) -> float:
        key = (name, (("tenant", tenant),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("cbatch_tenant_requests_total", "light") == 2 and grew("cbatch_tenant_requests_total", "capped") == 1
    assert grew("cbatch_tenant_prompt_tokens_total",
                "light") == sum(r.json()["usage"]["prompt_tokens"] for r in replies[:2])
    assert grew("cbatch_tenant_prompt_tokens_total", "capped") == replies[2].json()["usage"]["prompt_tokens"] > 0
    body = {"prompt": "long", "max_tokens": 3500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{daemon.base_url}/v1/completions", json=body, headers=auth("capped"),
                      timeout=TIMEOUT_S) as running:
        lines = running.iter_lines()  # kept: closing it would hang up, which cancels the completion
        assert next(line for line in lines if line.startswith("data: {")).startswith('data: {"id"')
        before = metrics(daemon)
        refused = embed("capped", "over the limit")  # its one request in flight is the running completion
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
        assert refused.headers["Retry-After"] == "1"
        assert embed("capped", long_list).status_code == 429  # and neither of its two parts runs:
        assert embed("light", "behind them").status_code == 200  # (the worker embeds in the order they came)
        after = metrics(daemon)
        assert grew("cbatch_tenant_prompt_tokens_total", "capped") == 0
        with daemon.client() as client:
            assert client.stats()["tenants"]["capped"]["num_in_flight"] == 1  # the completion only
    wait_until(lambda: embed("capped", "again").status_code == 200, timeout_s=60)


def test_a_bad_keys_file_line_stops_the_start_naming_the_line(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("alice key-a weight=2\nbob key-b weight=-1\n")
    result = subprocess.run([str(SCRIPTS_DIR / "cbatch-worker"), "--http", "8000", "--api-keys-file", str(keys_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"{keys_file} line 2: weight must be" in result.stderr


def test_sighup_reloads_the_keys_without_dropping_a_running_request(tiny_model_path, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("heavy key-heavy\ncapped key-capped\n")
    daemon = HttpDaemon(tiny_model_path, "--parallel", "2", "--http-processes", "2", "--api-keys-file", str(keys_file))
    try:
        result = {}
        body = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True}
        running = threading.Thread(target=lambda: result.update(reply=complete(daemon, "capped", **body)))
        running.start()
        with daemon.client() as client:
            wait_until(lambda: client.stats()["num_active"] == 1, timeout_s=60)
        keys_file.write_text("heavy key-heavy\nnewbie key-newbie\n")
        daemon.process.send_signal(signal.SIGHUP)
        wait_until(lambda: complete(daemon, "newbie", max_tokens=1).status_code == 200, timeout_s=60)
        for _ in range(4):  # each HTTP process reloaded: none takes the removed key
            assert complete(daemon, "capped", max_tokens=1).status_code == 401
        running.join(TIMEOUT_S)
        assert result["reply"].status_code == 200 and result["reply"].json()["usage"]["completion_tokens"] == 1500
        assert "API keys reloaded" in daemon.log()
    finally:
        daemon.stop()
        daemon.remove_workdir()


@pytest.mark.parametrize("over_http", [True, False])
def test_a_batch_waits_out_rate_limited_and_writes_no_error_line(daemon, tmp_path, over_http):
    """capped may run one request at a time; a batch of five sent four at a time is told
    rate_limited again and again, waits as told, and every line gets its completion."""
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    tenant = {} if over_http else {"tenant": "capped"}  # a native client names its tenant itself
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"batch {i}", "max_tokens": MAX_TOKENS, **tenant}) + "\n"
                               for i in range(5)))
    flags = ["--url", f"{daemon.base_url}/v1", "--api-key", "key-capped"] if over_http else []
    result = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(output),
                             "--max-in-flight", "4", *flags], env=daemon.env, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(line["id"] for line in written) == list(range(5)) and not any("error" in line for line in written)


def test_a_sighup_while_the_http_servers_start_ends_none_of_them(tiny_model_path, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("heavy key-heavy\n")
    daemon = HttpDaemon(tiny_model_path, "--http-processes", "2", "--api-keys-file", str(keys_file), is_waited=False)
    try:
        wait_until(lambda: "cbatch-worker: loading" in daemon.log(), timeout_s=60)  # its handlers are set

        def is_serving_after_a_sighup() -> bool:
            daemon.process.send_signal(signal.SIGHUP)
            try:
                return httpx.get(f"{daemon.base_url}/health", timeout=2.0).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(is_serving_after_a_sighup, timeout_s=120)
        assert complete(daemon, "heavy").status_code == 200
        assert daemon.process.poll() is None and "exited" not in daemon.log()
    finally:
        daemon.stop()
        daemon.remove_workdir()
