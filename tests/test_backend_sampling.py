"""Backend sampling (inside llama_decode's graph) against the host path, on the tiny model."""

from common import GREEDY
from enginekit import collect, generate, run_to_completion, submit

from cbatch.workers.engine.engine import Engine

SAMPLED = {"temperature": 1.5, "top_k": 50, "top_p": 0.98, "min_p": 0.0, "ignore_eos": True}
YES_NO = 'root ::= ("yes" | "no") "."'


def without_host_logits(engine: Engine) -> Engine:
    """Fail the test if any step reads logit rows: backend-sampled steps bring back ids only."""
    def no_logits(num_outputs):
        raise AssertionError("a backend-sampled step read logits on the host")
    engine.runner.logits = no_logits
    return engine


def token_ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


def test_backend_greedy_gives_the_host_argmax_tokens(make_engine):
    # Six requests on four slots: slots are reused; ignore_eos alternates, so both the shared
    # greedy chain and a request's own (logit bias + greedy) chain take part.
    bodies = [{"prompt": f"{c} greedy", "max_tokens": 24, "temperature": 0, "ignore_eos": i % 2 == 0}
              for i, c in enumerate("abcdef")]
    host = generate(make_engine(backend_sampling=False), bodies)
    backend = generate(without_host_logits(make_engine(backend_sampling=True)), bodies)
    assert all(len(r.token_ids) == 24 for r in host)
    assert token_ids(backend) == token_ids(host)


def test_backend_seeded_sampling_is_reproducible_for_the_same_batch(make_engine):
    bodies = [{"prompt": f"{c} sample", "max_tokens": 24, "seed": 7 + i, **SAMPLED} for i, c in enumerate("abcdef")]
    first = generate(without_host_logits(make_engine(backend_sampling=True)), bodies)
    again = generate(without_host_logits(make_engine(backend_sampling=True)), bodies)
    assert token_ids(again) == token_ids(first)
    reseeded = generate(make_engine(backend_sampling=True), [{**body, "seed": body["seed"] + 100} for body in bodies])
    assert token_ids(reseeded) != token_ids(first)
    greedy = generate(make_engine(backend_sampling=True), [{**body, **GREEDY} for body in bodies])
    assert token_ids(greedy) != token_ids(first)  # it did sample


def test_host_chain_requests_share_steps_with_backend_sampled_ones(make_engine):
    bodies = [
        {"prompt": "g", "grammar": YES_NO, "max_tokens": 20, "temperature": 0},
        {"prompt": "repeat", "max_tokens": 30, "repeat_penalty": 1.5, "frequency_penalty": 1.0, **GREEDY},
        {"prompt": "x mixed", "max_tokens": 30, **GREEDY},
        {"prompt": "y mixed", "max_tokens": 30, **GREEDY},
    ]
    host = generate(make_engine(backend_sampling=False), bodies)
    engine = make_engine(backend_sampling=True)
    ids = [submit(engine, body) for body in bodies]
    results: dict = {}
    collect(results, engine.step())
    running = sorted(engine.scheduler.running, key=lambda seq: seq.request_id)
    assert [seq.is_backend_sampled for seq in running] == [False, False, True, True]  # all in one step
    run_to_completion(engine, results)
    mixed = [results[i] for i in ids]
    assert mixed[0].text in ("yes.", "no.")
    assert token_ids(mixed) == token_ids(host)
    # The penalised request really used its penalties: plain greedy on the same prompt differs.
    plain = generate(make_engine(backend_sampling=True), [{**bodies[1], "repeat_penalty": 1.0,
                                                           "frequency_penalty": 0.0}])
    assert plain[0].token_ids != mixed[1].token_ids
