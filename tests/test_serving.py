"""The whole system through real processes, sockets and shared memory (tiny model)."""

import asyncio
import json
import os
import subprocess
import threading
import time

import pytest
from common import GREEDY, without_cached
from daemonkit import SCRIPTS_DIR, Daemon, pid_alive, serve_module, wait_until
from enginekit import generate

from cbatch.client.async_client import AsyncClient
from cbatch.config import EngineConfig
from cbatch.errors import CbatchError
from cbatch.workers.engine.engine import Engine

DAEMON_ARGS = ("--parallel", "4", "--ctx-size", "1024", "--batch-size", "64")


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    yield from serve_module(Daemon(tiny_model_path, *DAEMON_ARGS))


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """What the engine generates in-process for each request decoded alone, nothing reused
    from a cache: the ground truth for a request the daemon also decodes alone.
    llama.cpp's kernels are not batch invariant (a batch of another shape may flip a
    near-tie), so exact tokens are compared only where the daemon's batch is the same."""
    engine = Engine(EngineConfig(model_path=tiny_model_path, parallel=4, ctx_size=1024, batch_size=64,
                                 prefix_cache=False))
    yield lambda bodies: [generate(engine, [body])[0] for body in bodies]
    engine.close()


BODIES = [{"prompt": f"prompt {i} " + "z" * (7 * i), "max_tokens": 10 + 3 * i, **GREEDY} for i in range(6)]


def tagged(bodies: list[dict], tag: str) -> list[dict]:
    """The bodies with prompts the daemon's prefix cache has not seen: they differ from every
    other test's within the first 16-token block, the unit the cache shares."""
    return [{**body, "prompt": f"{tag} {body['prompt']}"} for body in bodies]


def generate_alone(client, bodies: list[dict]) -> list:
    """Each request decoded alone (the daemon idle before each), so its batch is controlled."""
    wait_until(lambda: client.stats()["num_in_flight"] == 0, timeout_s=60.0)
    return [client.generate(**body) for body in bodies]


