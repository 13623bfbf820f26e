"""The thinking budget (reasoning_budget) through real llama.cpp decode on the tiny model:
once the budget of tokens inside the thinking block is spent, the close tag's tokens are
forced and accepted by the sequence's sampler chain, the same with overlap and backend
sampling on or off. The tiny model does not think: a grammar gives its output the
shape, and a logit bias keeps it from ever closing the block by itself."""

import pytest
from enginekit import generate

TAGS = ["<think>", "</think>"]
THINKING = 'root ::= "<think>" [a-z ]+ "</think>" [a-z ]+'


def never_closing(engine) -> dict:
    """A logit bias against every token with a '<' in it: the block closes only when forced."""
    runner = engine.runner
    return {str(t): -100 for t in range(runner.n_vocab) if b"<" in runner.token_piece(t)}


def thinking_of(text: str) -> str:
    return text.split("<think>", 1)[1].split("</think>", 1)[0]


def test_the_close_tag_is_forced_at_the_budget_and_the_answer_follows(make_engine):
    runs = []
    for overlap in (False, True):
        engine = make_engine(overlap=overlap)
        base = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "grammar": THINKING,
                "logit_bias": never_closing(engine)}
        runs.append(generate(engine, [
            base, {**base, "reasoning_budget": 5, "reasoning_tags": TAGS},
            {**base, "temperature": 0.9, "seed": 7, "repeat_penalty": 1.3, "reasoning_budget": 9,
             "reasoning_tags": TAGS}]))
    free, budgeted, seeded = runs[0]
    assert "</think>" not in free.text and free.finish_reason == "length"
    # The tiny model's vocabulary is bytes: a token a character.
    assert len(thinking_of(budgeted.text)) == 5 and thinking_of(free.text).startswith(thinking_of(budgeted.text))
    answer = budgeted.text.split("</think>", 1)[1]
    assert answer and set(answer) <= set("abcdefghijklmnopqrstuvwxyz ")  # the grammar went on after the tag
    assert len(thinking_of(seeded.text)) == 9 and len(seeded.text.split("</think>", 1)[1]) > 0
    # Overlap on: the same greedy events, step by step. A seeded row that missed its
    # constraint gets its next mask while the next batch decodes, and draws once where it
    # would have drawn twice: its own answer, of the same shape.
    assert [(r.chunks, r.token_ids) for r in runs[1][:2]] == [(r.chunks, r.token_ids) for r in runs[0][:2]]
    overlapped = runs[1][2]
    assert len(thinking_of(overlapped.text)) == 9 and len(overlapped.text.split("</think>", 1)[1]) > 0


def test_a_block_the_prompt_opened_counts_from_the_first_token_on_every_path(make_engine):
    body = {"prompt": "hello <think>", "max_tokens": 20, "temperature": 0, "reasoning_budget": 3,
            "reasoning_tags": TAGS}
    results = [generate(make_engine(overlap=overlap, backend_sampling=backend), [body])[0]
               for overlap in (False, True) for backend in (False, True)]
    first = results[0]
    assert first.text[3:].startswith("</think>") and first.finish_reason in ("length", "stop")
    assert all((r.text, r.token_ids) == (first.text, first.token_ids) for r in results)


def test_a_grammar_that_refuses_the_tag_yet_delays_it(make_engine):
    engine = make_engine()
    body = {"prompt": "hello", "max_tokens": 20, "temperature": 0, "grammar": THINKING,
            "logit_bias": never_closing(engine), "reasoning_budget": 0, "reasoning_tags": TAGS}
    text = generate(engine, [body])[0].text
    assert len(thinking_of(text)) == 1  # the grammar wants a character before the close tag


def test_a_budget_needs_tags_from_the_request_or_the_model(make_engine):
    from enginekit import submit

    from cbatch.errors import CbatchError

    with pytest.raises(CbatchError, match="reasoning_budget needs the thinking block's tags.*--reasoning-tags"):
        submit(make_engine(), {"prompt": "x", "reasoning_budget": 3})
    # A daemon that knows the model's tags (--reasoning-tags, or its template) lends them.
    engine = make_engine(reasoning_tags=tuple(TAGS))
    body = {"prompt": "hello", "max_tokens": 30, "temperature": 0, "grammar": THINKING,
            "logit_bias": never_closing(engine), "reasoning_budget": 4}
    lent, named = generate(engine, [body, {**body, "reasoning_tags": TAGS}])
    assert len(thinking_of(lent.text)) == 4 and (lent.text, lent.token_ids) == (named.text, named.token_ids)


def test_a_mask_made_ahead_before_the_close_tag_is_forced_is_not_used_after_it(make_engine):
    """With overlap on, a row that missed its constraint gets its next mask while the next
    batch decodes; when the budget then forces the close tag instead, that mask is of the
    thinking block's state, and the answer after the tag (digits only) must not be picked by it."""
    engine = make_engine(overlap=True)
    body = {"prompt": "hello", "max_tokens": 30, "temperature": 0, "logit_bias": never_closing(engine),
            "grammar": 'root ::= "<think>" [a-z ]+ "</think>" [0-9]+', "reasoning_budget": 5, "reasoning_tags": TAGS}
    result = generate(engine, [body])[0]
    assert result.finish_reason == "length", result
    assert len(thinking_of(result.text)) == 5 and result.text.split("</think>", 1)[1].isdigit()
