"""Structured output on a model whose chat template opens the thinking block in the
generation prompt (as Qwen3's thinking models, QwQ and DeepSeek-R1's distills do): the
model thinks unconstrained, the constraint starts after the close tag, and the answer
lands in `content` (or `tool_calls`, or the Responses API's message), the thinking in
`reasoning_content`. Through real HTTP on the tiny model with such a template; a thinking
budget closes the block (the random-weight model would not close it by itself)."""

import json

import anthropic
import pytest
from conftest import REPO, load_script
from daemonkit import serve_module
from httpkit import HttpDaemon

COLOUR = {"type": "object", "additionalProperties": False, "required": ["colour"],
          "properties": {"colour": {"enum": ["red", "blue"]}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR}}
PICK = {"type": "function", "function": {"name": "pick", "parameters": COLOUR}}
ASK = [{"role": "user", "content": "Pick a colour."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    template = (REPO / "scripts" / "chatml_tools.jinja").read_text()
    opening = template.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>\n{% endif %}")
    assert opening != template
    path = load_script("make_tiny_model").llama.make_tiny_model(
        str(tmp_path_factory.mktemp("models") / "tiny-thinking.gguf"), chat_template=opening)
    yield from serve_module(HttpDaemon(path, "--parallel", "2", "--alias", "m"))


def test_the_daemon_knows_the_template_opens_the_block(daemon):
    with daemon.client() as client:
        assert client.health()["reasoning"] == {"tags": ["<think>", "</think>"], "opened_by_prompt": True}


@pytest.mark.parametrize("budget", [0, 6])
def test_a_json_schema_answer_follows_the_thinking(api, budget):
    request = {"model": "m", "messages": ASK, "max_tokens": 60, "temperature": 0, "response_format": RESPONSE_FORMAT,
               "extra_body": {"reasoning_budget": budget}}
    choice = api.chat.completions.create(**request).choices[0]
    reasoning = choice.message.model_extra["reasoning_content"]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content)["colour"] in ("red", "blue")
    assert (reasoning or "") != "" if budget else not reasoning
    content = "".join(chunk.choices[0].delta.content or "" for chunk in api.chat.completions.create(**request,
                                                                                                    stream=True))
    assert content == choice.message.content


def test_a_forced_call_follows_the_thinking(api):
    choice = api.chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0, tools=[PICK],
                                         tool_choice="required", parallel_tool_calls=False,
                                         extra_body={"reasoning_budget": 4}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments)["colour"] in ("red", "blue")


def test_the_responses_api_gives_the_answer_as_a_message_after_the_reasoning(api):
    response = api.responses.create(model="m", input=ASK, max_output_tokens=60, temperature=0,
                                    reasoning={"effort": "minimal"},
                                    text={"format": {"type": "json_schema", "name": "colour", "schema": COLOUR}})
    assert response.status == "completed" and response.output[-1].type == "message"
    assert json.loads(response.output_text)["colour"] in ("red", "blue")


def test_the_messages_api_gives_a_thinking_block_then_the_answer(daemon):
    claude = anthropic.Anthropic(base_url=daemon.base_url, api_key="none", max_retries=0)
    request = {"model": "m", "max_tokens": 60, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 6},
               "output_config": {"format": {"type": "json_schema", "schema": COLOUR}},
               "extra_body": {"temperature": 0}}
    message = claude.messages.create(**request)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking and text.type == "text"
    assert json.loads(text.text)["colour"] in ("red", "blue") and message.stop_reason == "end_turn"
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert [(block.type, getattr(block, "thinking", None) or getattr(block, "text", None))
            for block in streamed.content] == [("thinking", thinking.thinking), ("text", text.text)]


def test_an_empty_answer_is_one_empty_text_block(daemon):
    """The end of generation at once (a logit bias on the tiny model's </s>): still a text block."""
    claude = anthropic.Anthropic(base_url=daemon.base_url, api_key="none", max_retries=0)
    message = claude.messages.create(model="m", max_tokens=8, messages=ASK,
                                     extra_body={"temperature": 0, "logit_bias": {"2": 100}})
    assert [(block.type, getattr(block, "text", None)) for block in message.content] == [("text", "")], message
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 0