@pytest.mark.parametrize("use_ring", [True, False], ids=["ring", "relayed"])
def test_client_reads_exactly_what_the_worker_generated(daemon, reference, use_ring):
    bodies = tagged(BODIES, "ring" if use_ring else "relayed")
    expected = reference(bodies)
    with daemon.client(use_ring=use_ring) as client:
        assert client.info["use_ring"] is use_ring
        results = generate_alone(client, bodies)
    for got, want in zip(results, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert without_cached(got.usage) == without_cached(want.usage) and got.finish_reason == "length"


def test_streamed_chunks_add_up_and_end_with_the_finish(daemon, reference):
    body = tagged([BODIES[3]], "stream")[0]
    want = reference([body])[0]
    with daemon.client() as client:
        wait_until(lambda: client.stats()["num_in_flight"] == 0, timeout_s=60.0)  # decoded alone
        chunks = list(client.stream(**body))
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length" and without_cached(chunks[-1].usage) == without_cached(want.usage)
    assert sum((c.token_ids for c in chunks), []) == want.token_ids
    assert "".join(c.text for c in chunks) == want.text


def test_generate_batch_applies_per_item_parameters_and_reports_bad_items(daemon):
    items = [
        {"id": "short", "prompt": "a", "max_tokens": 3, **GREEDY},
        {"id": "long", "prompt": "a", "max_tokens": 17, **GREEDY},
        {"id": "bad", "prompt": "a", "top_p": 7},
        {"id": "sampled", "prompt": "a", "max_tokens": 9, "temperature": 1.5, "seed": 3, "ignore_eos": True},
        {"id": "stopped", "prompt": "a", "max_tokens": 40, "stop": ["*"], **GREEDY},
    ]
    with daemon.client() as client:
        short, long_, bad, sampled, stopped = client.generate_batch(items)
    assert (short.id, len(short.token_ids)) == ("short", 3)
    assert (long_.id, len(long_.token_ids)) == ("long", 17)
    assert isinstance(bad, CbatchError) and bad.code == "invalid_request" and "top_p" in bad.message
    with daemon.client() as client:
        unencodable, huge, fine = client.generate_batch([
            {"prompt": "a", "stop": {"a"}}, {"prompt": "z" * (5 << 20)}, {"prompt": "a", "max_tokens": 2}])
    assert isinstance(unencodable, CbatchError) and unencodable.code == "invalid_request"
    assert isinstance(huge, CbatchError) and huge.code == "invalid_request" and "limit" in huge.message
    assert len(fine.token_ids) == 2
    assert len(sampled.token_ids) == 9 and sampled.token_ids != long_.token_ids[:9]
    assert "*" not in stopped.text


def test_stream_batch_is_keyed_by_item_id(daemon):
    items = [{"id": f"item-{i}", "prompt": f"p{i}", "max_tokens": 6 + i, **GREEDY} for i in range(5)]
    with daemon.client() as client:
        num_tokens, finished = {}, {}
        for position, chunk in client.stream_batch(items, max_in_flight=2):
            assert chunk.id == items[position]["id"] and chunk.id not in finished
            num_tokens[chunk.id] = num_tokens.get(chunk.id, 0) + len(chunk.token_ids)
            if chunk.finish_reason:
                finished[chunk.id] = chunk.usage["completion_tokens"]
        batch = client.generate_batch(items)
    ids = [item["id"] for item in items]
    assert sorted(finished) == ids and num_tokens == finished == {f"item-{i}": 6 + i for i in range(5)}
    assert [c.id for c in batch] == ids and [len(c.token_ids) for c in batch] == [6 + i for i in range(5)]


def test_concurrent_clients_each_get_only_their_own(daemon, reference):
    # Six clients at once: the batch is not controlled, so what marks each client's own
    # completions is their shape: a prompt and a length no other client asked for.
    bodies = [{"prompt": f"client {i} " + "c" * (5 * i), "max_tokens": 20 + 4 * i, **GREEDY} for i in range(6)]
    num_prompt_tokens = [want.usage["prompt_tokens"] for want in reference(bodies)]
    assert len(set(num_prompt_tokens)) == 6
    results, errors = {}, []

    def run(i):
        try:
            with daemon.client(use_ring=i % 2 == 0) as client:
                results[i] = [client.generate(**bodies[i]) for _ in range(2)]
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not [t for t in threads if t.is_alive()], "a client thread hung"
    assert not errors and sorted(results) == list(range(6))
    for i, completions in results.items():
        for c in completions:
            assert without_cached(c.usage) == {"prompt_tokens": num_prompt_tokens[i], "completion_tokens": 20 + 4 * i}
            assert len(c.token_ids) == 20 + 4 * i and c.finish_reason == "length"


def test_cancel_from_the_client_keeps_what_was_produced(daemon):
    with daemon.client() as client:
        stream = client.submit(prompt="cancel me", max_tokens=200, **GREEDY)
        chunks = client.read(stream)
        first = [next(chunks) for _ in range(3)]
        client.cancel(stream.request_id)
        rest = list(chunks)
    final = rest[-1]
    assert final.finish_reason == "cancelled"
    num_tokens = sum(len(c.token_ids) for c in first + rest)
    assert 3 <= num_tokens == final.usage["completion_tokens"] < 200


def test_health_and_stats(daemon):
    with daemon.client() as client:
        health = client.health()
        assert health["status"] == "ok" and health["parallel"] == 4
        assert health["worker_pid"] != daemon.process.pid and pid_alive(health["worker_pid"])
        wait_until(lambda: client.stats()["num_in_flight"] == 0, timeout_s=60.0)
        before = client.stats()["num_requests_by_outcome"].get("length", 0)
        client.generate_batch([{"prompt": "s", "max_tokens": 30, **GREEDY}] * 4)
        # The front-end counts finishes itself; the worker's figures reach it every 0.25 s.
        wait_until(lambda: client.stats()["num_active"] == 0, timeout_s=60.0)
        stats = client.stats()
    assert stats["num_requests_by_outcome"]["length"] == before + 4
    assert stats["num_requests_ended"] >= 4 and stats["num_in_flight"] == 0
    assert stats["num_active"] == 0 and stats["num_queued"] == 0 and stats["parallel"] == 4
    assert stats["decode_tokens_per_s"] > 0 and stats["avg_concurrent_seqs"] >= 1


def test_async_client_runs_many_coroutines_at_once(daemon, reference):
    expected = reference(BODIES)  # for the shapes only: these requests share their batches

    async def main():
        client = await AsyncClient.connect(daemon.endpoint)
        try:
            singles = await asyncio.gather(*(client.generate(**body) for body in BODIES))
            batch = await client.generate_batch([{"id": i, **body} for i, body in enumerate(BODIES)], max_in_flight=3)
            chunks = [c async for c in client.stream(**BODIES[0])]
            keyed = [(position, chunk.id) async for position, chunk in
                     client.stream_batch([{"id": f"k{i}", **body} for i, body in enumerate(BODIES[:3])],
                                         max_in_flight=2)]
            health = await client.health()
        finally:
            await client.close()
        return singles, batch, chunks, keyed, health

    singles, batch, chunks, keyed, health = asyncio.run(main())
    assert all(label == f"k{position}" for position, label in keyed)
    assert sorted({position for position, _ in keyed}) == [0, 1, 2]
    assert ([without_cached(c.usage) for c in singles] == [without_cached(c.usage) for c in batch]
            == [without_cached(e.usage) for e in expected])
    assert [len(c.token_ids) for c in singles + batch] == [len(e.token_ids) for e in expected] * 2
    assert [c.id for c in batch] == list(range(6))
    assert len(sum((c.token_ids for c in chunks), [])) == chunks[-1].usage["completion_tokens"] == 10
    assert health["status"] == "ok"


def test_submit_cli_writes_every_line_in_order(daemon, tmp_path):
    lines = [
        json.dumps({"id": "a", "prompt": "first", "max_tokens": 5, **GREEDY}),
        "{not json",
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "hi"}]}),  # tiny model: no template
        "",
        json.dumps({"prompt": "no id", "max_tokens": 7, **GREEDY}),
        json.dumps({"id": "bad", "prompt": "x", "max_tokens": -1}),
    ] + [json.dumps({"id": f"bulk-{i}", "prompt": "b" * i, "max_tokens": 4, **GREEDY}) for i in range(1, 30)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(out), "--max-in-flight", "8"],
                         env=daemon.env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr  # some lines failed
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["a", 2, "c", 5, "bad"] + [f"bulk-{i}" for i in range(1, 30)]
    assert results[0]["finish_reason"] == "length" and results[0]["usage"]["completion_tokens"] == 5
    assert results[1]["error"]["code"] == "invalid_request" and "line 2" in results[1]["error"]["message"]
    assert results[2]["error"]["code"] == "invalid_request" and "chat template" in results[2]["error"]["message"]
    assert results[3]["usage"]["completion_tokens"] == 7
    assert results[4]["error"]["code"] == "invalid_request" and "max_tokens" in results[4]["error"]["message"]
    assert all(r["usage"]["completion_tokens"] == 4 for r in results[5:])
    assert "34 lines written, 31 ok, 3 failed" in run.stderr


