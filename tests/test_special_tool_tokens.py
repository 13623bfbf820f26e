"""A model whose vocabulary has `<tool_call>` and `</tool_call>` as tokens of their own
(user-defined tokens, as Qwen2.5's and Qwen3's GGUFs have) writes a forced call with
them, as it was trained to, not spelled out a byte at a time: the call grammar's text
`<tool_call>` may be produced by that one token. Through a real daemon on the tiny model
with those tokens and a Hermes-style template; a logit bias makes the model want them."""

import json

import pytest
from conftest import REPO, load_script
from daemonkit import Daemon, serve_module

TAGS = ("<tool_call>", "</tool_call>")
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["colour"],
    "properties": {"colour": {"enum": ["red", "blue"]}}}}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = load_script("make_tiny_model").llama.make_tiny_model(
        str(tmp_path_factory.mktemp("models") / "tiny-tagged.gguf"),
        chat_template=(REPO / "scripts" / "chatml_tools.jinja").read_text(), user_defined=TAGS)
    yield from serve_module(Daemon(path, "--parallel", "2"))


def test_a_forced_call_uses_the_vocabularys_own_call_tokens(daemon):
    open_id, close_id = 260, 261  # after three specials, the 256 bytes and the space: the tags, in order
    with daemon.client() as client:
        result = client.generate(messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=120,
                                 temperature=0, tools=[PICK], tool_choice="required", parallel_tool_calls=False,
                                 logit_bias={str(open_id): 100, str(close_id): 100})
    assert result.token_ids[0] == open_id and close_id in result.token_ids
    [call] = result.tool_calls
    assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["colour"] in ("red", "blue")
