"""Embeddings end to end: real daemons (the tiny causal LM, and the tiny BERT that only
embeds), real llama_decode, the ZeroMQ clients and the openai package over HTTP."""

import asyncio
import base64
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import REPO, load_script
from daemonkit import SCRIPTS_DIR, serve_module
from httpkit import HttpDaemon

from cbatch.client import AsyncClient
from cbatch.errors import INVALID_REQUEST, MODEL_EMBEDS_ONLY, PROMPT_TOO_LONG, CbatchError

DAEMON_ARGS = ("--parallel", "2", "--ctx-size", "1024", "--batch-size", "256")
TEXTS = [f"the cat {i} sat on mat {i * 7}" for i in range(15)]
PROBE = "hello world"
TOLERANCE = 5e-4  # a causal model's KV cache holds float16; sums run in another order in another batch


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-bert"])
def daemon(request, tiny_model_path, tiny_bert_path):
    model_path = tiny_model_path if request.param == "tiny-llama" else tiny_bert_path
    daemon = HttpDaemon(model_path, *DAEMON_ARGS)
    daemon.model_path = model_path
    yield from serve_module(daemon)


@pytest.fixture
def model_id(daemon) -> str:
    return daemon.openai().models.list().data[0].id


def test_same_text_same_vector_alone_or_in_a_batch_of_16(daemon):
    with daemon.client() as client:
        alone = np.array(client.embed(PROBE))
        batch = np.array(client.embed(TEXTS[:7] + [PROBE] + TEXTS[7:]))
    assert alone.shape == (1, batch.shape[1]) and batch.shape[0] == 16
    assert np.allclose(alone[0], batch[7], atol=TOLERANCE)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=TOLERANCE)  # L2-normalized
    distinct = {tuple(np.round(vector, 4)) for vector in batch}
    assert len(distinct) == 16  # different texts, different vectors


def settled_stats(client, num_inputs: int) -> dict:
    """stats() once they count `num_inputs` embedded (the worker's reach the front-end every
    0.25 s), or after 60 s."""
    deadline_s = time.monotonic() + 60
    while (stats := client.stats())["num_embedding_inputs"] < num_inputs and time.monotonic() < deadline_s:
        time.sleep(0.05)
    return stats


def test_callers_waiting_together_share_a_decode(daemon):
    async def main():
        async with await AsyncClient.connect(daemon.endpoint) as client:
            return await asyncio.gather(*(client.embed(text) for text in TEXTS))

    with daemon.client() as client:
        before = settled_stats(client, 0)
        vectors = asyncio.run(main())
        after = settled_stats(client, before["num_embedding_inputs"] + len(TEXTS))
        assert np.allclose(np.array([v[0] for v in vectors]), client.embed(TEXTS), atol=TOLERANCE)
    num_decodes = after["num_embedding_decodes"] - before["num_embedding_decodes"]
    assert after["num_embedding_inputs"] - before["num_embedding_inputs"] == len(TEXTS)
    assert num_decodes < len(TEXTS)  # several callers' inputs went in one llama_decode


def test_token_id_inputs_embed_as_their_text(daemon):
    with daemon.client() as client:
        text_vector = client.embed(PROBE)[0]
    info = daemon.openai().embeddings.create(model=daemon.openai().models.list().data[0].id, input=PROBE)
    token_ids = _token_ids(daemon.model_path, PROBE)
    with daemon.client() as client:
        assert np.allclose(client.embed([token_ids])[0], text_vector, atol=TOLERANCE)
    assert info.usage.prompt_tokens == len(token_ids)


def _token_ids(model_path: str, text: str) -> list[int]:
    """The model's tokens for the text, from llama.cpp's tokenizer in this process."""
    import llama_cpp.llama_cpp as lc

    model = lc.llama_model_load_from_file(model_path.encode(), lc.llama_model_default_params())
    try:
        data = text.encode()
        tokens = (lc.llama_token * 64)()
        n = lc.llama_tokenize(lc.llama_model_get_vocab(model), data, len(data), tokens, 64, True, True)
        return tokens[:n]
    finally:
        lc.llama_model_free(model)


