"""Two daemons on the tiny model, each a host of its own (see routerkit: network namespaces,
or loopback addresses where those cannot be made), behind the smg router with the health
checks docs/scale-out.md tunes: what a caller and a batch file see through the router,
and what losing or restarting a daemon costs them."""

import json
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest
from common import GREEDY, default_sigint
from daemonkit import SCRIPTS_DIR, pid_alive, wait_until
from routerkit import API_KEY, HOSTS_KIND, Host, Router

from cbatch.errors import EXIT_INTERRUPTED

# 16384 tokens of context per sequence: a long stream outlasts what the tests do meanwhile
DAEMON_FLAGS = ("--parallel", "4", "--max-queue", "4", "--ctx-size", "65536")
UNHEALTHY_WITHIN_S = 10.0  # tuned: 2 failed checks 1 s apart (1 s timeout); the default took minutes
READMITTED_WITHIN_S = 30.0
LONG_STREAM = {"max_tokens": 16000, **GREEDY}


class Cluster:
    def __init__(self, model_path: str, workdir):
        self.model_path, self.workdir = model_path, workdir
        self.hosts = [Host(0), Host(1)]
        self.daemons = [host.start_daemon(model_path, *DAEMON_FLAGS) for host in self.hosts]
        self.router = Router([host.url for host in self.hosts], workdir)
        self.model = self.router.openai().models.list().data[0].id

    def restart(self, index: int) -> None:
        """A new daemon on host `index` (the old one has exited), taken back by the router."""
        old = self.daemons[index]
        # a killed daemon's HTTP server leaves once its streams have ended, freeing the port
        wait_until(lambda: not any(pid_alive(pid) for pid in old.http_pids()), timeout_s=120)
        old.remove_workdir()
        self.daemons[index] = self.hosts[index].start_daemon(self.model_path, *DAEMON_FLAGS)
        started = time.monotonic()
        self.router.wait_healthy(len(self.hosts), READMITTED_WITHIN_S)
        print(f"host {index} readmitted {time.monotonic() - started:.1f} s after its daemon was ready")

    def close(self) -> None:
        assert self.router.stop() == 0, self.router.log()
        codes = [daemon.stop() for daemon in self.daemons]
        for daemon in self.daemons:
            daemon.remove_workdir()
        for host in self.hosts:
            host.close()
        assert codes == [0, 0]


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    print(f"daemons as separate hosts on {HOSTS_KIND}")
    made = Cluster(tiny_model_path, tmp_path_factory.mktemp("scale-out"))
    yield made
    made.close()


class Load:
    """Callers sending non-streamed requests through the router in a loop, each request
    checked, until stopped."""

    def __init__(self, cluster: Cluster, num_callers: int, max_retries: int = 0):
        self.api, self.model = cluster.router.openai(timeout=120, max_retries=max_retries), cluster.model
        self.num_answered, self.failures = 0, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._call, args=(i,)) for i in range(num_callers)]
        for thread in self._threads:
            thread.start()

    def _call(self, caller: int) -> None:
        while not self._stop.is_set():
            try:
                reply = self.api.completions.create(model=self.model, prompt=f"caller {caller}", max_tokens=16,
                                                    extra_body=GREEDY)
                assert reply.usage.completion_tokens == 16
                self.num_answered += 1
            except Exception as err:  # every failure is the test's finding, whatever its kind
                self.failures.append(repr(err))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def test_requests_through_the_router_streamed_and_not(cluster):
    api = cluster.router.openai()
    whole = api.completions.create(model=cluster.model, prompt="The router", max_tokens=12, extra_body=GREEDY)
    chunks = list(api.completions.create(model=cluster.model, prompt="The router", max_tokens=12, stream=True,
                                         stream_options={"include_usage": True}, extra_body=GREEDY))
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    ended_before = _requests_ended(cluster)
    replies = [api.completions.create(model=cluster.model, prompt=f"question {i}", max_tokens=4, extra_body=GREEDY)
               for i in range(8)]
    assert all(reply.usage.completion_tokens == 4 for reply in replies)
    with pytest.raises(openai.BadRequestError):  # cbatch's own 400 passes through unchanged
        api.completions.create(model=cluster.model, prompt="x", max_tokens=4, extra_body={"top_k": -5})
    wait_until(lambda: _requests_ended(cluster) >= ended_before + 8, timeout_s=60)  # stats come every 0.25 s


