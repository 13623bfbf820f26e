"""Reasoning over HTTP through the official openai package, against a real daemon on the
chat model (SmolLM2) told to split `<think>...</think>` (--reasoning-tags): the thinking
comes back as reasoning_content, whole and streamed, and a thinking budget ends it with
the close tag, the answer following. SmolLM2 does not think: a grammar gives its answer
that shape, and a logit bias keeps it from closing the block by itself."""

import functools
import json
import os
import signal
import subprocess
import time

import openai
import pytest
from daemonkit import SCRIPTS_DIR, serve_module
from httpkit import HttpDaemon

from cbatch.model import chat_model_path

THINKING = 'root ::= "<think>" [a-z ]+ "</think>" [a-z ]+'
ASK = [{"role": "user", "content": "Name a colour."}]
DAEMON_ARGS = ("--parallel", "2", "--alias", "m", "--reasoning-tags", "<think>", "</think>")


@pytest.fixture(scope="module")
def daemon():
    yield from serve_module(HttpDaemon(chat_model_path(), *DAEMON_ARGS))


@functools.cache
def never_closing() -> dict:
    """A logit bias against every token with a '<' in it: the block closes only when forced."""
    import llama_cpp

    vocab = llama_cpp.Llama(chat_model_path(), vocab_only=True, verbose=False)
    return {str(t): -100 for t in range(vocab.n_vocab()) if b"<" in vocab.detokenize([t])}


def thinking_request(**extra) -> dict:
    """min_tokens as max_tokens: the answer after a forced close tag runs to the end (the
    model's greedy choice there may otherwise end it at once, which depends on the CPU)."""
    return {"messages": ASK, "temperature": 0, "max_tokens": 40,
            "extra_body": {"grammar": THINKING, "logit_bias": never_closing(), "min_tokens": 40,
                           **extra.pop("extra_body", {})}, **extra}


def streamed(api, **request) -> tuple[str, str, str]:
    reasoning = content = ""
    finish_reason = None
    for chunk in api.chat.completions.create(model="m", stream=True, **request):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return reasoning, content, finish_reason


def test_the_thinking_is_split_from_the_answer_whole_and_streamed(api):
    request = thinking_request(extra_body={"reasoning_budget": 8})
    message = api.chat.completions.create(model="m", **request).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and "<" not in reasoning + message.content
    assert streamed(api, **request) == (reasoning, message.content, "length")


def test_the_budget_ends_the_thinking_and_the_answer_follows(api):
    free = api.chat.completions.create(model="m", **thinking_request()).choices[0]
    # Never closed: all of it is thinking, cut by max_tokens.
    assert free.finish_reason == "length" and free.message.content == ""
    free_reasoning = free.message.model_extra["reasoning_content"]
    budgeted = api.chat.completions.create(model="m", **thinking_request(extra_body={"reasoning_budget": 6})).choices[0]
    reasoning = budgeted.message.model_extra["reasoning_content"]
    assert free_reasoning.startswith(reasoning) and len(reasoning) < len(free_reasoning)
    assert budgeted.message.content  # the answer after the forced close tag
    minimal = api.chat.completions.create(model="m", reasoning_effort="minimal", **thinking_request()).choices[0]
    assert reasoning.startswith(minimal.message.model_extra["reasoning_content"]) and minimal.message.content


def test_an_answer_that_does_not_think_is_all_content(api):
    message = api.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=12).choices[0].message
    assert message.content and message.model_extra["reasoning_content"] is None


def test_the_daemon_tells_the_http_server_the_tags(daemon):
    with daemon.client() as client:
        assert client.health()["reasoning"] == {"tags": ["<think>", "</think>"], "opened_by_prompt": False}


def test_a_native_client_budget_takes_the_daemons_tags(daemon, api):
    over_http = api.chat.completions.create(model="m", **thinking_request(extra_body={"reasoning_budget": 6}))
    with daemon.client() as client:
        result = client.generate(messages=ASK, temperature=0, max_tokens=40, grammar=THINKING,
                                 logit_bias=never_closing(), min_tokens=40, reasoning_budget=6)
    thinking, answer = result.text.removeprefix("<think>").split("</think>", 1)
    # Over HTTP the answer's leading whitespace (after the close tag) is not content.
    assert (thinking, answer.lstrip()) == (over_http.choices[0].message.model_extra["reasoning_content"],
                                           over_http.choices[0].message.content)