def test_openai_package_float_and_base64_agree(daemon, model_id):
    api = daemon.openai()
    floats = api.embeddings.create(model=model_id, input=[PROBE, TEXTS[0]], encoding_format="float")
    encoded = api.embeddings.create(model=model_id, input=[PROBE, TEXTS[0]], encoding_format="base64")
    assert floats.model == model_id and [d.index for d in floats.data] == [0, 1]
    for as_float, as_base64 in zip(floats.data, encoded.data):
        decoded = np.frombuffer(base64.b64decode(as_base64.embedding), "<f4")
        assert np.array_equal(decoded, np.array(as_float.embedding, np.float32))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    with daemon.client() as client:
        assert np.allclose(client.embed(PROBE)[0], floats.data[0].embedding, atol=TOLERANCE)


def test_metrics_count_embeddings(daemon, model_id):
    with daemon.client() as client:
        num_inputs_before = client.stats()["num_embedding_inputs"]
        before = daemon.metrics()
        usage = daemon.openai().embeddings.create(model=model_id, input=[PROBE, TEXTS[1], TEXTS[2]]).usage
        deadline_s = time.monotonic() + 60  # the worker's stats reach the front-end every 0.25 s
        while client.stats()["num_embedding_inputs"] < num_inputs_before + 3 and time.monotonic() < deadline_s:
            time.sleep(0.05)
    after = daemon.metrics()

    def moved(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0)

    assert moved("cbatch_http_requests_total", (("endpoint", "embeddings"), ("finish_reason", "embedded"))) == 1
    assert moved("cbatch_http_prompt_tokens_total") == usage.prompt_tokens
    assert after[("cbatch_embedding_inputs_total", ())] == num_inputs_before + 3
    assert moved("cbatch_embedding_decodes_total") >= 1


