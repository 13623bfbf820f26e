"""What only the real model shows: chat template, stop strings and text, on gemma-3-270m."""

import pytest

from cbatch.config import EngineConfig
from cbatch.workers.engine import Engine
from enginekit import generate


@pytest.fixture(scope="module")
def gemma(gemma_model_path):
    engine = Engine(EngineConfig(model_path=gemma_model_path, parallel=4, ctx_size=4 * 1024))
    yield engine
    engine.close()


def test_chat_messages_render_with_gemma_turn_markers(gemma):
    text = gemma.runner.render_chat((("system", "Be brief."), ("user", "Hello")))
    assert text.startswith("<start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    assert "Be brief." in text and "Hello" in text
    token_ids = gemma.runner.tokenize(text)
    start_of_turn = gemma.runner.tokenize("<start_of_turn>")[-1]
    # Turn markers are single special tokens, not spelled out as text.
    assert token_ids.count(start_of_turn) == 2
    result = generate(gemma, [{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}])[0]
    assert result.usage["prompt_tokens"] == len(gemma.runner.tokenize(gemma.runner.render_chat((("user", "Hello"),))))
    assert result.finish_reason in ("stop", "length") and result.usage["completion_tokens"] >= 1


def test_greedy_text_is_sensible_when_batched(gemma):
    # No solo-vs-batched equality here: llama.cpp's quantized CPU kernels are not batch
    # invariant, so a different batch can flip a near-tie many tokens in.
    water, france = generate(gemma, [{"prompt": "Water boils at", "max_tokens": 12, "temperature": 0},
                                     {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}])
    assert "100" in water.text
    assert "Paris" in france.text or "France" in france.text


def test_stop_string_on_real_tokens(gemma):
    free, stopped = generate(gemma, [
        {"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0},
        {"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0, "stop": ["8,", "never"]},
    ])
    assert "8," in free.text
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("8,")]
    assert "8" not in stopped.text