def _batch_file(tmp_path, request: dict) -> str:
    """An OpenAI batch file: the thinking request, then a chat line that does not think."""
    body = {"model": "m", **{k: v for k, v in request.items() if k != "extra_body"}, **request["extra_body"]}
    lines = [{"custom_id": "think", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "plain", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": ASK, "max_tokens": 8, "temperature": 0}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(tmp_path / "in.jsonl")


def _check_split(submit: subprocess.Popen, over_http) -> None:
    stdout, stderr = submit.communicate(timeout=60)
    assert submit.returncode == 0, stderr
    thought, plain = (json.loads(line)["response"]["body"]["choices"][0]["message"] for line in stdout.splitlines())
    assert (thought["reasoning_content"], thought["content"]) == (over_http.model_extra["reasoning_content"],
                                                                  over_http.content)
    assert plain["content"] and plain["reasoning_content"] is None


def _submit(daemon, *args) -> subprocess.Popen:
    return subprocess.Popen([str(SCRIPTS_DIR / "cbatch-submit"), *args], env=daemon.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("via_url", [False, True], ids=["daemon", "url"])
def test_openai_batch_lines_split_the_thinking_as_http_does(daemon, api, tmp_path, via_url):
    request = thinking_request(extra_body={"reasoning_budget": 6})
    over_http = api.chat.completions.create(model="m", **request).choices[0].message
    flags = ("--url", f"{daemon.base_url}/v1") if via_url else ()
    _check_split(_submit(daemon, _batch_file(tmp_path, request), *flags), over_http)


def test_an_openai_batch_file_waits_for_a_loading_daemons_tags(api, tmp_path):
    request = thinking_request(extra_body={"reasoning_budget": 6})
    over_http = api.chat.completions.create(model="m", **request).choices[0].message
    loading = HttpDaemon(chat_model_path(), *DAEMON_ARGS, is_waited=False)
    try:
        worker_pid = loading.new_decode_worker_pid()
        os.kill(worker_pid, signal.SIGSTOP)  # held before its model (and so its tags) has loaded
        try:
            with loading.client() as client:
                assert client.health()["status"] == "starting"  # else this would test nothing
            submit = _submit(loading, _batch_file(tmp_path, request))
            time.sleep(1.0)
            assert submit.poll() is None  # waiting, not failing the budgeted line
        finally:
            os.kill(worker_pid, signal.SIGCONT)
        _check_split(submit, over_http)
    finally:
        loading.stop()
        loading.remove_workdir()


@pytest.mark.parametrize("server_reasoning, expected", [
    (None, (None, "Red.")),  # the server split it and there was no thinking
    ("hmm", ("hmm", "Red.")),
])
def test_an_answer_another_server_split_is_not_split_again(server_reasoning, expected):
    """--url to a server whose model opens the block in its prompt: an answer the server
    already split must not be read as all thinking."""
    from cbatch.client.openai_wire import CHAT_PATH, chunk_from_response
    from cbatch.openai.completions_output import ResponseBuilder, WholeResponse
    from cbatch.openai.mapping import CHAT, parse_api_request

    opened = {"tags": ["<think>", "</think>"], "opened_by_prompt": True}
    request = parse_api_request(CHAT, {"messages": ASK}, ["m"], opened)
    whole = WholeResponse(ResponseBuilder(request, "fp_x"))
    message = {"role": "assistant", "content": "Red.", "reasoning_content": server_reasoning}
    whole.add(0, chunk_from_response("line", CHAT_PATH, {
        "choices": [{"message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2}}))
    answer = whole.response()["choices"][0]["message"]
    assert (answer["reasoning_content"], answer["content"]) == expected


def test_the_tags_come_from_the_template_or_the_flags_and_a_prompt_may_open_the_block(make_engine):
    from cbatch.config import EngineConfig
    from cbatch.workers.engine.thinking.tags import model_reasoning

    runner = make_engine(model_path=chat_model_path()).runner
    assert model_reasoning(EngineConfig(), runner) is None  # SmolLM2's template does not think
    assert model_reasoning(EngineConfig(reasoning="off", reasoning_tags=("<think>", "</think>")), runner) is None
    # A template whose generation prompt ends in the open tag: the answer starts inside the block.
    opened = model_reasoning(EngineConfig(reasoning_tags=("<|im_start|>assistant", "</think>")), runner)
    assert opened == {"tags": ["<|im_start|>assistant", "</think>"], "opened_by_prompt": True}


@pytest.mark.parametrize("pieces, opened, expected", [
    (["<th", "ink>\nhm", "m</", "think>\n\n", "Red."], False, ("\nhmm", "Red.")),
    (["  <think>a</think>b"], False, ("a", "b")),
    (["<thin"], False, ("", "<thin")),  # an answer that stopped inside what looked like the tag
    (["Red", " <think>"], False, ("", "Red <think>")),
    (["hmm", "</thi", "nk>Blue"], True, ("hmm", "Blue")),
    (["cut o", "ff </thi"], True, ("cut off </thi", "")),
])
def test_the_split_holds_back_a_tag_cut_across_chunks(pieces, opened, expected):
    from cbatch.openai.reasoning import ReasoningSplitter, split_reasoning

    splitter = ReasoningSplitter({"tags": ["<think>", "</think>"], "opened_by_prompt": opened})
    parts = [splitter.push(piece, is_last=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected
    assert split_reasoning("".join(pieces), {"tags": ["<think>", "</think>"], "opened_by_prompt": opened}) == expected


def test_a_bad_budget_is_a_400_naming_it(api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="m", messages=ASK, extra_body={"reasoning_budget": -1})
    assert caught.value.body["param"] == "reasoning_budget"
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="m", messages=ASK, reasoning_effort="enormous")
    assert caught.value.body["param"] == "reasoning_effort"
