"""Constraints compiled by llguidance: a request's JSON schema or grammar made into a
matcher over the model's vocabulary, which says after every token which tokens may come
next.

- The vocabulary adapter (llguidance's tokenizer over llama.cpp's vocabulary) is built
  once per model, by a thread the decode worker starts with it (2 s for gemma's 262k
  tokens on 2 cores), never on the decode loop's thread; a constraint compiled before it
  is done waits for it.
- A constraint is compiled in a preparer thread (llguidance releases the GIL while it
  builds), bounded by LIMITS, and kept by its text: the next request with the same
  schema or grammar gets a copy of the compiled matcher (a deep copy shares the compiled
  grammar) instead of compiling it again.
- A constraint llguidance cannot compile, or a feature it does not implement, is an
  invalid_request that names the field and what llguidance said; the refusal is kept by
  the constraint's text as well, so the same bad schema sent again is refused at once.
- needs_compile tells the decode worker's I/O thread which requests would compile: they
  go to a preparer of their own, so a large schema's compile never holds up the small
  requests behind it.

Grammars: text that starts with `%llguidance` is llguidance's Lark (as llama.cpp's server
takes it); any other is GBNF, converted to Lark by llguidance's own converter. The converter
drops the parentheses of a group that holds one repeated item (`("a"{0,3}){0,3}` comes out
as `"a"{0,3}{0,3}`, which Lark refuses): they are put back (regrouped). An error in a
converted grammar says so, as it quotes the Lark text, not the caller's. A forced call's
grammar is built here from its tool_call (tool_grammar.py).
"""

import ctypes
import re
import threading
import time
from collections import OrderedDict, deque

import llama_cpp
import llama_cpp.llama_cpp as lc
import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from cbatch.constraints import JSON_OPTIONS
from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.params import SamplingParams
from cbatch.workers.engine.structured.tool_grammar import tool_call_grammar

LARK_MARKER = "%llguidance"
MAX_COMPILED = 128  # compiled constraints kept for reuse, the least recently used dropped first
MAX_TIMINGS = 1024  # compile times kept for the statistics
MAX_PIECE_BYTES = 1 << 14
# Tokens a grammar's text can never produce (control tokens: the end of a turn, a chat
# template's role markers): llguidance marks them with this first byte. User-defined tokens
# (Qwen's `<tool_call>`, `<think>`) are text: a grammar's `<tool_call>` may be that one
# token, as the model was trained to write it, or its bytes.
SPECIAL_PREFIX = b"\xff"
# llguidance's own bounds on a grammar's size and on each step's work: a hostile schema
# fails to compile, or its request ends with an error, in bounded time and memory.
LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000, initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000,
                                   verbose_errors=False)


# An atom of the converter's Lark (a string, a regular expression, a character class, a
# rule's name or a group, each matched whole so that nothing inside a string is read) with
# the repetition after it, and what follows that.
_ATOM = re.compile(r'("(?:[^"\\]|\\.)*"|/(?:[^/\\]|\\.)*/|\[(?:[^\]\\]|\\.)*\]|\b[A-Za-z_][A-Za-z0-9_]*'
                   r'|\((?:[^()"]|"(?:[^"\\]|\\.)*")*\))(\{\d*(?:,\d*)?\})?(?=([{+*?]?))')


def _grouped(match: re.Match) -> str:
    atom, repetition, after = match.groups()
    return f"({atom}{repetition})" if repetition and after else match.group(0)


def regrouped(lark: str) -> str:
    """The converter's Lark with each repetition of a repetition grouped again (see above)."""
    while True:
        grouped = _ATOM.sub(_grouped, lark)
        if grouped == lark:
            return lark
        lark = grouped


