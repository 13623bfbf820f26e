"""Imported by every Python process started with this folder on PYTHONPATH (site's
sitecustomize hook): the decode worker then crashes natively (os.abort) on two poison
prompts, as a llama.cpp bug could. The crash-blame tests use it; nothing of the project ships it.

  * DECODE_POISON: inside llama_decode, whenever its batch carries that prompt's tokens,
    whatever other requests share the batch.
  * PREPARE_POISON: inside its preparation. When a large prompt (one for the large-prompt
    preparer, whose threshold is lowered to MIN_LARGE_PROMPT_CHARS here) reached the worker
    right after it, the crash waits until that one is being prepared too, so both preparers
    are marked, the poison first; the worker's I/O thread sees both in arrival order.
"""

import ctypes
import os
import threading
import time
from array import array

import llama_cpp.llama_cpp as lc

from cbatch.workers.decode import preparer
from cbatch.workers.engine import engine, runner

DECODE_POISON = "poison inside llama_decode"
PREPARE_POISON = "poison inside preparation"
MIN_LARGE_PROMPT_CHARS = 2000
POISON_TAIL_TOKENS = 8  # a byte-level vocabulary: 8 chars, never generated in a row by chance
WAIT_S = 60.0  # at most, for the other preparer (a bound for a test on a loaded machine)

preparer.MIN_LARGE_PROMPT_CHARS = MIN_LARGE_PROMPT_CHARS
_poison_tails: list[bytes] = []  # the decode poison's last tokens, as int32 bytes in a batch
_poison_seen, _large_seen = threading.Event(), threading.Event()  # by the I/O thread, in arrival order
_poison_waiting, _large_started = threading.Event(), threading.Event()

_tokenize, _llama_decode = runner.LlamaRunner.tokenize, lc.llama_decode
_prepare_submit, _prepare_request = preparer.RequestPreparer._prepare, engine.Engine.prepare
_is_large_prompt = preparer.is_large_prompt


def tokenize(self, text, add_special=True):
    tokens = _tokenize(self, text, add_special)
    if DECODE_POISON in text:
        _poison_tails.append(array("i", tokens[-POISON_TAIL_TOKENS:]).tobytes())
    return tokens


def llama_decode(ctx, batch):
    if _poison_tails:
        tokens = ctypes.string_at(batch.token, 4 * batch.n_tokens)
        if any(tail in tokens for tail in _poison_tails):
            os.abort()
    return _llama_decode(ctx, batch)


def is_large_prompt(submit):
    """Called by the I/O thread on each submit as it arrives, to route it."""
    is_large = _is_large_prompt(submit)
    if is_large and _poison_seen.is_set():
        _large_seen.set()
    elif PREPARE_POISON in (submit.request[0] or ""):
        _poison_seen.set()
    return is_large


def prepare_submit(self, submit):
    if _is_large_prompt(submit) and _large_seen.is_set():  # marked after the poison marked itself
        _poison_waiting.wait(WAIT_S)
    return _prepare_submit(self, submit)


def prepare_request(self, request):
    text = request.prompt or ""
    if PREPARE_POISON in text:
        _poison_waiting.set()
        if _large_seen.is_set():
            _large_started.wait(WAIT_S)
        os.abort()
    if len(text) >= MIN_LARGE_PROMPT_CHARS and _large_seen.is_set():
        _large_started.set()
        time.sleep(WAIT_S)  # still being prepared, and marked, when the poison crashes the worker
    return _prepare_request(self, request)


runner.LlamaRunner.tokenize, lc.llama_decode = tokenize, llama_decode
preparer.RequestPreparer._prepare, engine.Engine.prepare = prepare_submit, prepare_request
preparer.is_large_prompt = is_large_prompt  # before the I/O thread's module imports it