def test_submit_cli_missing_file_and_unreachable_endpoint(daemon, tmp_path):
    submit = str(SCRIPTS_DIR / "cbatch-submit")
    missing = subprocess.run([submit, str(tmp_path / "nope.jsonl")], env=daemon.env, capture_output=True, text=True)
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    prompts = tmp_path / "ok.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    nobody = subprocess.run([submit, str(prompts), "--endpoint", f"ipc://{tmp_path}/nobody.sock"],
                            env=daemon.env, capture_output=True, text=True)
    assert nobody.returncode == 3 and "no cbatch daemon answers" in nobody.stderr
    earlier = tmp_path / "earlier.jsonl"  # an earlier run's results, which --resume would use
    earlier.write_text("".join(json.dumps({"id": str(i), "text": "kept"}) + "\n" for i in range(8)))
    kept = subprocess.run([submit, str(prompts), "-o", str(earlier), "--endpoint", f"ipc://{tmp_path}/nobody.sock"],
                          env=daemon.env, capture_output=True, text=True)
    assert kept.returncode == 3 and earlier.read_text().count("\n") == 8
    unwritable = subprocess.run([submit, str(prompts), "-o", str(tmp_path / "missing" / "out.jsonl")],
                                env=daemon.env, capture_output=True, text=True)
    assert unwritable.returncode == 2 and unwritable.stderr.count("\n") == 1 and "cannot write" in unwritable.stderr


def test_stopped_daemon_leaves_no_process_segment_or_socket(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, *DAEMON_ARGS)
    ring_name, worker_pid = d.ring_name(), d.health["worker_pid"]
    with d.client() as client:
        client.generate(prompt="x", max_tokens=3)
    assert os.path.exists(f"/dev/shm/{ring_name}")
    assert d.stop() == 0
    deadline = time.monotonic() + 60
    while pid_alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(worker_pid)
    assert not os.path.exists(f"/dev/shm/{ring_name}")
    assert d.leftovers() == []
    assert "ready" in d.log() and "stopped" in d.log()


