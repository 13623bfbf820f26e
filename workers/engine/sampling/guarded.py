"""Sampling a host chain that holds a grammar without ever handing llama.cpp a token the
grammar rejects.

llama.cpp's grammar aborts the whole process when it is asked to accept a token it does
not allow (an end of generation before the grammar is complete, or any token once every
path through it is spent). `llama_sampler_sample` accepts whatever the chain picked, and
the chain picks even when every candidate is at -inf: a grammar that only allows the end
of generation, with `min_tokens` or `ignore_eos` banning it, or a `logit_bias` of -inf on
every token the grammar allows next. So such a chain is applied here sampler by sampler
to a copy of the logit row, the rows left after the grammar are checked, and a token is
accepted only when it is allowed. Otherwise the sequence reaches a dead end, which ends it
(dead_end_error) without touching the chain.
"""

import ctypes

import llama_cpp.llama_cpp as lc
import numpy as np

from cbatch.errors import CbatchError, INVALID_REQUEST

# llama_token_data, field for field (int32 id, float logit, float p; 12 bytes, no padding).
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Candidates:
    """The whole vocabulary as one reusable llama_token_data_array (one per engine: the
    decode loop samples one sequence at a time)."""

    def __init__(self, n_vocab: int):
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.data = np.zeros(n_vocab, TOKEN_DATA)
        self.array = lc.llama_token_data_array(self.data.ctypes.data_as(lc.llama_token_data_p), n_vocab, -1, False)

    def fill(self, logits_row: np.ndarray, banned_ids: np.ndarray | None) -> None:
        """The row's logits in vocabulary order (samplers reorder the array: ids are reset
        too), with the banned tokens at -inf."""
        data = self.data
        data["id"] = self.ids
        data["logit"] = logits_row
        if banned_ids is not None:
            data["logit"][banned_ids] = -np.inf
        self.array.size, self.array.selected, self.array.sorted = len(data), -1, False


def _is_grammar(sampler) -> bool:
    return lc.llama_sampler_name(sampler) == b"grammar"


def grammar_allows(chain, token: int) -> bool:
    """Whether the chain's grammar (if any) allows `token` next; reads, never advances it."""
    for i in range(lc.llama_sampler_chain_n(chain)):
        sampler = lc.llama_sampler_chain_get(chain, i)
        if _is_grammar(sampler):
            data = (lc.llama_token_data * 1)(lc.llama_token_data(token, 0.0, 0.0))
            candidates = lc.llama_token_data_array(data, 1, -1, False)
            lc.llama_sampler_apply(sampler, ctypes.byref(candidates))
            return data[0].logit != float("-inf")
    return True


def sample_guarded(chain, candidates: Candidates, logits_row: np.ndarray, banned_ids: np.ndarray | None) -> int | None:
    """The chain's token for this row, accepted into the chain; None (the chain untouched)
    when the grammar allows no token that is not banned."""
    candidates.fill(logits_row, banned_ids)
    array, logits = candidates.array, candidates.data["logit"]
    for i in range(lc.llama_sampler_chain_n(chain)):
        sampler = lc.llama_sampler_chain_get(chain, i)
        lc.llama_sampler_apply(sampler, ctypes.byref(array))
        if _is_grammar(sampler) and not np.isfinite(logits[:array.size]).any():
            return None
    selected = array.selected
    if not 0 <= selected < array.size or not np.isfinite(logits[selected]):
        # A distribution may land on a zero-probability token in rounding: take the best allowed one.
        selected = int(np.argmax(logits[:array.size]))
    token = int(candidates.data["id"][selected])
    lc.llama_sampler_accept(chain, token)
    return token


def dead_end_error(chain, eog_ids: np.ndarray) -> CbatchError | None:
    """Why a sequence at a dead end ends: None when its grammar is complete (only the end
    of generation is left, which min_tokens or ignore_eos held back: it ends as `stop`),
    else the error that fails it."""
    if any(grammar_allows(chain, int(t)) for t in eog_ids):
        return None
    return CbatchError(INVALID_REQUEST, "the grammar allows no next token that this request permits: logit_bias "
                                        "(or ignore_eos, min_tokens) bans every token it allows here")
