"""The OpenAI API's details through the official openai package, against a real daemon
with --http on the chat model (SmolLM2, which has a chat template): model names and
aliases, system_fingerprint, the role-only first chunk, content parts, the top_logprobs
error, the access log and the -ngl warning of a CPU build."""

import re

import httpx
import llama_cpp
import openai
import pytest
from daemonkit import serve_module, wait_until
from httpkit import HttpDaemon

from cbatch.model import CHAT_MODEL_FILE, chat_model_path

ALIASES = ("gpt-3.5-turbo", "local")
HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def daemon():
    yield from serve_module(HttpDaemon(chat_model_path(), "--parallel", "2", "--ctx-size", "2048",
                                       "--alias", ALIASES[0], "--alias", ALIASES[1], "-ngl", "99"))


def test_models_lists_the_file_name_then_the_aliases(api):
    assert [m.id for m in api.models.list().data] == [CHAT_MODEL_FILE, *ALIASES]


def test_models_tell_the_context_each_request_gets_under_every_name_clients_read(daemon, api):
    """--ctx-size 2048 over --parallel 2: 1024 tokens a sequence, in OpenRouter's, vLLM's
    and llama-server's fields; SmolLM2 was trained on 8192. One model by its id, a 404 for
    another; Anthropic's list shape for a request with anthropic-version."""
    served = [CHAT_MODEL_FILE, *ALIASES]
    for model in api.models.list().data:
        extra = model.model_extra
        assert extra["context_length"] == extra["max_model_len"] == extra["meta"]["n_ctx"] == 1024
        assert extra["meta"]["n_ctx_train"] == 8192
    one = httpx.get(f"{daemon.base_url}/v1/models/{ALIASES[0]}", timeout=10).json()
    assert one["id"] == ALIASES[0] and one["context_length"] == 1024
    missing = httpx.get(f"{daemon.base_url}/v1/models/gpt-4", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    listed = httpx.get(f"{daemon.base_url}/v1/models", headers={"anthropic-version": "2023-06-01"}, timeout=10).json()
    assert [entry["id"] for entry in listed["data"]] == served and listed["has_more"] is False
    assert listed["data"][0]["type"] == "model" and listed["first_id"] == served[0] and listed["last_id"] == served[-1]


def test_an_alias_is_served_and_echoed_and_an_unknown_name_is_a_404_naming_the_served_ones(api):
    reply = api.completions.create(model="local", prompt="Hello", max_tokens=3, temperature=0)
    assert reply.model == "local" and reply.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="gpt-4", prompt="Hello", max_tokens=3)
    error = caught.value.body
    assert error["code"] == "not_found" and error["param"] == "model"
    assert all(repr(name) in error["message"] for name in (CHAT_MODEL_FILE, *ALIASES)), error


def test_responses_and_chunks_carry_one_system_fingerprint(api):
    whole = api.chat.completions.create(model=ALIASES[0], messages=HELLO, max_tokens=4, temperature=0)
    chunks = list(api.chat.completions.create(model=ALIASES[0], messages=HELLO, max_tokens=4, temperature=0,
                                              stream=True))
    text = api.completions.create(model=ALIASES[0], prompt="Hi", max_tokens=2, temperature=0)
    assert re.fullmatch(r"fp_[0-9a-f]{10}", whole.system_fingerprint)
    assert {c.system_fingerprint for c in chunks} == {whole.system_fingerprint} == {text.system_fingerprint}


def test_the_first_streamed_chat_chunk_carries_the_role_alone(api):
    chunks = list(api.chat.completions.create(model=CHAT_MODEL_FILE, messages=HELLO, max_tokens=6, temperature=0,
                                              n=2, seed=1, stream=True))
    for choice in (0, 1):
        deltas = [c.choices[0].delta for c in chunks if c.choices[0].index == choice]
        assert deltas[0].role == "assistant" and deltas[0].content == "", deltas[0]
        assert all(d.role is None for d in deltas[1:])
        assert "".join(d.content or "" for d in deltas[1:])


def test_text_content_parts_are_joined_with_a_newline(api):
    def prompt_tokens(content):
        messages = [{"role": "user", "content": content}]
        return api.chat.completions.create(model=CHAT_MODEL_FILE, messages=messages, max_tokens=1).usage.prompt_tokens

    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book?"}]
    assert prompt_tokens(parts) == prompt_tokens("What is\nthe best book?")
    assert prompt_tokens(parts) != prompt_tokens("What isthe best book?")


def test_a_bad_top_logprobs_is_a_400_naming_top_logprobs(api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=CHAT_MODEL_FILE, messages=HELLO, max_tokens=2, logprobs=True,
                                    top_logprobs=21)
    error = caught.value.body
    assert error["param"] == "top_logprobs" and error["message"].startswith("top_logprobs must be")


def test_every_request_gets_one_access_log_line_with_its_status_and_error_code(daemon, api):
    def count(pattern: str) -> int:
        return sum(bool(re.search(pattern, line)) for line in daemon.log().splitlines())

    ok, refused = r'"POST /v1/completions" 200 - \d+\.\d{3}s$', '"POST /v1/completions" 404 not_found'
    num_ok, num_refused = count(ok), count(refused)
    api.completions.create(model="local", prompt="Hi", max_tokens=2)
    httpx.post(f"{daemon.base_url}/v1/completions", json={"model": "nope", "prompt": "x"})
    httpx.get(f"{daemon.base_url}/v1/nowhere")
    wait_until(lambda: count('"GET /v1/nowhere" 404 not_found') == 1, timeout_s=60.0)
    assert (count(ok), count(refused)) == (num_ok + 1, num_refused + 1)


def test_gpu_layers_on_a_cpu_build_warn_that_no_gpu_is_used(daemon):
    warned = "-ngl 99 has no effect" in daemon.log()
    assert warned == (not llama_cpp.llama_supports_gpu_offload())
