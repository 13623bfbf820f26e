"""Conversations that come back, through the real daemon: more chat conversations than
slots over HTTP (SmolLM2's own template, and the ChatML tools template), the usage and
metrics that count what the cache tiers served, Claude Code's billing line, and a restart
that finds the conversations in --cache-dir."""

import os
import signal

import pytest
from common import GREEDY, free_port
from daemonkit import Daemon, serve_module, wait_until
from httpkit import HttpDaemon

from cbatch.cli.status import format_status
from cbatch.model import chat_model_path
from cbatch.workers.engine.kv.base import BLOCK_TOKENS

SYSTEM = ("You are a patient assistant for a garden shop. You answer questions about plants, soil, watering, "
          "light and seasons in two short sentences, and you never recommend a product by name. ") * 3
BILLING = "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={};\n"


@pytest.fixture(scope="module")
def daemon():
    yield from serve_module(HttpDaemon(chat_model_path(), "--parallel", "1", "--ctx-size", "2048"))


GREEDY_HTTP = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def model_of(api) -> str:
    return api.models.list().data[0].id


def chat(api, messages: list[dict], max_tokens: int = 12):
    reply = api.chat.completions.create(model=model_of(api), messages=messages, max_tokens=max_tokens, **GREEDY_HTTP)
    return reply.choices[0].message.content, reply.usage


def three_conversations_twice(api) -> tuple[list, list]:
    """Three conversations on one slot, two turns each: every second turn comes back to a
    slot another conversation has taken since. The usages of both turns."""
    # Each has a history of its own as long as the shared system prompt: worth saving.
    conversations = [[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"Question {i}: my {plant} " + "sits by a north window, " * 12
                       + "so how often should I water it?"}]
                     for i, plant in enumerate(("fern", "cactus", "tomato"))]
    first = []
    for messages in conversations:
        answer, usage = chat(api, messages)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And in winter?"}]
        first.append(usage)
    return first, [chat(api, messages)[1] for messages in conversations]


def test_a_conversation_back_after_two_others_took_its_slot_computes_only_its_new_tokens(daemon, api):
    before = daemon.metrics()
    first, second = three_conversations_twice(api)
    for turn_one, turn_two in zip(first, second):
        # The model's template renders turn two as turn one's prompt and answer, then more.
        assert turn_two.prompt_tokens_details.cached_tokens >= turn_one.prompt_tokens - BLOCK_TOKENS
    after = daemon.metrics()
    host_hits = ("cbatch_kv_cache_hits_total", (("tier", "host"),))
    assert after[host_hits] - before.get(host_hits, 0) >= 3
    assert after[("cbatch_host_cache_bytes", ())] > 0
    with daemon.client() as client:
        assert "host cache: " in format_status(daemon.endpoint, client.health(), client.stats())


def test_responses_and_completions_report_their_cached_tokens(daemon, api):
    prompt = SYSTEM + "Which plant needs the least light?"
    completions = [api.completions.create(model=model_of(api), prompt=prompt, max_tokens=4, **GREEDY_HTTP)
                   for _ in range(2)]
    assert completions[0].usage.prompt_tokens_details.cached_tokens == 0
    assert completions[1].usage.prompt_tokens_details.cached_tokens >= completions[1].usage.prompt_tokens - BLOCK_TOKENS
    responses = [api.responses.create(model=model_of(api), instructions=SYSTEM, input="Name one shade plant.",
                                      max_output_tokens=4, temperature=0) for _ in range(2)]
    assert responses[1].usage.input_tokens_details.cached_tokens >= responses[1].usage.input_tokens - BLOCK_TOKENS


def test_claude_codes_billing_line_does_not_defeat_the_cache(daemon, api):
    usages = [chat(api, [{"role": "system", "content": BILLING.format(cch) + SYSTEM},
                         {"role": "user", "content": "Is basil hard to grow?"}], max_tokens=2)[1]
              for cch in ("3f9a1", "c07e2")]
    assert usages[1].prompt_tokens_details.cached_tokens >= usages[1].prompt_tokens - BLOCK_TOKENS
    plain = chat(api, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is basil hard to grow?"}],
                 max_tokens=2)[1]
    assert plain.prompt_tokens == usages[1].prompt_tokens  # the line is gone, not just cached


