"""Reading one decoded batch: which row each sampling sequence got, its token (sampled in
llama.cpp's graph, by one numpy argmax for plain greedy, or by its host chain; a
constrained row's pick then checked by its matcher, structured/rows.py), and the
log-probabilities of those that asked.

A batch may still hold the span of a sequence that ended after the batch was queued (a
stop string found while it decoded, with overlap on): its row keeps its place in the
output, so the others' rows stay right, but it is neither counted nor sampled.
"""

import numpy as np

from cbatch.errors import CbatchError
from cbatch.workers.engine.model_runner import ModelRunner
from cbatch.workers.engine.sampling.host import greedy_rows, sample_with_chain, suppress_eog
from cbatch.workers.engine.sampling.logprobs import token_logprobs
from cbatch.workers.engine.sequence import Sequence
from cbatch.workers.engine.structured.manager import StructuredOutput
from cbatch.workers.engine.structured.rows import Proposal
from cbatch.workers.engine.thinking.budget import forced_tokens, track_budgets


class StepSampler:
    def __init__(self, runner: ModelRunner, structured: StructuredOutput, mark_sampling=None):
        self.runner = runner
        self._structured = structured  # the constrained picks' check and masks
        # Told the id of each request whose host chain runs, and 0 after them: the decode
        # worker's writes it where it outlives a crash (the ring's header; workers/daemon/quarantine.py).
        self._mark_sampling = mark_sampling or (lambda request_id: None)
        # Sequences whose constraint left no allowed token at the last sample() (structured/rows.py),
        # with the error that ends them (None: they end as `stop`); take_dead_ends() empties it.
        self._dead_ends: list[tuple[Sequence, CbatchError | None]] = []

    def sample(self, logit_rows: list[tuple[Sequence, int, int]], num_outputs: int
               ) -> tuple[list[tuple[Sequence, int]], dict[int, list]]:
        """logit_rows: (sequence, output row, batch index) of the live sequences that sample;
        num_outputs: the batch's output rows, ended sequences' included. Returns the
        (sequence, token) pairs and request id -> logprobs entry for those that asked.

        In phases, in this order: tokens a thinking budget forces; raw rows kept for
        logprobs; tokens sampled in llama.cpp's graph; greedy rows; host chains; the
        constrained picks checked (masks for the misses); the budgets told what was
        accepted; logprobs."""
        all_rows = logit_rows
        has_budgets = any(seq.budget is not None for seq, _, _ in logit_rows)
        forced = self._forced(logit_rows) if has_budgets else {}
        if forced:  # their logit rows are read for logprobs only
            logit_rows = [entry for entry in logit_rows if entry[0] not in forced]
        raw_rows = self._rows_before_masking(logit_rows, num_outputs)
        sampled = self._backend_sampled(logit_rows)
        proposals = []  # constrained picks, checked together below
        self._greedy(logit_rows, num_outputs, sampled, proposals)
        self._chains(logit_rows, num_outputs, sampled, proposals)
        if proposals:
            rows = self._structured.rows
            kept, dead_ends = rows.resolve(proposals, self.runner.logits(num_outputs), self._mark_sampling)
            sampled += kept
            self._dead_ends += dead_ends
        self._mark_sampling(0)
        if has_budgets:
            sampled += forced.items()
            track_budgets(sampled, self.runner.token_piece)
        return sampled, self._logprobs(all_rows, num_outputs, sampled, raw_rows)

    def _forced(self, logit_rows) -> dict[Sequence, int]:
        """The tokens thinking budgets force this step; the matchers of their sequences
        move on, so a mask made ahead for one is stale."""
        forced = forced_tokens([entry for entry in logit_rows if entry[0].budget is not None])
        if forced:
            self._structured.drop_masks_ahead(forced)
        return forced

    def _backend_sampled(self, logit_rows) -> list[tuple[Sequence, int]]:
        indices = [(seq, index) for seq, _, index in logit_rows if seq.is_backend_sampled]
        if not indices:
            return []
        return list(zip([seq for seq, _ in indices], self.runner.sampled_tokens([index for _, index in indices])))

    def _greedy(self, logit_rows, num_outputs: int, sampled: list, proposals: list) -> None:
        """Plain greedy rows by one argmax; a constrained one's pick goes to the check."""
        greedy = [(seq, row) for seq, row, _ in logit_rows if seq.sampler is None and not seq.is_backend_sampled]
        if not greedy:
            return
        runner = self.runner
        masked = [row for seq, row in greedy if seq.params.ignore_eos]
        token_ids = greedy_rows(runner.logits(num_outputs), [row for _, row in greedy], masked, runner.eog_ids)
        for (seq, row), token in zip(greedy, token_ids.tolist()):
            if seq.matcher is None:
                sampled.append((seq, token))
            else:
                proposals.append(Proposal(seq, row, token, None))

    def _chains(self, logit_rows, num_outputs: int, sampled: list, proposals: list) -> None:
        """Host sampler chains, each under the crash mark of its request; a constrained
        one's pick goes to the check."""
        runner = self.runner
        for seq, row, index in logit_rows:
            if seq.sampler is None or seq.is_backend_sampled:
                continue
            self._mark_sampling(seq.request_id)
            is_eog_banned = seq.num_output_tokens < seq.params.min_tokens
            if seq.matcher is not None:
                banned_ids = runner.eog_ids if is_eog_banned else None
                token = self._structured.rows.candidates.pick(seq.sampler, runner.logits(num_outputs)[row], banned_ids)
                proposals.append(Proposal(seq, row, token, banned_ids))
                continue
            if is_eog_banned:
                suppress_eog(runner.logits(num_outputs), row, runner.eog_ids)
            sampled.append((seq, sample_with_chain(seq.sampler, runner.ctx, index)))

    def take_dead_ends(self) -> list[tuple[Sequence, CbatchError | None]]:
        dead_ends, self._dead_ends = self._dead_ends, []
        return dead_ends

    def _rows_before_masking(self, logit_rows, num_outputs: int) -> dict[int, np.ndarray]:
        """request id -> a copy of its logit row, for the requests that ask for logprobs and
        whose end-of-generation logits sample() is about to overwrite with -inf (ignore_eos
        when greedy, min_tokens not reached): logprobs are the raw row's."""
        masked = [(row, seq) for seq, row, _ in logit_rows if seq.params.logprobs is not None
                  and (seq.params.ignore_eos if seq.sampler is None else seq.num_output_tokens < seq.params.min_tokens)]
        if not masked:
            return {}
        logits = self.runner.logits(num_outputs)
        return {seq.request_id: logits[row].copy() for row, seq in masked}

    def _logprobs(self, logit_rows, num_outputs: int, sampled: list[tuple[Sequence, int]],
                  raw_rows: dict[int, np.ndarray]) -> dict[int, list]:
        asking = [(seq, token) for seq, token in sampled if seq.params.logprobs is not None]
        if not asking:
            return {}
        logits = self.runner.logits(num_outputs)
        row_of = {seq.request_id: row for seq, row, _ in logit_rows}
        return {seq.request_id: token_logprobs(raw_rows.get(seq.request_id, logits[row_of[seq.request_id]]), token,
                                               seq.params.logprobs, self.runner.token_piece) for seq, token in asking}
