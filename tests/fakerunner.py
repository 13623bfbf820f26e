"""A runner with no model, for driving the engine through preemption, eviction and
decode failures.

It keeps what llama.cpp's KV would hold (the token at every position of every sequence
id, moved by the KV manager's copy, remove, save and restore operations) and its "model"
picks the next token from the whole sequence it holds. So any mistake in what the engine
reuses, trims or recomputes changes the output, as it would with a real model.

With `has_swa`, a saved state keeps the sliding-window cells within SWA_WINDOW of its end
only, as llama.cpp's does: a sequence restored from it lacks them below that, and a decode
whose window reaches a missing cell fails the test.
"""

import numpy as np

from cbatch.workers.engine.kv.base import BLOCK_TOKENS, OP_COPY, OP_REMOVE, OP_SAVE
from cbatch.workers.engine.kv.streams import WHOLE_STREAM

NUM_VOCAB = 97
EOG_ID = 0
SWA_WINDOW = 2 * BLOCK_TOKENS + 5


def encode_state(tokens: list[int], swa_from: int) -> bytearray:
    return bytearray(np.asarray([swa_from, *tokens], "<i8").tobytes())


def decode_state(state: bytearray) -> tuple[list[int], int]:
    swa_from, *tokens = np.frombuffer(bytes(state), "<i8").tolist()
    return tokens, swa_from


