"""Embedding requests as every part reads them: the inputs' shape, the limits, the vectors' bytes.

An embedding request carries a list of inputs, each a string or a list of token ids; the
reply carries one vector per input, each as float32 little-endian bytes (OpenAI's base64
encoding is those bytes in base64), L2-normalized.
"""

import numpy as np

from cbatch.params import invalid

# Inputs one request may carry (OpenAI's limit). A client sends them to the daemon in
# messages of MAX_INPUTS_PER_MESSAGE, so that a reply of vectors of up to 16,384
# dimensions (the widest of today's large models) fits in half the protocol's frame
# limit, the worker's bound (embedder.py); the worker batches messages together anyway.
MAX_INPUTS = 2048
MAX_INPUTS_PER_MESSAGE = 32
MAX_TOKEN_ID = (1 << 31) - 1
VECTOR_DTYPE = np.dtype("<f4")


def parse_inputs(value, max_inputs: int = MAX_INPUTS) -> list:
    """`input` as OpenAI takes it: a string, a list of strings, a list of token ids (one
    input) or a list of such lists; returned as a list of inputs."""
    if isinstance(value, str) or (isinstance(value, list) and value and _is_token_list(value)):
        value = [value]
    if not isinstance(value, list):
        raise invalid("input must be a string, a list of strings, or a list of token-id lists")
    if not value:
        raise invalid("input must not be empty")
    if len(value) > max_inputs:
        raise invalid(f"input has {len(value)} items; at most {max_inputs} per request")
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise invalid(f"input[{i}] is an empty string")
        elif not (isinstance(item, list) and item and _is_token_list(item)):
            raise invalid(f"input[{i}] must be a non-empty string or a non-empty list of token ids")
    return value


def _is_token_list(items: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in items)


def parse_dimensions(value) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise invalid("dimensions must be a positive integer")
    return value


def vector_bytes(vector: np.ndarray) -> bytes:
    return np.asarray(vector, VECTOR_DTYPE).tobytes()


def vector_list(data: bytes) -> list[float]:
    return np.frombuffer(data, VECTOR_DTYPE).tolist()
