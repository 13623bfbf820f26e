"""Helpers shared by the engine tests: run requests to completion and collect results."""

import itertools
from dataclasses import dataclass, field

from cbatch.params import parse_request

_ids = itertools.count(1)


@dataclass
class Result:
    text: str = ""
    token_ids: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None


def submit(engine, body: dict) -> int:
    request = parse_request(next(_ids), body)
    engine.add_request(request)
    return request.request_id


def collect(results: dict, outputs) -> None:
    for out in outputs:
        result = results.setdefault(out.request_id, Result())
        assert result.finish_reason is None, "an event arrived after the request finished"
        result.text += out.text
        result.chunks.append(out.text)
        result.token_ids += out.token_ids
        if out.finish_reason:
            result.finish_reason, result.usage, result.error = out.finish_reason, out.usage, out.error


def run_to_completion(engine, results: dict | None = None, max_steps: int = 100_000) -> dict:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_work:
            return results
        collect(results, engine.step())
    raise AssertionError("engine did not drain")


def generate(engine, bodies: list[dict]) -> list[Result]:
    ids = [submit(engine, body) for body in bodies]
    results = run_to_completion(engine)
    return [results[i] for i in ids]