class FakeRunner:
    def __init__(self, num_cells=1024, parallel=4, num_seq_ids=16, prefix_cache=True, has_swa=False, unified=True,
                 eog_at_length: int | None = None):
        self.unified = unified
        # From a sequence of this many tokens on, the "model" likes end-of-generation
        # best: greedy picks it unless ignore_eos or min_tokens masks it.
        self.eog_at_length = eog_at_length
        self.num_cells, self.has_prefix_cache = num_cells, prefix_cache
        self.num_seq_ids = num_seq_ids if unified else parallel
        self.ctx_per_seq = num_cells // parallel
        self.is_recurrent, self.has_swa = False, has_swa
        self.eog_ids = np.array([EOG_ID], np.int32)
        self.vocab = self.ctx = self.model = None
        self.n_vocab = NUM_VOCAB
        self.architecture = "fake"
        self.mark_decoding = lambda request_ids: None
        self.has_backend_sampling = False
        self.is_embedding_only = False
        self.vision = None  # no projector: no images
        self.jinja_template = None  # chats render as "role: content" lines (render_chat)
        self.num_gpu_layers = 0
        self.num_threads = 1
        self.max_token_bytes = 4  # a token per character
        self.description = "fake"
        self.kv: dict[int, list[int]] = {}
        # Sliding-window models: positions below this lack their sliding-window cells (a restore's).
        self.swa_gaps: dict[int, int] = {}
        self.num_failing_restores = 0  # the next restores llama.cpp would refuse
        self.fail_next: list[int] = []  # statuses the next decodes return instead of 0
        self.num_decodes = 0
        self._rows: list[list[int]] = []

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [1 + ord(ch) % (NUM_VOCAB - 1) for ch in text]

    def chat_template(self) -> None:
        return None  # a model without one: prompts are the caller's, and it thinks in no tags

    def render_chat(self, messages, tools=()) -> str:
        return "".join(f"{message.role}: {message.content}\n" for message in messages)

    def metadata(self, key: str) -> None:
        return None

    def token_piece(self, token: int) -> bytes:
        return bytes([ord("a") + token % 26])

    def apply_memory_ops(self, ops) -> list[int]:
        failed_ids = []
        for op in ops:
            if op[0] == OP_COPY:
                _, src, dst, start, end = op
                if end == WHOLE_STREAM:  # per-sequence streams: llama.cpp replaces dst's stream
                    assert start == 0 and not self.unified
                    self.kv[dst] = list(self.kv[src])
                    self.swa_gaps[dst] = self.swa_gaps.get(src, 0)
                    continue
                assert self.unified, "only the unified pool copies part of a sequence"
                assert len(self.kv.setdefault(dst, [])) == start, "a copy continues where dst ends"
                self.kv[dst] += self.kv[src][start:end]
                if start < self.swa_gaps.get(src, 0):
                    self.swa_gaps[dst] = min(self.swa_gaps[src], end)
            elif op[0] == OP_REMOVE:
                _, seq_id, start = op
                del self.kv.setdefault(seq_id, [])[start:]
                self.swa_gaps[seq_id] = min(self.swa_gaps.get(seq_id, 0), start)
            elif op[0] == OP_SAVE:
                self._save(*op[1:])
            elif not self._restore(*op[1:]):
                failed_ids.append(op[1])
        return failed_ids

    def _save(self, seq_id: int, entry) -> None:
        held = self.kv[seq_id]
        assert len(held) == entry.num_tokens and held == entry.tokens(), "a save holds exactly the entry's tokens"
        entry.state = encode_state(held, self._swa_from(seq_id, len(held)))
        if entry.checkpoint_tokens:
            del held[entry.checkpoint_tokens:]
            entry.checkpoint_state = encode_state(held, self._swa_from(seq_id, len(held)))

    def _swa_from(self, seq_id: int, num_tokens: int) -> int:
        """The first position whose sliding-window cell a state saved now keeps."""
        return max(num_tokens - SWA_WINDOW, self.swa_gaps.get(seq_id, 0)) if self.has_swa else 0

    def _restore(self, seq_id: int, restore) -> bool:
        assert not self.kv.get(seq_id), "a restore writes into an empty sequence"
        if self.num_failing_restores:
            self.num_failing_restores -= 1
            return False
        tokens, swa_from = decode_state(restore.state)
        assert restore.num_tokens <= len(tokens)
        self.kv[seq_id] = tokens[:restore.num_tokens]
        self.swa_gaps[seq_id] = min(swa_from, restore.num_tokens)
        if restore.checkpoint_state is not None:
            checkpoint_tokens, self.swa_gaps[seq_id] = decode_state(restore.checkpoint_state)
            assert checkpoint_tokens == self.kv[seq_id], "a checkpoint is restored at its own length"
        return True

    def set_threads(self, num_threads: int) -> None:
        self.num_threads = num_threads

    def decode(self, spans) -> int:
        self.num_decodes += 1
        if self.fail_next:
            return self.fail_next.pop(0)
        self._rows = []
        for span in spans:
            held = self.kv.setdefault(span.seq.seq_id, [])
            assert len(held) == span.start, "a span continues exactly where the sequence's KV ends"
            assert max(0, span.start - SWA_WINDOW + 1) >= self.swa_gaps.get(span.seq.seq_id, 0) or not self.has_swa, \
                "a token's sliding window reaches a cell the sequence lacks"
            held += span.seq.token_slice(span.start, span.start + span.num_tokens)
            if span.wants_logits:
                self._rows.append(list(held))
        return 0

    def start_decode(self, spans) -> None:
        self._started = spans

    def wait_decode(self) -> int:
        return self.decode(self._started)

    def sampled_tokens(self, batch_indices: list[int]) -> list[int]:
        raise AssertionError("the fake runner samples on the host only (has_backend_sampling is False)")

    def release_sampler(self, chain) -> None:
        raise AssertionError("the fake runner samples on the host only (has_backend_sampling is False)")

    def logits(self, num_outputs: int) -> np.ndarray:
        assert num_outputs == len(self._rows)
        logits = np.zeros((num_outputs, NUM_VOCAB), np.float32)
        for row, tokens in enumerate(self._rows):
            logits[row, 1 + (sum(t * (i + 1) for i, t in enumerate(tokens)) % (NUM_VOCAB - 1))] = 1.0
            if self.eog_at_length is not None and len(tokens) >= self.eog_at_length:
                logits[row, EOG_ID] = 2.0
        return logits

    def state_fingerprint(self, config) -> str:
        return f"fake-{NUM_VOCAB}-{self.has_swa}-{self.unified}"

    def close(self) -> None:
        pass
