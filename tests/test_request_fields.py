"""The front-end hands the decode worker the request it parsed, as plain values: property,
whatever valid body a caller sends, the worker rebuilds exactly the Request the front-end
parsed (same fields, same types: tuples, not the lists msgpack carries), with the tenant's
weight from the keys file rather than the caller's."""

from hypothesis import given, settings, strategies as st

from cbatch.ipc.worker_messages import WorkerSubmit, decode, encode
from cbatch.params import parse_request, request_fields, request_from_fields
from cbatch.workers.decode.preparer import MIN_LARGE_PROMPT_CHARS, is_large_prompt

TEXT = st.text(min_size=1, max_size=12)  # hypothesis draws no lone surrogates, which parse_request refuses


def bodies():
    content = st.one_of(
        TEXT.map(lambda text: {"prompt": text}),
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                        "content": st.text(max_size=12)}),
                 min_size=1, max_size=4).map(lambda messages: {"messages": messages}))
    fields = st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 1 << 20), "temperature": st.floats(0, 100), "top_k": st.integers(0, 50),
        "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1), "repeat_penalty": st.floats(0.1, 10),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "seed": st.integers(-1, 1 << 31),
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)), "grammar": st.just('root ::= "a"'),
        "logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "logit_bias": st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=3),
        "min_tokens": st.integers(0, 8), "reasoning_budget": st.one_of(st.none(), st.integers(0, 8)),
        "reasoning_tags": st.one_of(st.none(), st.just(["<t>", "</t>"])),
        "priority": st.sampled_from(["interactive", "batch"]), "timeout": st.one_of(st.none(), st.floats(0.5, 60)),
        "tenant": st.sampled_from(["default", "team-a"]), "tenant_weight": st.floats(0.5, 4)})
    return st.tuples(content, fields).map(lambda parts: {**parts[0], **parts[1]})


@settings(max_examples=300, deadline=None)
@given(body=bodies(), weight=st.floats(0.1, 10))
def test_the_worker_rebuilds_the_request_the_front_end_parsed(body, weight):
    parsed = parse_request(7, body)
    submit = decode(encode(WorkerSubmit(7, request_fields(parsed, weight), 12.5)))
    rebuilt = request_from_fields(submit.request_id, submit.request)
    assert rebuilt.tenant_weight == weight
    assert rebuilt.params == parsed.params and hash(rebuilt.params) == hash(parsed.params)
    assert (rebuilt.request_id, rebuilt.prompt, rebuilt.messages, rebuilt.priority, rebuilt.timeout_s, rebuilt.tenant) \
        == (parsed.request_id, parsed.prompt, parsed.messages, parsed.priority, parsed.timeout_s, parsed.tenant)
    assert submit.deadline_s == 12.5


def test_a_large_prompt_is_told_from_the_fields_alone():
    def submit(body):
        return WorkerSubmit(1, request_fields(parse_request(1, body), 1.0))

    assert is_large_prompt(submit({"prompt": "x" * MIN_LARGE_PROMPT_CHARS}))
    assert not is_large_prompt(submit({"prompt": "x" * (MIN_LARGE_PROMPT_CHARS - 1)}))
    half = "y" * (MIN_LARGE_PROMPT_CHARS // 2)
    assert is_large_prompt(submit({"messages": [{"role": "system", "content": half},
                                                {"role": "user", "content": half}]}))
    assert not is_large_prompt(submit({"messages": [{"role": "user", "content": half}]}))