def _stat(daemon, name: str):
    with daemon.client() as client:
        return client.stats()[name]


def _requests_ended(cluster) -> int:
    return sum(_stat(daemon, "requests_ended") for daemon in cluster.daemons)


def test_the_api_key_is_required_by_the_router_and_passed_on_to_the_daemons(cluster):
    body = {"model": cluster.model, "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.post(f"{cluster.router.base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert refused.status_code == 401, refused.text
        direct = httpx.post(f"{cluster.hosts[0].url}/v1/completions", json=body, headers=headers, timeout=30)
        assert direct.status_code == 401 and direct.json()["error"]["code"] == "unauthorized"
    reply = httpx.post(f"{cluster.router.base_url}/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def _queue_full_count(daemon) -> float:
    metrics = httpx.get(f"{daemon.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("cbatch_http_errors") and 'code="queue_full"' in line)


def test_a_full_daemons_429_is_retried_on_the_other(cluster, tmp_path):
    """Host 0 is filled directly (non-streamed requests: its HTTP server stays idle); a
    round-robin router sends every other request there, gets 429 and sends it to host 1:
    every caller is answered."""
    full = cluster.daemons[0]
    router = Router([host.url for host in cluster.hosts], tmp_path, policy="round_robin")
    fill = {"model": cluster.model, "prompt": "fill", "max_tokens": 4000, **GREEDY}
    fillers = [threading.Thread(target=httpx.post, args=(f"{full.base_url}/v1/completions",),
                                kwargs={"json": fill, "headers": {"Authorization": f"Bearer {API_KEY}"},
                                        "timeout": 300})
               for _ in range(8)]  # --parallel 4 + --max-queue 4
    try:
        for thread in fillers:
            thread.start()
        wait_until(lambda: _stat(full, "num_in_flight") == 8, timeout_s=120)
        refused_before = _queue_full_count(full)
        api = router.openai()
        replies = [api.completions.create(model=cluster.model, prompt=f"q {i}", max_tokens=4, extra_body=GREEDY)
                   for i in range(6)]
        assert [reply.usage.completion_tokens for reply in replies] == [4] * 6
        assert _queue_full_count(full) > refused_before  # some went to the full daemon first
    finally:
        assert router.stop() == 0
        for thread in fillers:
            thread.join()


def _read_stream(url: str, model: str, outcomes: list) -> None:
    """One long stream through the router: "finished", "error: ..." or "hung"."""
    body = {"model": model, "prompt": "one long story", "stream": True, **LONG_STREAM}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        if events and events[-1] == "data: [DONE]" and '"length"' in events[-2]:
            outcomes.append("finished")
        else:
            outcomes.append(f"error: ended after {len(events)} events without finishing")
    except httpx.TimeoutException:
        outcomes.append("hung")
    except httpx.HTTPError as err:
        outcomes.append(f"error: {err!r}")


def test_a_daemon_killed_under_load_fails_only_its_streams_and_is_readmitted(cluster):
    stream_outcomes: list[str] = []
    streams = [threading.Thread(target=_read_stream, args=(cluster.router.base_url, cluster.model, stream_outcomes))
               for _ in range(3)]
    for thread in streams:
        thread.start()
    # the same prompt: the cache-aware router keeps the streams on one daemon; that one dies
    wait_until(lambda: any(_stat(d, "num_active") >= 3 for d in cluster.daemons), timeout_s=60)
    victim = next(i for i, d in enumerate(cluster.daemons) if _stat(d, "num_active") >= 3)
    load = Load(cluster, num_callers=4)
    wait_until(lambda: load.num_answered >= 8, timeout_s=60)
    cluster.daemons[victim].process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not cluster.router.health_of_workers()[cluster.hosts[victim].url], timeout_s=60)
    unhealthy_after_s = time.monotonic() - killed_at
    for thread in streams:
        thread.join(60)
    num_answered_before = load.num_answered
    wait_until(lambda: load.num_answered >= num_answered_before + 8, timeout_s=60)  # served by the other alone
    cluster.daemons[victim].process.wait(10)
    cluster.restart(victim)
    load.stop()
    print(f"marked unhealthy {unhealthy_after_s:.1f} s after SIGKILL; {load.num_answered} requests answered")
    assert load.failures == []
    assert unhealthy_after_s <= UNHEALTHY_WITHIN_S
    assert len(stream_outcomes) == 3 and "hung" not in stream_outcomes
    assert all(outcome.startswith("error") for outcome in stream_outcomes), stream_outcomes


def test_a_rolling_restart_loses_no_request(cluster):
    # The official client's default retries: in the second between a daemon's exit and the
    # router's next health check, smg may answer a request it sent there with a 500.
    load = Load(cluster, num_callers=4, max_retries=2)
    try:
        for index, daemon in enumerate(cluster.daemons):
            wait_until(lambda: load.num_answered >= 4, timeout_s=60)
            assert daemon.stop() == 0, daemon.log()  # SIGTERM: /health says 503 at once, what it runs finishes
            cluster.restart(index)
            num_before = load.num_answered
            wait_until(lambda: load.num_answered >= num_before + 4, timeout_s=60)
    finally:
        load.stop()
    assert load.failures == []
    assert load.num_answered >= 8


def test_cbatch_submit_through_the_router_resumes_after_an_interrupt(cluster, tmp_path):
    num_lines = 200  # seconds of work on the tiny model: still running when interrupted, on a quiet machine too
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"item {i}", "max_tokens": 60, **GREEDY}) + "\n"
                               for i in range(num_lines)))
    (tmp_path / "key").write_text(API_KEY + "\n")
    command = [str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(output), "--max-in-flight", "4",
               "--url", f"{cluster.router.base_url}/v1", "--api-key-file", str(tmp_path / "key")]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    wait_until(lambda: output.exists() and output.read_text().count("\n") >= 3, timeout_s=60, poll_s=0.02)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    written = output.read_text().count("\n")
    assert process.returncode == EXIT_INTERRUPTED, stderr
    assert 3 <= written < num_lines, stderr

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{num_lines - written} lines written, {num_lines - written} ok" in resumed.stderr
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"q{i}" for i in range(num_lines)]
    assert all(line["usage"]["completion_tokens"] == 60 for line in lines)
    with cluster.daemons[0].client() as client:  # the same text as the daemon gives directly
        assert client.generate(prompt="item 7", max_tokens=60, **GREEDY).text == lines[7]["text"]


