"""The front-end hands the decode worker the Request struct it parsed: property, whatever
valid body a caller sends, the worker decodes exactly the Request the front-end parsed
(every field equal and of the same type: tuples, not the lists msgpack carries), with the
tenant's weight from the keys file rather than the caller's, and no default on the wire."""

import msgspec
from common import worker_submit
from hypothesis import given, settings
from hypothesis import strategies as st

from cbatch.params import Request, SamplingParams, parse_request
from cbatch.workers.decode.preparer import MIN_LARGE_PROMPT_CHARS, is_large_prompt
from cbatch.workers.messages import WorkerSubmit, decode, encode

TEXT = st.text(min_size=1, max_size=12)  # hypothesis draws no lone surrogates, which parse_request refuses


def tool_chats():
    """A call, its result and the functions offered, as cbatch.tools prepares them."""
    call = st.fixed_dictionaries({"id": TEXT, "function": st.fixed_dictionaries({
        "name": TEXT, "arguments": st.dictionaries(TEXT, st.one_of(st.integers(), TEXT), max_size=2)})})
    return st.tuples(st.lists(call, min_size=1, max_size=2), st.text(max_size=12)).map(lambda parts: {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": parts[0]},
                     {"role": "tool", "content": parts[1], "tool_call_id": parts[0][0]["id"],
                      "name": parts[0][0]["function"]["name"]}],
        "offered_tools": [{"type": "function", "function": {"name": call["function"]["name"], "parameters": {
            "type": "object"}}} for call in parts[0]]})


def bodies():
    content = st.one_of(
        TEXT.map(lambda text: {"prompt": text}),
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                        "content": st.text(max_size=12)}),
                 min_size=1, max_size=4).map(lambda messages: {"messages": messages}),
        tool_chats())
    fields = st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 1 << 20), "temperature": st.one_of(st.integers(0, 2), st.floats(0, 100)),
        "top_k": st.integers(0, 50), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
        "repeat_penalty": st.floats(0.1, 10), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2), "seed": st.integers(-1, 1 << 31),
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)), "logprobs": st.one_of(st.none(), st.integers(0, 20)),
        "logit_bias": st.dictionaries(st.integers(0, 1000).map(str), st.one_of(st.integers(-100, 100),
                                                                               st.floats(-100, 100)), max_size=3),
        "min_tokens": st.integers(0, 8), "reasoning_budget": st.one_of(st.none(), st.integers(0, 8)),
        "reasoning_tags": st.one_of(st.none(), st.just(["<t>", "</t>"])),
        "priority": st.sampled_from(["interactive", "batch"]), "timeout": st.one_of(st.none(), st.floats(0.5, 60)),
        "tenant": st.sampled_from(["default", "team-a"]), "tenant_weight": st.floats(0.5, 4)})
    # A grammar, or ignore_eos, or neither: parse_request refuses the two together.
    ending = st.one_of(st.just({}), st.just({"grammar": 'root ::= "a"'}),
                       st.booleans().map(lambda b: {"ignore_eos": b}))
    return st.tuples(content, fields, ending).map(lambda parts: {**parts[0], **parts[1], **parts[2]})


def types_of(value):
    """The value's type and, inside tuples and lists, its items' types."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(types_of(item) for item in value)
    return type(value)


@settings(max_examples=300, deadline=None)
@given(body=bodies(), weight=st.floats(0.1, 10))
def test_the_worker_rebuilds_the_request_the_front_end_parsed(body, weight):
    parsed = msgspec.structs.replace(parse_request(7, body), tenant_weight=weight)
    submit = decode(encode(WorkerSubmit(parsed, 12.5)))
    rebuilt = submit.request
    assert rebuilt == parsed and hash(rebuilt.params) == hash(parsed.params)
    for name in [name for name in parsed.__struct_fields__ if name != "params"]:
        assert types_of(getattr(rebuilt, name)) == types_of(getattr(parsed, name)), name
    for name in parsed.params.__struct_fields__:
        assert types_of(getattr(rebuilt.params, name)) == types_of(getattr(parsed.params, name)), name
    assert submit.request_id == 7 and submit.deadline_s == 12.5


def test_only_the_parameters_a_caller_set_travel():
    """A parameter left at its default is not on the wire: a request that sets none carries
    an empty map of them."""
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(SamplingParams())) == {}
    params = msgspec.msgpack.decode(msgspec.msgpack.encode(parse_request(1, {"prompt": "p", "top_k": 3}).params))
    assert params == {"top_k": 3}


def test_a_large_prompt_is_told_from_the_fields_alone():
    assert is_large_prompt(worker_submit(1, {"prompt": "x" * MIN_LARGE_PROMPT_CHARS}))
    assert not is_large_prompt(worker_submit(1, {"prompt": "x" * (MIN_LARGE_PROMPT_CHARS - 1)}))
    half = "y" * (MIN_LARGE_PROMPT_CHARS // 2)
    assert is_large_prompt(worker_submit(1, {"messages": [{"role": "system", "content": half},
                                                          {"role": "user", "content": half}]}))
    assert not is_large_prompt(worker_submit(1, {"messages": [{"role": "user", "content": half}]}))
    # A chat's calls and offered tools are text the template renders too.
    call = {"id": "c", "function": {"name": "f", "arguments": {"text": half}}}
    tool = {"type": "function", "function": {"name": "f", "description": half}}
    assert is_large_prompt(worker_submit(1, {"messages": [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                             "offered_tools": [tool]}))
    # A malformed one (a front-end bug) is not large: the preparer rejects it, the I/O thread lives on.
    assert not is_large_prompt(WorkerSubmit(Request(1)))
