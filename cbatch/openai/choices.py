"""OpenAI's `n`: one body asking for n completions of one prompt as n request bodies. The
native client and batch files take `n` the same way."""

from cbatch.params import MAX_SEED, invalid

MAX_CHOICES = 16


def _checked_int(name, value, lo, hi):
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise invalid(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def expand_choices(body: dict) -> list[dict]:
    """A body asking for `n` completions of one prompt becomes n request bodies, each its
    own sequence and sampler; with a `seed`, the i-th gets `seed + i` (random seeds stay
    random). They are submitted together, so the engine computes the shared prompt once:
    the later ones wait for its blocks (cache-aware admission) and reuse them. Without
    `n`, the body is returned as it is; everything but `n` is checked by the daemon."""
    if not isinstance(body, dict) or "n" not in body:
        return [body]
    rest = dict(body)
    n = _checked_int("n", rest.pop("n"), 1, MAX_CHOICES)
    seed = rest.get("seed", -1)
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        _checked_int("seed", seed, 0, MAX_SEED - (n - 1))
        return [{**rest, "seed": seed + i} for i in range(n)]
    return [dict(rest) for _ in range(n)]
