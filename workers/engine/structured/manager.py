"""Structured output's one owner in an engine: the engine makes it with the model's
vocabulary and hands it to preparation (a request's constraint compiled, or taken from
the cache, and held behind its thinking block) and to the step (the picks checked, the
misses masked). It keeps the vocabulary adapter, the compile cache and refusals
(compiler.py), the masks and their counts (rows.py) and the gate (gate.py).

A constraint reaches it as data, a request's `json_schema`, `grammar` or `tool_call` (a
forced call, whose grammar tool_grammar.py builds); what it is to the matcher is decided
here and nowhere else.
"""

import llguidance
import numpy as np

from cbatch.params import SamplingParams
from cbatch.workers.engine.structured.compiler import ConstraintCompiler
from cbatch.workers.engine.structured.gate import ThinkingGate, thinking_gate
from cbatch.workers.engine.structured.rows import ConstrainedRows


class StructuredOutput:
    def __init__(self, vocab, eog_ids: np.ndarray, n_vocab: int):
        self.compiler = ConstraintCompiler(vocab, eog_ids)  # thread-safe: the preparers compile
        self._n_vocab, self._eog_ids = n_vocab, eog_ids
        self._rows: ConstrainedRows | None = None  # made at the first constrained row

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary adapter, built at the first call (the decode worker calls it
        before it says ready)."""
        return self.compiler.tokenizer()

    def needs_compile(self, params: SamplingParams) -> bool:
        return self.compiler.needs_compile(params)

    def constraint(self, params: SamplingParams, prompt_text: str, tags: tuple[str, str] | None
                   ) -> tuple[llguidance.LLMatcher | None, ThinkingGate | None]:
        """(the matcher that holds the answer from its first token, the gate that holds it
        until the thinking block the prompt opens closes): one of them, or neither for an
        unconstrained request. Raises CbatchError for a constraint that cannot compile."""
        if not params.has_constraint:
            return None, None
        matcher = self.compiler.matcher(params)
        gate = thinking_gate(matcher, prompt_text, tags)
        return (None, gate) if gate is not None else (matcher, None)

    @property
    def rows(self) -> ConstrainedRows:
        """The step's check and masks; only the decode loop's thread uses them."""
        if self._rows is None:
            self._rows = ConstrainedRows(self._n_vocab, self._eog_ids)
        return self._rows

    @property
    def counts(self) -> tuple[int, int]:
        """(constrained tokens checked, of which missed) so far."""
        return (0, 0) if self._rows is None else (self._rows.num_checked, self._rows.num_missed)

    def prefetch_masks(self) -> None:
        """With overlap, while the next batch decodes: the masks of the rows that missed."""
        if self._rows is not None:
            self._rows.prefetch_masks()

    def drop_masks_ahead(self, seqs) -> None:
        """Their matchers moved on outside the check (a forced token): masks made ahead are stale."""
        if self._rows is not None:
            self._rows.drop_masks_ahead(seqs)
