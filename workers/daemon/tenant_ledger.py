"""The tenants as the front-end sees them: their weights and limits from the keys file
(cbatch/api_keys.py), the requests each has in flight, its token bucket, and its usage.

The limits hold daemon-wide, however many HTTP processes (and native clients) submit:
every request passes through the one front-end. A tenant past a limit gets RATE_LIMITED,
whose message says when to retry (`retry_after_s` travels beside it in the error reply):
- max_concurrent: requests in flight at once; retry when one ends, RETRY_CONCURRENT_S;
- tokens_per_min: a token bucket of that size, refilled at tokens_per_min / 60 a second.
  A request is let in while the bucket holds a token, and reserves its max_tokens there
  at once (at most the bucket's size), so a full bucket lets in a burst of about
  tokens_per_min / max_tokens requests, not hundreds; when it ends the reservation is
  swapped for its prompt + generated tokens (its cost is known only then, so one request
  may take the bucket below zero), or given back if it failed. Retry when the bucket
  holds a token again.
A tenant the keys file does not name (a native client's, "default") has no limits and
weight 1. The keys are read again on SIGHUP (`reload`); what a tenant has in flight and
in its bucket carries over, so a reload drops nothing and resets no budget (the bucket of
a tenant the new file no longer names is dropped).

Usage is kept for every tenant the keys file names and for "default", as long as the
daemon runs. Any other tenant's (one removed from the file, or named by a native client)
is kept while it has requests in flight and, once idle, for the MAX_IDLE_UNLISTED most
recently served of them: a daemon that sees many names come and go holds a bounded
number of counters. A forgotten tenant's series leaves /metrics, and one that comes back
starts again from 0, which Prometheus reads as a counter reset (rate() allows for it).
"""

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass

from cbatch.api_keys import DEFAULT_TENANT, TenantKey, load_keys
from cbatch.errors import RATE_LIMITED, CbatchError

RETRY_CONCURRENT_S = 1  # a request ends at any moment: ask again soon
SECONDS_PER_MINUTE = 60.0
MAX_IDLE_UNLISTED = 256  # idle tenants the keys file does not name whose usage is kept


@dataclass
class TenantUsage:
    """What a tenant was served since the daemon started (the metrics' counters)."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0


class TenantLedger:
    def __init__(self, keys_file: str = ""):
        self.keys_file = keys_file
        self.keys: dict[str, TenantKey] = load_keys(keys_file) if keys_file else {}
        self.num_in_flight: Counter = Counter()
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at monotonic s)
        self.usage: OrderedDict[str, TenantUsage] = OrderedDict()  # the least recently served first

    def reload(self) -> None:
        """Read the keys file again; raises CbatchError (nothing changes) if it cannot be used."""
        if self.keys_file:
            self.keys = load_keys(self.keys_file)
            self._buckets = {tenant: bucket for tenant, bucket in self._buckets.items() if tenant in self.keys}

    def weight(self, tenant: str) -> float:
        key = self.keys.get(tenant)
        return key.weight if key is not None else 1.0

    def admit(self, tenant: str, now_s: float, is_limited: bool = True, max_tokens: int = 0) -> int:
        """Count a new request of `tenant` in flight, or refuse it with RATE_LIMITED
        (unless not `is_limited`: a later part of a request already let in). Returns the
        tokens reserved in its bucket for the request's `max_tokens`, for on_finished."""
        key = self.keys.get(tenant) if is_limited else None
        if key is not None and key.max_concurrent and self.num_in_flight[tenant] >= key.max_concurrent:
            raise rate_limited(f"tenant {tenant} has {key.max_concurrent} requests in flight, its max_concurrent",
                               RETRY_CONCURRENT_S)
        if key is not None and key.tokens_per_min:
            tokens = self._bucket(key, now_s)
            if tokens < 1.0:
                wait_s = math.ceil((1.0 - tokens) * SECONDS_PER_MINUTE / key.tokens_per_min)
                raise rate_limited(f"tenant {tenant} used its {key.tokens_per_min} tokens_per_min", wait_s)
        self.num_in_flight[tenant] += 1
        if key is None or not key.tokens_per_min or max_tokens <= 0:
            return 0
        reserved = min(max_tokens, key.tokens_per_min)
        self._buckets[tenant] = (tokens - reserved, now_s)
        return reserved

    def refund(self, tenant: str, reserved: int, now_s: float) -> None:
        """A request that failed (nothing charged for it) gives back what admit reserved."""
        key = self.keys.get(tenant)
        if reserved and key is not None and key.tokens_per_min:
            self._buckets[tenant] = (self._bucket(key, now_s) + reserved, now_s)

    def release(self, tenant: str) -> None:
        """A request of `tenant` ended, however."""
        self.num_in_flight[tenant] -= 1
        if not self.num_in_flight[tenant]:
            del self.num_in_flight[tenant]

    def on_finished(self, tenant: str, usage: dict, now_s: float, num_requests: int = 1, reserved: int = 0) -> None:
        """Charge a finished request's tokens to the tenant's usage and bucket, less what
        admit reserved for it (and count num_requests: 0 for a later part of a request
        counted already)."""
        prompt, generated = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        served = self.usage.setdefault(tenant, TenantUsage())
        self.usage.move_to_end(tenant)
        served.num_requests += num_requests
        served.num_prompt_tokens += prompt
        served.num_generated_tokens += generated
        key = self.keys.get(tenant)
        if key is not None and key.tokens_per_min:
            self._buckets[tenant] = (self._bucket(key, now_s) + reserved - prompt - generated, now_s)
        # Usage holds the named tenants, those in flight and the idle unlisted ones; pruned
        # back to MAX_IDLE_UNLISTED of the last once they are twice that (amortized O(1)).
        if len(self.usage) > len(self.keys) + 1 + len(self.num_in_flight) + 2 * MAX_IDLE_UNLISTED:
            self._forget_idle_unlisted()

    def _forget_idle_unlisted(self) -> None:
        """Drop the usage of the least recently served idle tenants the keys file does not
        name, keeping MAX_IDLE_UNLISTED of them."""
        idle = [tenant for tenant in self.usage
                if tenant not in self.keys and tenant != DEFAULT_TENANT and tenant not in self.num_in_flight]
        for tenant in idle[:len(idle) - MAX_IDLE_UNLISTED]:
            del self.usage[tenant]

    def _bucket(self, key: TenantKey, now_s: float) -> float:
        """The tokens in the tenant's bucket now (a new or refilled one is full)."""
        tokens, at_s = self._buckets.get(key.name, (key.tokens_per_min, now_s))
        return min(float(key.tokens_per_min), tokens + (now_s - at_s) * key.tokens_per_min / SECONDS_PER_MINUTE)

    def stats(self) -> dict:
        """Per tenant: usage and requests in flight, for STATS (metrics, cbatch-status)."""
        tenants = set(self.usage) | set(self.num_in_flight)
        return {tenant: {**vars(self.usage.get(tenant, TenantUsage())), "num_in_flight": self.num_in_flight[tenant]}
                for tenant in sorted(tenants)}


def rate_limited(why: str, retry_after_s: int) -> CbatchError:
    return CbatchError(RATE_LIMITED, f"{why}; retry in {retry_after_s} s", retry_after_s)
