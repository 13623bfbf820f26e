"""An embedding decode is sized by time: the decode loop gives it about a generation step's
time while something generates (at least MIN_EMBED_STEP_S) and IDLE_EMBED_STEP_S when
nothing does, and the embedder fills that budget at its measured seconds per token, up to
--batch-size. Checked here without timing anything: the loop's budgets with fakes for the
engine's clock, and a real Embedder's decodes (real llama_decode on the tiny model) with
its rate set before each one. The daemon-level effect, a stream's gaps beside a large
embeddings request, is measured on gemma (test_embeddings_beside_streams.py)."""

from types import SimpleNamespace

import numpy as np

from cbatch.ipc.worker_messages import WorkerEmbed
from cbatch.workers.decode.worker import IDLE_EMBED_STEP_S, MIN_EMBED_STEP_S, run_engine_loop
from cbatch.workers.engine.embedder import Embedder

TEXT = "the cat sat on the mat by the dog"  # about one token a character on the tiny model


class FakeEngine:
    """Generates for `num_steps` steps, each taking `recent_step_s` by its stats."""

    def __init__(self, num_steps: int, recent_step_s: float):
        self.num_steps, self.stats = num_steps, SimpleNamespace(recent_step_s=recent_step_s)

    @property
    def has_work(self) -> bool:
        return self.num_steps > 0

    def step(self) -> list:
        self.num_steps -= 1
        return []


class FakeEmbedder:
    """Has `num_decodes` decodes to do; records each one's (budget_s, fixed_s)."""

    def __init__(self, num_decodes: int):
        self.num_decodes, self.budgets = num_decodes, []

    @property
    def has_work(self) -> bool:
        return self.num_decodes > 0

    def step(self, budget_s: float, fixed_s: float) -> list:
        self.num_decodes -= 1
        self.budgets.append((budget_s, fixed_s))
        return []


def budgets_given(engine: FakeEngine, num_decodes: int) -> list[tuple[float, float]]:
    embedder = FakeEmbedder(num_decodes)
    run_engine_loop(engine, embedder, apply_pending=lambda wait: engine.has_work or embedder.has_work,
                    publish=lambda events: None, send=lambda reply: None)
    return embedder.budgets


def test_the_loop_gives_an_embedding_decode_a_steps_time_beside_generation_and_more_when_idle():
    assert budgets_given(FakeEngine(10, 0.030), 2) == [(0.030, 0.030)] * 2
    assert budgets_given(FakeEngine(10, 0.0001), 1) == [(MIN_EMBED_STEP_S, 0.0001)]  # a decode's own cost
    assert budgets_given(FakeEngine(0, 0.030), 2) == [(IDLE_EMBED_STEP_S, 0.030)] * 2
    # One embedding decode between two generation steps, at most: 3 steps, 3 decodes interleaved.
    engine = FakeEngine(3, 0.010)
    assert len(budgets_given(engine, 5)) == 5 and engine.num_steps == 0


def test_a_real_embedder_decodes_a_budgets_worth_of_tokens(make_engine):
    engine = make_engine(batch_size=64)
    embedder = Embedder(engine.runner, engine.config)
    try:
        job = embedder.prepare(WorkerEmbed(1, [TEXT]))
        num_tokens = job.num_tokens
        assert num_tokens > 3 * 8, "a longer text: it must span several small decodes"
        alone = np.frombuffer(embed_whole(embedder, WorkerEmbed(2, [TEXT])), np.float32)

        embedder.add(job)
        sizes = []
        while embedder.has_work:
            embedder.s_per_token = 0.001  # measured anew by each decode; set so that 8 tokens fit the budget
            before = job.num_done_tokens
            (reply,) = embedder.step(budget_s=0.008) or [None]
            sizes.append((job.num_tokens if reply else job.num_done_tokens) - before)
        assert sizes[:-1] == [8] * (len(sizes) - 1) and 0 < sizes[-1] <= 8 and sum(sizes) == num_tokens
        # Split across decodes, the input is pooled as one: the vector it gets alone in one decode.
        assert reply.code == "" and np.allclose(np.frombuffer(reply.vectors[0], np.float32), alone, atol=5e-4)

        embedder.s_per_token = 1e-9  # a budget worth more tokens than a decode holds: --batch-size
        assert embedder.max_step_tokens(0.2) == engine.config.batch_size
        embedder.s_per_token = 1.0  # and one worth less than a token: still one
        assert embedder.max_step_tokens(0.008) == 1
    finally:
        embedder.close()


def embed_whole(embedder: Embedder, message: WorkerEmbed) -> bytes:
    embedder.add(embedder.prepare(message))
    embedder.s_per_token = None  # the first decode's fixed size, FIRST_STEP_TOKENS, then the measured rate
    while True:
        for reply in embedder.step(budget_s=IDLE_EMBED_STEP_S):
            assert reply.code == "", reply.message
            return reply.vectors[0]