def test_n_choices_share_the_prompt_and_come_back_in_order(daemon, reference):
    body = {"prompt": "a shared prompt " * 8, "max_tokens": 12}
    want = reference([{**body, **GREEDY}])[0]
    with daemon.client() as client:
        reused_before = client.stats()["prompt_tokens_reused"]
        greedy = client.generate(**body, **GREEDY, n=3)
        expected_reused = 2 * ((want.usage["prompt_tokens"] - 1) // 16) * 16
        deadline = time.monotonic() + 60.0  # the worker's stats reach the front-end every 0.25 s
        while (reused := client.stats()["prompt_tokens_reused"] - reused_before) < expected_reused:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        sampled = client.generate(**body, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11, n=4)
    assert [c.id for c in greedy] == [0, 1, 2]
    # Not compared with `want` token by token: the choices share batches and cached KV.
    assert all(without_cached(c.usage) == without_cached(want.usage) and len(c.token_ids) == 12 for c in greedy)
    # The second and third choices reused every whole block of the first's prompt.
    assert reused >= expected_reused > 0
    assert len({tuple(c.token_ids) for c in sampled}) > 1, "each choice has its own sampler and seed"


def test_submit_cli_returns_n_choices_per_line(daemon, tmp_path):
    lines = [{"id": "one", "prompt": "first", "max_tokens": 5, **GREEDY},
             {"id": "three", "prompt": "several", "max_tokens": 6, "n": 3, **GREEDY},
             {"id": "bad", "prompt": "x", "n": 0}]
    prompts = tmp_path / "n.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "n-results.jsonl"
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(prompts), "-o", str(out)],
                         env=daemon.env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    one, three, bad = [json.loads(line) for line in out.read_text().splitlines()]
    assert "choices" not in one and one["usage"]["completion_tokens"] == 5
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert [c["usage"]["completion_tokens"] for c in three["choices"]] == [6, 6, 6]
    assert three["usage"]["completion_tokens"] == 18
    assert bad["error"]["code"] == "invalid_request" and "n must be" in bad["error"]["message"]


def test_closing_a_client_with_an_open_stream_is_quiet(daemon):
    client = daemon.client()
    stream = client.stream(prompt="still open", max_tokens=50, **GREEDY)
    next(stream)
    client.close()
    stream.close()  # the iterator's cleanup runs after its client is gone: no socket error
    with daemon.client() as other:
        assert len(other.generate(prompt="x", max_tokens=3, **GREEDY).token_ids) == 3


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_stream_batch_pulls_items_only_as_requests_finish(daemon, is_async):
    pulled = []

    def endless():
        for i in range(1_000_000):
            pulled.append(i)
            yield {"id": i, "prompt": f"item {i}", "max_tokens": 3, **GREEDY}

    async def first_finishes_async(count):
        client = await AsyncClient.connect(daemon.endpoint)
        try:
            done = []
            async for position, chunk in client.stream_batch(endless(), max_in_flight=4):
                if chunk.finish_reason:
                    done.append(position)
                    assert len(pulled) <= 4 + len(done)
                    if len(done) == count:
                        return done
        finally:
            await client.close()

    def first_finishes(count):
        with daemon.client() as client:
            done = []
            for position, chunk in client.stream_batch(endless(), max_in_flight=4):
                if chunk.finish_reason:
                    done.append(position)
                    assert len(pulled) <= 4 + len(done)
                    if len(done) == count:
                        return done

    done = asyncio.run(first_finishes_async(10)) if is_async else first_finishes(10)
    assert len(done) == 10 and len(pulled) <= 14


def test_a_client_left_unclosed_in_a_reference_cycle_is_collected_without_blocking(daemon):
    import gc

    def forget_a_client():
        client = daemon.client()
        client.generate(prompt="x", max_tokens=2, **GREEDY)
        client.cycle = client  # only the cycle collector can free it now

    forget_a_client()
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(10)
    assert not collector.is_alive(), "the garbage collector blocked on a forgotten client"


def test_requests_submitted_just_before_close_do_not_run_on(daemon):
    client = daemon.client()
    for _ in range(50):
        client.submit(prompt="abandoned", max_tokens=2000, **GREEDY)
    client.close()
    with daemon.client() as other:
        deadline = time.monotonic() + 10.0  # well before 50 requests of 2000 tokens could end
        while other.stats()["num_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert other.stats()["num_in_flight"] == 0, "a closed client's requests are still running"


def test_a_client_cannot_cancel_another_clients_request(daemon):
    with daemon.client() as client, daemon.client() as other:
        stream = client.submit(prompt="not yours", max_tokens=200, **GREEDY)
        chunks = client.read(stream)
        first = next(chunks)
        other.cancel(stream.request_id)
        # A round trip after the cancel: the front-end has handled it, and the request was
        # still running then (else this test could not tell an ignored cancel from a late one).
        assert other.stats()["num_in_flight"] >= 1
        rest = list(chunks)
    assert rest[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in [first, *rest]) == 200
