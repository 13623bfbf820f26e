"""A conversation's next turn, rendered by the model's own template, begins with the last
turn's prompt and answer, token for token: what lets a returning chat reuse the KV its last
turn computed, from a slot or the host tier (SmolLM2's template, and the ChatML template
with tools that the tests' tiny tools model carries)."""

import pytest
from conftest import REPO
from llama_cpp import Llama

from cbatch.model import chat_model_path
from cbatch.workers.engine.chat_template import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "water_plan", "description": "A watering plan.",
                                           "parameters": {"type": "object",
                                                          "properties": {"plant": {"type": "string"}}}}}]
ANSWERS = ["Water it once a week, more in summer.", "Twice a month is enough.\nCheck the soil first."]


@pytest.fixture(scope="module")
def smollm2():
    vocab = Llama(chat_model_path(), vocab_only=True, verbose=False)
    template = ChatTemplate(vocab.metadata["tokenizer.chat_template"], eos_token="<|im_end|>")
    return vocab, template


def tokens(vocab: Llama, text: str) -> list[int]:
    return vocab.tokenize(text.encode(), add_bos=False, special=True)


def turns(with_system: bool):
    messages = [{"role": "system", "content": "You answer gardeners briefly."}] if with_system else []
    messages.append({"role": "user", "content": "How often should I water a fern?"})
    for answer in ANSWERS:
        yield list(messages), answer
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And in winter?"}]


@pytest.mark.parametrize("with_system", [True, False], ids=["system", "default-system"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_smollm2s_next_turn_begins_with_the_last_prompt_and_answer_tokens(smollm2, with_system, tools):
    vocab, template = smollm2
    for messages, answer in turns(with_system):
        prompt = template.render(messages, tools)
        following = template.render(messages + [{"role": "assistant", "content": answer},
                                                {"role": "user", "content": "Next?"}], tools)
        assert following.startswith(prompt + answer)
        expected = tokens(vocab, prompt) + tokens(vocab, answer)  # what the last turn computed, answer included
        assert tokens(vocab, following)[:len(expected)] == expected


def test_the_chatml_tools_templates_next_turn_begins_with_the_last_prompt_and_answer():
    template = ChatTemplate((REPO / "scripts" / "chatml_tools.jinja").read_text(), eos_token="<|im_end|>")
    for tools in (None, TOOLS):
        for messages, answer in turns(with_system=True):
            prompt = template.render(messages, tools)
            following = template.render(messages + [{"role": "assistant", "content": answer},
                                                    {"role": "user", "content": "Next?"}], tools)
            assert following.startswith(prompt + answer)
