"""Constraints compiled by llguidance: a request's JSON schema or grammar made into a
matcher over the model's vocabulary, which says after every token which tokens may come
next.

- The vocabulary adapter (llguidance's tokenizer over llama.cpp's vocabulary) is built
  once per model, by the first constrained request's preparation (about a second for a
  262k vocabulary), never on the decode loop's thread.
- A constraint is compiled in a preparer thread (llguidance releases the GIL while it
  builds), bounded by LIMITS, and kept by its text: the next request with the same
  schema or grammar gets a copy of the compiled matcher (a deep copy shares the compiled
  grammar) instead of compiling it again.
- A constraint llguidance cannot compile, or a feature it does not implement, is an
  invalid_request that names the field and what llguidance said.

Grammars: text that starts with `%llguidance` is llguidance's Lark (as llama.cpp's server
takes it); any other is GBNF, converted to Lark by llguidance's own converter.
"""

import threading
import time
from collections import OrderedDict, deque

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from cbatch.errors import CbatchError, INVALID_REQUEST
from cbatch.params import JSON_OPTIONS, SamplingParams

LARK_MARKER = "%llguidance"
MAX_COMPILED = 128  # compiled constraints kept for reuse, the least recently used dropped first
MAX_TIMINGS = 1024  # compile times kept for the statistics
# llguidance's own bounds on a grammar's size and on each step's work: a hostile schema
# fails to compile, or its request ends with an error, in bounded time and memory.
LIMITS = llguidance.LLParserLimits(max_grammar_size=500_000, initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000,
                                   verbose_errors=False)


def _llguidance_grammar(params: SamplingParams) -> tuple[str, str]:
    """(the request field it comes from, the llguidance grammar of its constraint)."""
    if params.json_schema is not None:
        try:
            return "json_schema", llguidance.LLMatcher.grammar_from_json_schema(params.json_schema, defaults=JSON_OPTIONS)
        except ValueError as err:
            raise CbatchError(INVALID_REQUEST, f"json_schema cannot be compiled: {err}") from None
    text = params.grammar
    if text.lstrip().startswith(LARK_MARKER):
        return "grammar", llguidance.LLMatcher.grammar_from_lark(text)
    try:
        return "grammar", llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    except RecursionError:
        raise CbatchError(INVALID_REQUEST, "grammar nests too deep to parse as GBNF") from None
    except Exception as err:  # the converter's own errors, and what a malformed grammar trips in it
        raise CbatchError(INVALID_REQUEST, f"grammar does not parse as GBNF: {err}") from None


class ConstraintCompiler:
    """One model's vocabulary adapter and its compiled constraints. Thread-safe: the two
    preparer threads compile; the adapter is built once, under a lock."""

    def __init__(self, vocab, eog_ids):
        self._vocab, self._eog_ids = vocab, [int(t) for t in eog_ids]
        self._tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self.adapter_build_s: float | None = None  # how long the vocabulary adapter took, once built
        self.compile_s: deque[float] = deque(maxlen=MAX_TIMINGS)  # the latest compiles' times, for the statistics

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab

                started = time.perf_counter()
                self._tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=self._eog_ids)
                self.adapter_build_s = time.perf_counter() - started
            return self._tokenizer

    def matcher(self, params: SamplingParams) -> llguidance.LLMatcher:
        """A fresh matcher for the request's constraint; raises CbatchError if it cannot compile."""
        key = (params.grammar, params.json_schema)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled.deep_copy()
        field, grammar = _llguidance_grammar(params)
        started = time.perf_counter()
        compiled = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=LIMITS)
        elapsed_s = time.perf_counter() - started
        if compiled.is_error():
            raise CbatchError(INVALID_REQUEST, f"{field} cannot be used as a constraint: {compiled.get_error()}")
        with self._lock:
            self.compile_s.append(elapsed_s)
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()