def _llguidance_grammar(params: SamplingParams) -> tuple[str, str]:
    """(the request field it comes from, the llguidance grammar of its constraint)."""
    if params.json_schema is not None:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(params.json_schema, defaults=JSON_OPTIONS)
        except ValueError as err:
            raise CbatchError(INVALID_REQUEST, f"json_schema cannot be compiled: {err}") from None
        return "json_schema", grammar
    if params.tool_call is not None:
        return "tool_call", llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(params.tool_call))
    text = params.grammar
    if text.lstrip().startswith(LARK_MARKER):
        return "grammar", llguidance.LLMatcher.grammar_from_lark(text)
    try:
        return "grammar (as llguidance's Lark, converted from GBNF)", \
            llguidance.LLMatcher.grammar_from_lark(regrouped(gbnf_to_lark(text)))
    except RecursionError:
        raise CbatchError(INVALID_REQUEST, "grammar nests too deep to parse as GBNF") from None
    except Exception as err:  # the converter's own errors, and what a malformed grammar trips in it
        raise CbatchError(INVALID_REQUEST, f"grammar does not parse as GBNF: {err}") from None


def vocabulary_adapter(vocab, eog_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over llama.cpp's vocabulary, as `llguidance.llamacpp` makes it
    but with llama.cpp's current attribute call (its deprecated one warns per token), and
    user-defined tokens as text (above)."""
    buffer = ctypes.create_string_buffer(MAX_PIECE_BYTES)
    special = lc.LLAMA_TOKEN_ATTR_CONTROL
    pieces = []
    for token in range(lc.llama_vocab_n_tokens(vocab)):
        n = lc.llama_token_to_piece(vocab, token, buffer, MAX_PIECE_BYTES, 0, True)
        piece = ctypes.string_at(buffer, max(n, 0))  # not buffer.raw: that copies the whole buffer
        attr = lc.llama_vocab_get_attr(vocab, token)
        if attr & special:
            piece = SPECIAL_PREFIX + piece
        pieces.append(piece)
    tokenize = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return llguidance.LLTokenizer.from_llamacpp(tokens=pieces, vocab_ptr=vocab, tokenize_fptr=tokenize,
                                                eos_token=eog_ids, slices=None)


class ConstraintCompiler:
    """One model's vocabulary adapter and its compiled constraints. Thread-safe: the
    preparer threads compile; the adapter is built once, under a lock."""

    def __init__(self, vocab, eog_ids):
        self._vocab, self._eog_ids = vocab, [int(t) for t in eog_ids]
        self._tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._refused: OrderedDict[tuple, CbatchError] = OrderedDict()  # the constraints that failed to compile
        self.adapter_build_s: float | None = None  # how long the vocabulary adapter took, once built
        self.compile_s: deque[float] = deque(maxlen=MAX_TIMINGS)  # the latest compiles' times, for the statistics

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                started = time.perf_counter()
                self._tokenizer = vocabulary_adapter(self._vocab, self._eog_ids)
                self.adapter_build_s = time.perf_counter() - started
            return self._tokenizer

    def needs_compile(self, params: SamplingParams) -> bool:
        """Whether the request's constraint would be compiled (neither it nor its refusal is kept)."""
        key = (params.grammar, params.json_schema, params.tool_call)
        with self._lock:
            return params.has_constraint and key not in self._compiled and key not in self._refused

    def matcher(self, params: SamplingParams) -> llguidance.LLMatcher:
        """A fresh matcher for the request's constraint; raises CbatchError if it cannot compile."""
        key = (params.grammar, params.json_schema, params.tool_call)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled.deep_copy()
            if key in self._refused:
                raise self._refused[key]
        try:
            compiled, elapsed_s = self._compile(params)
        except CbatchError as err:
            with self._lock:
                _keep(self._refused, key, err)
            raise
        with self._lock:
            self.compile_s.append(elapsed_s)
            _keep(self._compiled, key, compiled)
        return compiled.deep_copy()

    def _compile(self, params: SamplingParams) -> tuple[llguidance.LLMatcher, float]:
        field, grammar = _llguidance_grammar(params)
        tokenizer = self.tokenizer()  # waits for the adapter, outside the compile's time
        started = time.perf_counter()
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        elapsed_s = time.perf_counter() - started
        if compiled.is_error():
            raise CbatchError(INVALID_REQUEST, f"{field} cannot be used as a constraint: {compiled.get_error()}")
        return compiled, elapsed_s


def _keep(kept: OrderedDict, key: tuple, value) -> None:
    """Keep value by key, the least recently kept dropped past MAX_COMPILED."""
    kept[key] = value
    while len(kept) > MAX_COMPILED:
        kept.popitem(last=False)
