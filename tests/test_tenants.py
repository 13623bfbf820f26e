"""Many tenants on one daemon, through the real daemon: named API keys (--api-keys-file),
fair share of the decode steps by weight, limits per key (429 rate_limited with a
Retry-After from the key's budget), usage per tenant, and a SIGHUP reload of the keys."""

import math
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from daemonkit import SCRIPTS_DIR, wait_until
from httpkit import HttpDaemon

KEYS = """# name key options
heavy key-heavy weight=1
light key-light weight=2   # twice heavy's share
capped key-capped max_concurrent=1
metered key-metered tokens_per_min=120
"""
PARALLEL = 2  # small, so that both tenants keep requests waiting
MAX_TOKENS = 12
TIMEOUT_S = 300.0


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer key-{tenant}"}


def complete(daemon: HttpDaemon, tenant: str, **body) -> httpx.Response:
    body = {"prompt": "tenants", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{daemon.base_url}/v1/completions", json=body, headers=auth(tenant), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def daemon(tiny_model_path, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(KEYS)
    daemon = HttpDaemon(tiny_model_path, "--parallel", str(PARALLEL), "--max-queue", "1000",
                        "--api-keys-file", str(keys_file))
    yield daemon
    daemon.stop()
    daemon.remove_workdir()


def test_backlogged_tenants_get_tokens_in_proportion_to_their_weights(daemon):
    """heavy queues ten times light's requests; while both have requests waiting, light
    (weight 2) gets two thirds of the tokens served, heavy (weight 1) one third."""
    num_light = 40
    items = []
    for i in range(num_light * 11):  # light's among heavy's, so both are queued from the start
        tenant = "light" if i % 11 == 0 else "heavy"
        items.append({"prompt": f"share {i}", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                      "tenant": tenant, "id": tenant})
    served = {"heavy": 0, "light": 0}
    num_light_done = 0
    with daemon.client() as client:
        for position, chunk in client.stream_batch(items, max_in_flight=len(items)):
            assert not isinstance(chunk, Exception), chunk
            if not chunk.finish_reason:
                continue
            tenant = items[position]["tenant"]
            served[tenant] += chunk.usage["prompt_tokens"] + chunk.usage["completion_tokens"]
            num_light_done += tenant == "light"
            if num_light_done == num_light - PARALLEL:  # light still has requests waiting or running
                break
    light_share = served["light"] / (served["light"] + served["heavy"])
    assert abs(light_share - 2 / 3) <= 0.1 * 2 / 3, served
