"""Per-token log-probabilities, for the requests that ask for them (`logprobs: K`).

Computed from the model's raw logit row (before temperature, penalties or any other
sampler step), as OpenAI-style servers report them: the chosen token's log-probability
and the K most likely tokens'. One pass over the vocabulary per token (a log-sum-exp
and a partial sort), so it costs nothing for requests that do not ask.
"""

import numpy as np

TOP_SAMPLE_STRIDE = 64  # see _top_ids


def token_logprobs(logits: np.ndarray, token_id: int, num_top: int, token_piece) -> list:
    """[token_id, piece, logprob, [[id, piece, logprob], ...]] for one sampled token;
    token_piece(id) -> bytes is the token's text. Pieces are bytes: a token may end
    inside a UTF-8 character."""
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak).sum(dtype=np.float64)))
    top = []
    if num_top:
        top = [[int(t), token_piece(int(t)), float(logits[t]) - log_total] for t in _top_ids(logits, num_top)]
    return [int(token_id), token_piece(int(token_id)), float(logits[token_id]) - log_total, top]


def _top_ids(logits: np.ndarray, num_top: int) -> np.ndarray:
    """The num_top largest logits' ids, largest first. A full partition of a 262k row
    costs several times a plain pass over it, so: the num_top-th largest of every
    TOP_SAMPLE_STRIDE-th logit is at most the row's num_top-th largest, hence every id at
    or above it is a candidate (about num_top x TOP_SAMPLE_STRIDE of them), and only the
    candidates are sorted."""
    sample = logits[::TOP_SAMPLE_STRIDE]
    if len(sample) <= num_top:
        candidates = np.arange(len(logits))
    else:
        candidates = np.flatnonzero(logits >= np.partition(sample, -num_top)[-num_top])
    return candidates[np.argsort(-logits[candidates], kind="stable")[:num_top]]


def attach_logprobs(event, logprobs: dict[int, list]):
    """The event with its token's logprobs entry, when its request asked for them."""
    if event.request_id in logprobs:
        event.logprobs = [logprobs[event.request_id]]
    return event
