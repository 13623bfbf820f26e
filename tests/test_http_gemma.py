"""The HTTP endpoint on gemma-3-270m, where the output must make sense: chat, JSON
schema output, and the README's curl and openai examples run as printed."""

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO
from daemonkit import serve_module
from httpkit import HttpDaemon

README_PORT = "8000"


@pytest.fixture(scope="module")
def daemon(gemma_model_path):
    # the flags of docs/http.md's example, whose curl names the model by its alias
    yield from serve_module(HttpDaemon(gemma_model_path, "--parallel", "2", "--alias", "gemma-3-270m"))


def _model(api) -> str:
    return api.models.list().data[0].id


def test_chat_streamed_and_whole_agree(api):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = api.chat.completions.create(model=_model(api), messages=messages, max_tokens=6, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content.strip()  # a base model: chat turns are followed poorly
    chunks = list(api.chat.completions.create(model=_model(api), messages=messages, max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_n_whole_and_streamed(api):
    messages = [{"role": "user", "content": "Hi"}]
    whole = api.chat.completions.create(model=_model(api), messages=messages, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 10
    assert whole.choices[0].message.content == whole.choices[1].message.content
    chunks = list(api.chat.completions.create(model=_model(api), messages=messages, max_tokens=5, temperature=0, n=2,
                                              stream=True))
    for index in (0, 1):
        deltas = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "length"
        assert "".join(d.delta.content or "" for d in deltas) == whole.choices[index].message.content


def test_json_schema_output_parses_and_matches(api):
    schema = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 150}}}
    reply = api.chat.completions.create(
        model=_model(api), max_tokens=80, temperature=0,
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 8 and 0 <= person["age"] <= 150


def test_chat_logprobs(api):
    reply = api.chat.completions.create(model=_model(api), messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0.0 for entry in content)


def test_logprobs_under_min_tokens_are_the_raw_logits(api):
    """min_tokens keeps the end of generation from being sampled, not from the reported
    distribution: after "The end." gemma gives <eos> about 3e-4 of the probability, which
    a distribution without it would add to every other token's."""
    def token_logprobs(**extra) -> list[float]:
        return api.completions.create(model=_model(api), prompt="The end.", max_tokens=3, temperature=0, logprobs=5,
                                      extra_body=extra).choices[0].logprobs.token_logprobs

    assert token_logprobs(min_tokens=3) == pytest.approx(token_logprobs(), rel=0, abs=2e-5)


HTTP_EXAMPLE = re.compile(r"<!-- readme-test: skip: run by tests/test_http_gemma.py[^>]*-->\n```(\w*)\n(.*?)```", re.S)


def _http_examples() -> list[tuple[str, str, str]]:
    """(file, language, code) of every HTTP example in the README and docs/http.md."""
    return [(name, language, code) for name in ("README.md", "docs/http.md")
            for language, code in HTTP_EXAMPLE.findall((REPO / name).read_text())]


def test_readme_examples_run_as_printed(daemon):
    """The HTTP examples of the README and docs/http.md, with the port of this test's
    daemon for 8000 (a fixed port may be taken on a shared machine); the daemon itself is
    the one started here."""
    examples = _http_examples()
    assert {name for name, _, _ in examples} == {"README.md", "docs/http.md"}
    for name, language, code in examples:
        code = code.replace(README_PORT, str(daemon.port))
        if language == "python":
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                 check=True).stdout
            assert "100" in out, name
            continue
        for curl in (line for line in code.splitlines() if line.startswith("curl ")):  # the last one asks
            out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, check=True).stdout
        assert "100" in json.loads(out)["choices"][0]["text"], name
