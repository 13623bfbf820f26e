"""Imported by every Python process started with this folder on PYTHONPATH (site's
sitecustomize hook): the decode worker then crashes natively (os.abort) on two poison
prompts, as a llama.cpp bug could. The crash-blame tests use it; nothing of the project ships it.

  * DECODE_POISON: inside llama_decode, whenever its batch carries that prompt's tokens,
    whatever other requests share the batch.
  * PREPARE_POISON: inside its preparation. In the first worker to see it, the crash waits
    until a large prompt (one for the large-prompt preparer, whose threshold is lowered to
    MIN_LARGE_PROMPT_CHARS here) is being prepared too, which waits to be marked until the
    poison is: both preparers are marked, the poison first. The crash leaves the file named by
    $CBATCH_TEST_CRASHED_FILE, and later workers crash (or prepare a large prompt) at once.
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
CRASHED_FILE = os.environ.get("CBATCH_TEST_CRASHED_FILE", "")

preparer.MIN_LARGE_PROMPT_CHARS = MIN_LARGE_PROMPT_CHARS
_poison_tails: list[bytes] = []  # the decode poison's last tokens, as int32 bytes in a batch
_poison_waiting, _large_started = threading.Event(), threading.Event()

_tokenize, _llama_decode = runner.LlamaRunner.tokenize, lc.llama_decode
_prepare_submit, _prepare_request = preparer.RequestPreparer._prepare, engine.Engine.prepare


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


def is_first_crash() -> bool:
    return bool(CRASHED_FILE) and not os.path.exists(CRASHED_FILE)


def prepare_submit(self, submit):
    if preparer.is_large_prompt(submit) and is_first_crash():  # marked after the poison marked itself
        _poison_waiting.wait(WAIT_S)
    return _prepare_submit(self, submit)


def prepare_request(self, request, deadline_s):
    text = request.prompt or ""
    if PREPARE_POISON in text:
        _poison_waiting.set()
        if is_first_crash():
            _large_started.wait(WAIT_S)
            open(CRASHED_FILE, "w").close()
        os.abort()
    if len(text) >= MIN_LARGE_PROMPT_CHARS and is_first_crash():
        _large_started.set()
        time.sleep(WAIT_S)  # still being prepared, and marked, when the poison crashes the worker
    return _prepare_request(self, request, deadline_s)


runner.LlamaRunner.tokenize, lc.llama_decode = tokenize, llama_decode
preparer.RequestPreparer._prepare, engine.Engine.prepare = prepare_submit, prepare_request