def test_the_chatml_tools_template_and_a_kept_billing_line(tiny_tools_model_path, start_http_daemon):
    daemon = start_http_daemon(tiny_tools_model_path, "--parallel", "1", "--keep-billing-header")
    api = daemon.openai()
    first, second = three_conversations_twice(api)
    assert all(two.prompt_tokens_details.cached_tokens >= one.prompt_tokens - BLOCK_TOKENS
               for one, two in zip(first, second))
    usages = [chat(api, [{"role": "system", "content": BILLING.format(cch) + SYSTEM},
                         {"role": "user", "content": "Is basil hard to grow?"}], max_tokens=2)[1]
              for cch in ("3f9a1", "c07e2")]
    # Kept: the two prompts part at the cch, a line into the system prompt.
    assert usages[1].prompt_tokens_details.cached_tokens < usages[1].prompt_tokens / 4


def test_conversations_come_back_from_the_cache_directory_after_a_restart(tiny_model_path, tmp_path, start_daemon):
    cache_dir = tmp_path / "kv"
    prompts = [f"Conversation {i}: " + "tell me about the river and the stone and the light " * 6 for i in range(3)]
    first = start_daemon(tiny_model_path, "--parallel", "1", "--cache-dir", str(cache_dir))
    with first.client() as client:
        answers = [client.generate(prompt=p, max_tokens=8, **GREEDY).text for p in prompts]
    assert first.stop() == 0
    files = sorted(cache_dir.glob("*/*.kv"))
    assert len(files) == 3 and not list(cache_dir.glob("*/*.tmp"))
    damaged = bytearray(files[0].read_bytes())
    damaged[-1] ^= 0xFF
    files[0].write_bytes(bytes(damaged))
    second = start_daemon(tiny_model_path, "--parallel", "1", "--cache-dir", str(cache_dir))
    with second.client() as client:
        returning = [client.generate(prompt=p + a + " and then?", max_tokens=8, **GREEDY)
                     for p, a in zip(prompts, answers)]
        bystander = client.generate(prompt="Something else entirely.", max_tokens=4, **GREEDY)
        stats = client.stats()
    assert bystander.finish_reason == "length" and all(r.finish_reason == "length" for r in returning)
    assert sorted(r.usage["cached_tokens"] > 0 for r in returning) == [False, True, True]
    assert stats["disk_cache_hits"] == 2 and stats["disk_cache_skipped"] == 1
    assert second.log().count("skipped the KV cache file") == 1


def test_after_a_decode_worker_crash_the_tier_comes_back_from_the_directory(tiny_model_path, tmp_path, start_daemon):
    """What was written before the crash serves the new worker; what it had in memory only
    is gone, never half restored."""
    cache_dir = tmp_path / "kv"
    prompts = [f"Talk {i}: " + "the market and the engine and the story of the number " * 6 for i in range(3)]
    daemon = start_daemon(tiny_model_path, "--parallel", "1", "--cache-dir", str(cache_dir))
    with daemon.client() as client:
        answers = [client.generate(prompt=p, max_tokens=8, **GREEDY).text for p in prompts]
        wait_until(lambda: len(list(cache_dir.glob("*/*.kv"))) == 2, timeout_s=60.0)  # the third is in its slot
        old_pid = client.health()["worker_pid"]
        os.kill(old_pid, signal.SIGKILL)
        wait_until(lambda: client.health()["worker_pid"] not in (0, old_pid), timeout_s=120.0)
        returning = [client.generate(prompt=p + a + " and then?", max_tokens=8, **GREEDY)
                     for p, a in zip(prompts, answers)]
        stats = client.stats()
    assert [r.usage["cached_tokens"] > 0 for r in returning] == [True, True, False]
    assert stats["disk_cache_hits"] == 2


def test_a_cache_directory_that_cannot_be_made_stops_the_start_naming_the_flag(tiny_model_path, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuntimeError) as caught:
        Daemon(tiny_model_path, "--cache-dir", str(blocker / "kv"), endpoint=f"tcp://127.0.0.1:{free_port()}")
    assert "--cache-dir" in str(caught.value)
