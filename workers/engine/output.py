"""A step's sampled tokens into its events: which sequences end (end of generation, a
last allowed token, a completed or dead-ended constraint, a stop string) and the text of
the rest.

Two passes, because of overlap (engine.py): settle() needs token ids only and runs before
the next batch is queued, so the batch never carries a sequence that has already ended;
postprocess() makes the text (detokenizing, stop strings) while that batch decodes.
"""

from collections.abc import Callable

from cbatch.errors import CbatchError
from cbatch.ipc.records import TokenEvent
from cbatch.workers.engine.model_runner import ModelRunner
from cbatch.workers.engine.sampling.logprobs import attach_logprobs
from cbatch.workers.engine.sequence import FinishReason, SeqStatus, Sequence


class OutputProcessor:
    def __init__(self, runner: ModelRunner, finish: Callable[..., TokenEvent]):
        self._token_piece = runner.token_piece
        self._eog_set = frozenset(int(t) for t in runner.eog_ids)
        self._finish = finish  # Engine._finish: ends a sequence, returns its last event

    def settle(self, sampled: list[tuple[Sequence, int]], dead_ends: list[tuple[Sequence, CbatchError | None]],
               logprobs: dict[int, list], events: list[TokenEvent]) -> list[tuple[Sequence, int]]:
        """What needs token ids only: a dead end (its constraint allows no token it may take:
        `stop` when the constraint is complete, else its error), an end of generation, a
        last allowed token or a constraint that allows nothing more (`stop`, this token
        kept) ends its sequence now (into `events`); the others get their token appended and
        are returned for their text."""
        finish = self._finish
        for seq, error in dead_ends:
            if seq.status is SeqStatus.FINISHED:
                continue  # cancelled, or past its deadline, after it was sampled in this step: ended already
            events.append(finish(seq, FinishReason.STOP) if error is None else
                          finish(seq, FinishReason.ERROR, error.message, error_code=error.code))
        to_text = []
        eog_set = self._eog_set
        for seq, token in sampled:
            if token in eog_set and not seq.params.ignore_eos:
                events.append(finish(seq, FinishReason.STOP, text=seq.text.finish()))
                continue
            output_ids = seq.output_ids
            output_ids.append(token)
            if seq.gate is not None and seq.gate.passes(self._token_piece(token)):  # the constraint starts now
                seq.matcher, seq.gate = seq.gate.matcher, None
            is_complete = seq.matcher is not None and seq.matcher.is_stopped()
            if is_complete or len(output_ids) >= seq.max_output_tokens:
                text = seq.text.push(self._token_piece(token))
                event = (finish(seq, FinishReason.STOP, token_ids=[token], text=text) if seq.text.is_stopped
                         else finish(seq, FinishReason.STOP if is_complete else FinishReason.LENGTH,
                                     token_ids=[token], text=text + seq.text.finish()))
                events.append(attach_logprobs(event, logprobs))
            else:
                to_text.append((seq, token))
        return to_text

    def postprocess(self, to_text: list[tuple[Sequence, int]], logprobs: dict[int, list]) -> list[TokenEvent]:
        """Text for each appended token of a sequence that goes on; a stop string ends it
        (with overlap on, after the next batch was queued: that batch's token for it is
        never used)."""
        events = []
        token_piece = self._token_piece
        for seq, token in to_text:
            text_stream = seq.text
            text = text_stream.push(token_piece(token))
            if text_stream.is_stopped:
                events.append(self._finish(seq, FinishReason.STOP, token_ids=[token], text=text))
            else:
                events.append(TokenEvent(seq.request_id, [token], text))
        if logprobs:
            for event in events:
                attach_logprobs(event, logprobs)
        return events
