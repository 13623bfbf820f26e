"""Per-sequence token choice.

With backend sampling (workers/engine/sampling/backend.py) a request that does not need the host
chain is sampled inside llama_decode's graph; its chain below is attached to its sequence
id, plain greedy shares one chain per id. On the host, plain greedy (temperature 0, no
penalties) is one numpy argmax over the logit rows of all such sequences; no
per-sequence object exists. Anything else gets its own llama.cpp sampler chain (native
code over the full vocabulary), which also keeps the state that must live across steps:
penalty history, RNG. A constraint is not in the chain: its matcher checks the chain's
pick (structured/rows.py).
"""

import llama_cpp.llama_cpp as lc
import numpy as np

from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.params import SamplingParams

PENALTY_LAST_N = 64  # tokens of history the repeat/presence/frequency penalties look at
RANDOM_SEED = lc.LLAMA_DEFAULT_SEED


def needs_host_sampling(params: SamplingParams) -> bool:
    """Whether the request needs what llama.cpp cannot run inside its graph: a constraint,
    penalties over the token history, a logit bias or min_tokens (applied to the host's
    logit rows here), and log-probabilities (read from those rows). Everything else can
    be backend-sampled."""
    return (
        params.logprobs is not None
        or params.has_constraint
        or params.repeat_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or bool(params.logit_bias)
        or params.min_tokens > 0
    )


def _logit_biases(vocab, eog_ids: np.ndarray, params: SamplingParams) -> list[tuple[int, float]]:
    """The request's logit_bias, plus -inf on end-of-generation tokens for ignore_eos."""
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    for token, _ in params.logit_bias:
        if token >= n_vocab:
            raise CbatchError(INVALID_REQUEST,
                              f"logit_bias token id {token} is beyond the vocabulary ({n_vocab} tokens)")
    biases = list(params.logit_bias)
    if params.ignore_eos:
        biases += [(int(t), float("-inf")) for t in eog_ids]
    return biases


def make_sampler_chain(vocab, eog_ids: np.ndarray, params: SamplingParams, prompt_ids: list[int],
                       on_backend: bool = False):
    """Build the llama.cpp chain for `params`, or return None for plain greedy (an argmax
    on the host, a shared greedy chain on the backend). On the backend, greedy with
    ignore_eos needs its own chain: the end-of-generation ban is a logit bias there.
    min_tokens is not in the chain: see suppress_eog."""
    if params.is_plain_greedy and not (on_backend and params.ignore_eos):
        return None
    biases = _logit_biases(vocab, eog_ids, params)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    if biases:
        array = (lc.llama_logit_bias * len(biases))(*(lc.llama_logit_bias(t, b) for t, b in biases))
        bias_sampler = lc.llama_sampler_init_logit_bias(lc.llama_vocab_n_tokens(vocab), len(biases), array)
        lc.llama_sampler_chain_add(chain, bias_sampler)
    if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        penalties = lc.llama_sampler_init_penalties(
            lc.llama_vocab_n_tokens(vocab), PENALTY_LAST_N, params.repeat_penalty, params.frequency_penalty,
            params.presence_penalty
        )
        # The prompt counts as history for the penalties, as in llama.cpp's own server.
        for token in prompt_ids[-PENALTY_LAST_N:]:
            lc.llama_sampler_accept(penalties, token)
        lc.llama_sampler_chain_add(chain, penalties)
    if params.temperature == 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(params.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(params.temperature))
    seed = RANDOM_SEED if params.seed < 0 else params.seed
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
    return chain


def suppress_eog(logits: np.ndarray, row: int, eog_ids: np.ndarray) -> None:
    """min_tokens: no end of generation yet. Writes -inf into llama.cpp's logit buffer
    (ours until the next decode), which the chain then reads."""
    logits[row, eog_ids] = -np.inf


def sample_with_chain(chain, ctx, batch_index: int) -> int:
    # Applies the chain to the logits of that batch row and accepts the result into
    # the chain's state (penalties, RNG).
    return lc.llama_sampler_sample(chain, ctx, batch_index)


def greedy_rows(logits: np.ndarray, rows: list[int], mask_eog_rows: list[int], eog_ids: np.ndarray) -> np.ndarray:
    """argmax of each listed row; rows in `mask_eog_rows` (ignore_eos) never pick an
    end-of-generation token. Masking writes -inf into llama.cpp's logit buffer, which
    is ours until the next decode."""
    for row in mask_eog_rows:
        logits[row, eog_ids] = -np.inf
    if rows == list(range(logits.shape[0])):  # forks share a row: a row may be listed twice
        return logits.argmax(axis=1)
    return np.array([logits[row].argmax() for row in rows], np.int64)


def free_sampler_chain(chain) -> None:
    if chain is not None:
        lc.llama_sampler_free(chain)
