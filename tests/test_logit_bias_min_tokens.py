"""logit_bias and min_tokens through a real daemon on the tiny model (its end-of-sequence
token, id 2, is never picked unbiased, so a bias can force it and min_tokens hold it off)."""

import pytest
from daemonkit import Daemon, serve_module

from cbatch.errors import CbatchError

EOS_ID = 2  # </s> in scripts/tiny_models/llama.py


@pytest.fixture(scope="module")
def daemon(tiny_model_path):
    yield from serve_module(Daemon(tiny_model_path, "--parallel", "2"))


def test_logit_bias_bans_and_forces_tokens(daemon):
    with daemon.client() as client:
        plain = client.generate(prompt="Once upon", max_tokens=4, temperature=0)
        banned = client.generate(prompt="Once upon", max_tokens=4, temperature=0,
                                 logit_bias={str(plain.token_ids[0]): -100})
        assert banned.token_ids[0] != plain.token_ids[0]
        forced = client.generate(prompt="Once upon", max_tokens=6, temperature=0.8, seed=1, logit_bias={"200": 100})
        assert forced.token_ids == [200] * 6


def test_min_tokens_holds_off_end_of_generation(daemon):
    with daemon.client() as client:
        ends_at_once = client.generate(prompt="go", max_tokens=20, temperature=0, logit_bias={str(EOS_ID): 100})
        assert ends_at_once.finish_reason == "stop" and ends_at_once.token_ids == []
        held = client.generate(prompt="go", max_tokens=20, temperature=0, logit_bias={str(EOS_ID): 100}, min_tokens=5)
        assert held.finish_reason == "stop" and len(held.token_ids) == 5
        assert EOS_ID not in held.token_ids


@pytest.mark.parametrize("bias, code_in_message", [
    ({"abc": 1}, "decimal"), ({"5": 101}, "logit_bias"), ({"99999999": 1}, "vocabulary"), ([1, 2], "object")])
def test_bad_logit_bias_is_rejected(daemon, bias, code_in_message):
    with daemon.client() as client:
        with pytest.raises(CbatchError) as caught:
            client.generate(prompt="go", max_tokens=2, logit_bias=bias)
        assert caught.value.code == "invalid_request" and code_in_message in caught.value.message
        with pytest.raises(CbatchError):
            client.generate(prompt="go", max_tokens=2, min_tokens=-1)
        assert client.generate(prompt="go", max_tokens=2).usage["completion_tokens"] == 2
