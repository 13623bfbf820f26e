"""An embedding decode is sized by time: the decode loop gives it about a generation step's
time while something generates (at least MIN_EMBED_STEP_S) and IDLE_EMBED_STEP_S when
nothing does, and the embedder fills that budget at its measured seconds per token, up to
--batch-size. Checked here without timing anything: the loop's budgets with fakes for the
engine's clock, and a real Embedder's decodes (real llama_decode on the tiny model) with
its rate set before each one. The daemon-level effect, a stream's gaps beside a large
embeddings request, is measured on gemma (test_embeddings_beside_streams.py)."""

import math
from types import SimpleNamespace

from cbatch.workers.decode.worker import IDLE_EMBED_STEP_S, MIN_EMBED_STEP_S, run_engine_loop
from cbatch.workers.engine.embedder import PIECE_TOKENS, Embedder
from cbatch.workers.messages import WorkerEmbed

TEXT = "the cat sat on the mat by the dog"  # about one token a character on the tiny model


class FakeEngine:
    """Generates for `num_steps` steps, each taking `recent_step_s` by its stats."""

    idle_wait_s = math.inf  # nothing waits for a parking or a deadline

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


def embed_pieces(embedder: Embedder, embed_id: int, texts: list[str], s_per_token: float) -> tuple[list, list]:
    """(each decode's number of tokens, the reply's vectors), the embedder's rate set to
    s_per_token before each decode (it is measured anew by each) and a budget of 8 ms."""
    job = embedder.prepare(WorkerEmbed(embed_id, texts))
    embedder.add(job)
    num_decodes_before, sizes, reply = embedder.num_decodes, [], None

    def num_done() -> int:
        return sum(len(tokens) for tokens in job.token_lists[:len(job.vectors)]) + job.num_done_tokens

    while embedder.has_work:
        embedder.s_per_token = s_per_token
        done_before = num_done()
        replies = embedder.step(budget_s=0.008)
        reply = replies[0] if replies else None
        sizes.append((job.num_tokens if reply else num_done()) - done_before)
    assert embedder.num_decodes - num_decodes_before == len(sizes) and reply.code == "", reply
    return sizes, reply.vectors


def test_a_split_input_gets_the_same_decodes_and_the_same_vector_whatever_the_budget(make_engine):
    engine = make_engine(batch_size=128)
    embedder = Embedder(engine.runner, engine.config)
    try:
        text = " ".join([TEXT] * 3)
        num_tokens = len(embedder.prepare(WorkerEmbed(0, [text])).token_lists[0])
        assert num_tokens > 2 * PIECE_TOKENS, "a longer text: it must span several pieces"
        num_whole, rest = divmod(num_tokens, PIECE_TOKENS)
        pieces = [PIECE_TOKENS] * num_whole + [rest] * bool(rest)
        runs = [embed_pieces(embedder, i + 1, [text], rate) for i, rate in enumerate((1.0, 0.001, 1e-9, 0.001))]
        # A budget worth less than a token, 8 tokens, or a whole decode: the same pieces, one a
        # decode, and the same vector bit for bit.
        assert all(sizes == pieces for sizes, _ in runs), [sizes for sizes, _ in runs]
        assert len({vectors[0] for _, vectors in runs}) == 1

        # Short inputs share a decode as the budget allows, at least one whole input each.
        short = ["a cat", "a dog", "a mat", "a hat"]
        assert len(embed_pieces(embedder, 9, short, 1.0)[0]) == 4
        assert len(embed_pieces(embedder, 10, short, 1e-9)[0]) == 1

        embedder.s_per_token = 1e-9  # a budget worth more tokens than a decode holds: --batch-size
        assert embedder.max_step_tokens(0.2) == engine.config.batch_size
        embedder.s_per_token = 1.0  # and one worth less than a token: still one
        assert embedder.max_step_tokens(0.008) == 1
    finally:
        embedder.close()