def test_cbatch_submit_through_the_router_loses_no_line_to_a_rolling_restart(cluster, tmp_path):
    """Each daemon in turn drains and is restarted while a file runs through the router: the
    lines a draining daemon refuses are sent again (to the other daemon), none written as
    an error, and the run needs no --resume."""
    num_lines = 600  # still running when the second daemon drains, on a quiet machine too
    prompts, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"item {i}", "max_tokens": 60, **GREEDY}) + "\n"
                               for i in range(num_lines)))
    (tmp_path / "key").write_text(API_KEY + "\n")
    process = subprocess.Popen([str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(output),
                                "--max-in-flight", "4", "--url", f"{cluster.router.base_url}/v1",
                                "--api-key-file", str(tmp_path / "key")], stderr=subprocess.PIPE, text=True)
    try:
        for index, daemon in enumerate(cluster.daemons):
            num_before = output.read_text().count("\n") if output.exists() else 0
            wait_until(lambda: output.exists() and output.read_text().count("\n") >= num_before + 5, timeout_s=120)
            assert process.poll() is None  # else the restarts below would test nothing
            assert daemon.stop() == 0, daemon.log()
            cluster.restart(index)
        _, stderr = process.communicate(timeout=600)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, stderr
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"r{i}" for i in range(num_lines)]
    assert [line for line in lines if "error" in line] == []
