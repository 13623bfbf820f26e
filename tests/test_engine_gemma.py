"""What only the real model shows: chat template, stop strings and text, on gemma-3-270m."""

import llama_cpp.llama_cpp as lc
import pytest
from enginekit import collect, generate, run_to_completion, submit

from cbatch.chat_messages import ChatCall, ChatMessage, ToolSpec
from cbatch.config import EngineConfig
from cbatch.errors import INVALID_CONFIG, CbatchError
from cbatch.workers.engine.engine import Engine


@pytest.fixture(scope="module")
def gemma(gemma_model_path):
    engine = Engine(EngineConfig(model_path=gemma_model_path, parallel=4, ctx_size=4 * 1024))
    yield engine
    engine.close()


def test_chat_messages_render_with_gemma_turn_markers(gemma):
    text = gemma.runner.render_chat((ChatMessage("system", "Be brief."), ChatMessage("user", "Hello")))
    assert text.startswith("<start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
    assert "Be brief." in text and "Hello" in text
    token_ids = gemma.runner.tokenize(text)
    start_of_turn = gemma.runner.tokenize("<start_of_turn>")[-1]
    # Turn markers are single special tokens, not spelled out as text.
    assert token_ids.count(start_of_turn) == 2
    result = generate(gemma, [{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                               "temperature": 0}])[0]
    prompt = gemma.runner.render_chat((ChatMessage("user", "Hello"),))
    assert result.usage["prompt_tokens"] == len(gemma.runner.tokenize(prompt))
    assert result.finish_reason in ("stop", "length") and result.usage["completion_tokens"] >= 1


def test_tools_and_tool_turns_need_a_template_that_knows_tools(gemma):
    """gemma-3-270m has no Jinja template (llama.cpp's built-in renderer): cbatch's client
    tells tools in words for it; tools sent as data are refused, naming what is missing."""
    call = ChatMessage("assistant", "", tool_calls=(ChatCall("c1", "f", "{}"),))
    for messages, tools in (((ChatMessage("user", "Hi"),), (ToolSpec("f", "", "{}"),)), ((call,), ())):
        with pytest.raises(CbatchError, match="chat template that knows tools") as caught:
            gemma.runner.render_chat(messages, tools)
        assert caught.value.code == "invalid_request"


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


@pytest.mark.parametrize("unified", [True, False], ids=["pool", "streams"])
def test_a_prefix_longer_than_the_sliding_window_is_reused_exactly(gemma_model_path, unified):
    # gemma-3 attends over a 512-token window in most layers, and llama.cpp gives a cell
    # that has left its only owner's window to new tokens. The first request generates on
    # past the shared prefix while unrelated requests take cells beside it; the second
    # request then reuses the prefix from it, and its window must still be whole.
    config = {"model_path": gemma_model_path, "parallel": 3, "ctx_size": 3 * 2048, "cache_tokens": 16,
              "kv_unified": unified}
    on, off = Engine(EngineConfig(**config)), Engine(EngineConfig(**config, prefix_cache=False))
    try:
        assert on.runner.has_swa and on.scheduler.kv.pin_indexed_cells == unified
        prefix = "The river carries the stone past the old mill and the silent bridge. " * 42
        greedy = {"temperature": 0, "ignore_eos": True}
        first_id = submit(on, {"prompt": prefix + "What does the river carry?", "max_tokens": 1300, **greedy})
        results: dict = {}
        for i in range(16):  # enough new cells for llama.cpp's slot search to wrap around the pool
            other_id = submit(on, {"prompt": f"Colour list {i}: red, green, blue," * 30, "max_tokens": 40, **greedy})
            while other_id not in results or results[other_id].finish_reason is None:
                collect(results, on.step())
        first = next(s for s in on.scheduler.running if s.request_id == first_id)
        while first.num_cached <= first.num_prompt_tokens + 520:  # a whole window past the prefix
            collect(results, on.step())
        # The lowest position the sliding-window cache still holds for it: none was taken.
        assert lc.llama_memory_seq_pos_min(on.runner.memory, first.seq_id) == 0
        second = {"prompt": prefix + "Where is the mill?", "max_tokens": 24, **greedy}
        reused_before = on.snapshot()["prompt_tokens_reused"]
        second_id = submit(on, second)
        while second_id not in results or results[second_id].finish_reason is None:
            collect(results, on.step())
        on.cancel(first_id)
        run_to_completion(on, results)
        assert on.snapshot()["prompt_tokens_reused"] - reused_before > 512  # more than a window
        assert results[second_id].token_ids == generate(off, [second])[0].token_ids
    finally:
        on.close()
        off.close()


def test_the_pool_refuses_more_sequences_than_its_ids_can_hold_on_a_sliding_window_model(gemma_model_path):
    """With --kv-unified a sliding-window model's running sequence holds two KV sequence ids
    (its own and a pin), so 256 ids run at most 128 sequences: more is refused at the start,
    not left waiting in the queue."""
    config = {"model_path": gemma_model_path, "ctx_size": 129 * 256, "kv_unified": True}
    with pytest.raises(CbatchError) as refused:
        Engine(EngineConfig(**config, parallel=129))
    assert refused.value.code == INVALID_CONFIG
    assert "at most 128 run at once; lower --parallel or leave out --kv-unified" in refused.value.message
    Engine(EngineConfig(**config, parallel=128)).close()