@pytest.mark.parametrize("body, status, code", [
    ({"input": ""}, 400, INVALID_REQUEST),
    ({"input": []}, 400, INVALID_REQUEST),
    ({"input": [PROBE] * 2049}, 400, INVALID_REQUEST),
    ({"input": [1.5, 2]}, 400, INVALID_REQUEST),
    ({"input": {"text": PROBE}}, 400, INVALID_REQUEST),
    ({"input": "word " * 300}, 400, PROMPT_TOO_LONG),
    ({"input": PROBE, "dimensions": 3}, 400, INVALID_REQUEST),
    ({"input": PROBE, "encoding_format": "hex"}, 400, INVALID_REQUEST),
    ({"input": PROBE, "model": "another.gguf"}, 404, "not_found"),
])
def test_bad_input_is_refused_and_the_daemon_carries_on(daemon, body, status, code):
    response = httpx.post(f"{daemon.base_url}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    with daemon.client() as client:
        assert len(client.embed(PROBE)) == 1


def test_client_errors_have_codes(daemon):
    with daemon.client() as client:
        with pytest.raises(CbatchError) as too_long:
            client.embed("word " * 300)
        with pytest.raises(CbatchError) as empty:
            client.embed([])
        assert len(client.embed([PROBE] * 200)) == 200  # more than one message's worth
    assert (too_long.value.code, empty.value.code) == (PROMPT_TOO_LONG, INVALID_REQUEST)


def test_generation_keeps_flowing_while_embeddings_run(daemon, model_id):
    if "bert" in model_id:
        pytest.skip("the BERT model does not generate")
    is_streaming = threading.Event()
    num_embedded_during_stream = []

    def embed_load():
        with daemon.client() as client:
            client.embed(TEXTS)
            is_streaming.wait()
            num_embedded = 0
            while is_streaming.is_set():
                num_embedded += len(client.embed(TEXTS * 4))
            num_embedded_during_stream.append(num_embedded)

    loader = threading.Thread(target=embed_load)
    loader.start()
    with daemon.client() as client:
        is_streaming.set()
        chunks = list(client.stream("Once", max_tokens=200, ignore_eos=True))
        is_streaming.clear()
    loader.join()
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage["completion_tokens"] == 200
    assert num_embedded_during_stream[0] > 0  # embeddings ran beside it


def test_beside_a_generation_an_embedding_gets_the_same_vectors_in_no_fewer_decodes(daemon, model_id):
    """Idle, a decode takes as many inputs as --batch-size holds; while a sequence generates
    it takes about a step's time of them (embedder.py; the sizing itself is checked in
    test_embed_budget.py, since on a busy machine a step's time may hold them all), so the
    same inputs need as many decodes or more, and get the same vectors."""
    if "bert" in model_id:
        pytest.skip("the BERT model does not generate")

    def embed_counting_decodes(client, then=lambda: None) -> tuple[np.ndarray, int]:
        before = settled_stats(client, 0)
        vectors = np.array(client.embed(TEXTS))
        then()
        after = settled_stats(client, before["num_embedding_inputs"] + len(TEXTS))
        return vectors, after["num_embedding_decodes"] - before["num_embedding_decodes"]

    with daemon.client() as client, daemon.client() as generating:
        idle_vectors, idle = embed_counting_decodes(client)
        stream = generating.submit("Once", max_tokens=500, ignore_eos=True)
        chunks = generating.read(stream)
        next(chunks)
        beside_vectors, beside = embed_counting_decodes(client, then=lambda: generating.cancel(stream.request_id))
        last = list(chunks)[-1]
    assert last.finish_reason == "cancelled"  # it generated from before the embedding to after it
    assert beside >= idle >= 1
    assert np.allclose(beside_vectors, idle_vectors, atol=TOLERANCE)


def test_a_cancelled_embedding_charges_its_tenant_what_was_decoded(daemon):
    """A caller that gives up on a long embedding call pays for the tokens the worker decoded
    for it, no more and no less, so that tokens_per_min bounds embed-and-cancel too."""
    inputs = [f"{TEXTS[i % len(TEXTS)]} " * 9 for i in range(2048)]  # 64 messages of 32 inputs

    def charged(stats: dict) -> int:
        return stats["tenants"].get("default", {}).get("num_prompt_tokens", 0)

    async def embed_then_cancel(client) -> dict:
        before = await client.stats()
        call = asyncio.create_task(client.embeddings(inputs))
        while (await client.stats())["num_embedding_inputs"] == before["num_embedding_inputs"]:
            assert not call.done(), "the call finished before it could be cancelled"
            await asyncio.sleep(0.02)
        call.cancel()
        while (stats := await client.stats())["tenants"].get("default", {}).get("num_in_flight"):
            await asyncio.sleep(0.05)
        # The worker's counters reach the front-end every 0.25 s; its cancel replies come first.
        deadline_s = time.monotonic() + 60
        while charged(stats) - charged(before) != stats["num_embedding_tokens"] - before["num_embedding_tokens"] \
                and time.monotonic() < deadline_s:
            await asyncio.sleep(0.05)
            stats = await client.stats()
        return before, stats

    async def main():
        async with await AsyncClient.connect(daemon.endpoint) as client:
            return await embed_then_cancel(client)

    before, after = asyncio.run(main())
    decoded = after["num_embedding_tokens"] - before["num_embedding_tokens"]
    assert decoded > 0 and charged(after) - charged(before) == decoded
    assert after["num_embedding_inputs"] - before["num_embedding_inputs"] < len(inputs)  # the cancel cut it short


def test_embedding_only_model_refuses_generation(daemon, model_id):
    if "bert" not in model_id:
        pytest.skip("the causal model generates")
    with pytest.raises(openai.BadRequestError) as refused:
        daemon.openai().completions.create(model=model_id, prompt=PROBE, max_tokens=2)
    assert refused.value.code == MODEL_EMBEDS_ONLY
    with daemon.client() as client:
        with pytest.raises(CbatchError) as also_refused:
            client.generate(PROBE, max_tokens=2)
        assert also_refused.value.code == MODEL_EMBEDS_ONLY
        assert client.stats()["embedding_pooling"] == "mean"  # declared in the GGUF


def test_pooling_flag_for_a_model_that_declares_none(start_daemon, tiny_model_path):
    vectors = {}
    for pooling in ("mean", "last"):
        with start_daemon(tiny_model_path, *DAEMON_ARGS, "--pooling", pooling).client() as client:
            vectors[pooling] = client.embed(PROBE)[0]
            assert client.stats()["embedding_pooling"] == pooling
    assert not np.allclose(vectors["mean"], vectors["last"], atol=1e-3)


def test_a_declared_pooling_wins_over_the_flag(start_daemon, tmp_path):
    cls_model = load_script("make_tiny_model").embedding.make_tiny_embedding_model(tmp_path / "cls.gguf", "cls")
    with start_daemon(cls_model, *DAEMON_ARGS, "--pooling", "last").client() as client:
        assert client.stats()["embedding_pooling"] == "cls"
        assert len(client.embed(PROBE)[0]) == 32


@pytest.mark.parametrize("transport", ["zmq", "http"])
def test_batch_file_embedding_lines(daemon, model_id, tmp_path, transport):
    lines = [{"custom_id": "two", "body": {"model": model_id, "input": [PROBE, TEXTS[0]]}},
             {"custom_id": "empty", "body": {"input": ""}},
             {"custom_id": "b64", "body": {"input": PROBE, "encoding_format": "base64"}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({**line, "method": "POST", "url": "/v1/embeddings"}) + "\n"
                                               for line in lines))
    url_args = ["--url", f"{daemon.base_url}/v1"] if transport == "http" else []
    done = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), *url_args, str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl")], env=daemon.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stderr  # the empty input's line failed
    two, empty, encoded = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert two["response"]["status_code"] == 200 and encoded["response"]["status_code"] == 200
    assert empty["response"]["status_code"] == 400
    assert empty["response"]["body"]["error"]["code"] == INVALID_REQUEST
    body = two["response"]["body"]
    assert body["object"] == "list" and body["model"] == model_id and body["usage"]["prompt_tokens"] > 0
    with daemon.client() as client:
        expected = client.embed([PROBE, TEXTS[0]])
    assert np.allclose([entry["embedding"] for entry in body["data"]], expected, atol=TOLERANCE)
    decoded = np.frombuffer(base64.b64decode(encoded["response"]["body"]["data"][0]["embedding"]), "<f4")
    assert np.allclose(decoded, expected[0], atol=TOLERANCE)
    # The summary says what the run did: 3 inputs embedded, with their prompt tokens; no token rate.
    num_prompt_tokens = body["usage"]["prompt_tokens"] + encoded["response"]["body"]["usage"]["prompt_tokens"]
    summary = done.stderr.splitlines()[-1]
    assert f"; 3 inputs embedded ({num_prompt_tokens} prompt tokens) in " in summary, done.stderr
    assert "tok/s" not in summary and "0 tokens" not in summary


DOCS_EXAMPLE = re.compile(r"<!-- readme-test: skip: run by tests/test_embeddings.py[^>]*-->\n```(\w*)\n(.*?)```", re.S)


def test_http_docs_examples_run_as_printed(daemon):
    """docs/http.md's embeddings examples, with this daemon's port for 8000."""
    (_, command), (_, code) = DOCS_EXAMPLE.findall((REPO / "docs" / "http.md").read_text())
    curl = command.strip().replace("8000", str(daemon.port))
    reply = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60,
                                      check=True).stdout)
    assert [item["index"] for item in reply["data"]] == [0, 1]
    out = subprocess.run([sys.executable, "-c", code.replace("8000", str(daemon.port))], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert int(out[0]) == len(reply["data"][0]["embedding"]) and int(out[1]) == reply["usage"]["prompt_tokens"]
    assert -1.0 <= float(out[2]) <= 1.0
