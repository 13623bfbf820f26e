"""Client-side assembly of one request's records into chunks, whatever carried them.

Records come from the shared-memory ring (local clients) or in RECORDS messages (remote
clients, and recovery after a ring overrun). Either way they are numbered per request,
so the assembler takes each index exactly once, in order: a duplicate is dropped, and a
gap stops intake until the missing records arrive.
"""

import codecs
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from cbatch.errors import DECODE_FAILED, CbatchError
from cbatch.tools import ToolCallStream, ToolPlan


@dataclass
class Chunk:
    """Part of a stream. The last chunk of a request carries finish_reason and usage."""

    id: object
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict | None = None
    # With `logprobs: K` in the request: one entry per token in token_ids, {"token", "bytes",
    # "logprob", "top_logprobs": [{"token", "bytes", "logprob"}, ...K]}; else None.
    logprobs: list[dict] | None = None
    # With `tools`: on the last chunk, the calls read from the answer, in OpenAI's shape (then
    # finish_reason is "tool_calls", or "length" for a forced call max_tokens cut short, its
    # last call's arguments as far as written); text that may be a call is held back until
    # then, and `text` never holds a call. Else None.
    tool_calls: list[dict] | None = None
    # Only from an OpenAI-compatible HTTP server (cbatch-submit --url): on a chat answer's one
    # chunk, the thinking that server split off `text` (its reasoning_content; "" for none),
    # or None when the server splits nothing.
    reasoning: str | None = None
    # On the last chunk of an answer a stop string ended ("stop"): that string (it is not in
    # `text`); else None.
    stop_string: str | None = None


@dataclass
class Completion:
    id: object  # the item's "id" in a batch, else the request id
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict
    request_id: int = 0
    logprobs: list[dict] | None = None  # as Chunk.logprobs, for the whole completion
    tool_calls: list[dict] | None = None  # as Chunk.tool_calls; `text` is then the text besides the calls


@dataclass(eq=False)
class RequestStream:
    request_id: int
    label: object  # what chunks and completions are called: the item id, or request_id
    next_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    pending: deque = field(default_factory=deque)  # chunks not yet handed to the caller
    finished: dict | None = None  # the FINISHED body, once it arrived
    error: CbatchError | None = None
    is_done: bool = False
    wants_logprobs: bool = False  # then relayed rows carry a seventh column, the token's entry
    logprobs: list[dict] = field(default_factory=list)
    heard_s: float = field(default_factory=time.monotonic)  # when anything of this request last arrived
    tool_plan: ToolPlan | None = None  # the request's tools, whose calls are read from the text
    tool_calls: list[dict] | None = None  # the calls it read, once the stream is done
    # Wanted whole (generate(), a response that does not stream): the session wakes its
    # reader for the first chunk (its time to first token) and at its end, not every step.
    is_whole: bool = False
    has_woken: bool = False
    # False for generate(), which takes the completion at the end and no chunk: none is
    # made (a tenth to a fifth of a short whole response's client CPU), and its reader is
    # woken at the end only.
    keeps_chunks: bool = True
    num_pending_tokens: int = 0  # in the chunks not yet handed to the caller
    is_paused: bool = False  # the daemon was asked to pause it until the caller takes what waits

    def __post_init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tool_stream = None if self.tool_plan is None else ToolCallStream(self.tool_plan)

    def add_records(self, rows, now_s: float) -> None:
        """rows: (index, token_id, flags, finish, count, text) in index order."""
        self.heard_s = now_s
        token_ids, data, logprobs = [], [], []
        for index, token_id, _flags, _finish, _count, text, *entry in rows:
            if index < self.next_index:
                continue  # already have it (recovered and also seen in the ring)
            if index > self.next_index:
                break  # a gap: wait for recovery to fill it
            self.next_index += 1
            if token_id >= 0:
                token_ids.append(token_id)
                if self.wants_logprobs:
                    logprobs.append(_logprob_entry(entry[0]) if entry and entry[0] else None)
            data.append(text)
        if token_ids or data:
            self._emit(token_ids, self._decoder.decode(b"".join(data)),
                       logprobs=logprobs if self.wants_logprobs else None)
        self._complete_if_ready()

    def is_wake_due(self) -> bool:
        """Records arrived: whether to wake the reader. One that wants the stream whole is
        woken for its first chunk and at its end only (a whole 64-token response is then two
        wake-ups of its reader, not 64: most of what such a response cost a server's loop);
        one that keeps no chunks, at its end only."""
        if not self.keeps_chunks:
            return self.is_done
        if not self.is_whole or self.is_done:
            return True
        is_first, self.has_woken = not self.has_woken, True
        return is_first

    def on_finished(self, body: dict, now_s: float) -> None:
        self.heard_s = now_s
        self.finished = body
        self._complete_if_ready()

    def fail(self, error: CbatchError) -> None:
        """The stream ends with error; one that already ended keeps its end (a late reply
        about the same request must not make a second terminal item)."""
        if self.is_done:
            return
        self.error, self.is_done = error, True
        self.pending.append(error)

    def take(self):
        """The next chunk (the caller waited until there is one): every chunk that arrived
        since the last take, merged, so that a caller slower than the model gets several
        tokens at a time rather than falling further behind; raises the stream's error
        once the chunks before it are taken."""
        item = self.pending.popleft()
        if isinstance(item, CbatchError):
            raise item
        chunks = [item]
        while self.pending and not isinstance(self.pending[0], CbatchError):
            chunks.append(self.pending.popleft())
        return merge_chunks(chunks)

    @property
    def is_drained(self) -> bool:
        """Done, and every chunk handed to the caller."""
        return self.is_done and not self.pending

    @property
    def missing_records(self) -> bool:
        return self.finished is not None and not self.is_done

    def _emit(self, token_ids: list[int], text: str, finish_reason: str | None = None, **fields) -> None:
        if self._tool_stream is not None:  # what may be a call is held back; the calls come on the last chunk
            deltas, finish_reason = self._tool_stream.push(text, finish_reason)
            text = "".join(delta.get("content", "") for delta in deltas)
            for delta in deltas:
                if "tool_calls" in delta:
                    self.tool_calls = fields["tool_calls"] = [
                        {key: value for key, value in call.items() if key != "index"} for call in delta["tool_calls"]]
        self.token_ids += token_ids
        self.text_parts.append(text)
        self.logprobs += fields.get("logprobs") or []
        if self.keeps_chunks:
            self.pending.append(Chunk(self.label, text, token_ids, finish_reason, **fields))
            self.num_pending_tokens += len(token_ids)

    def _complete_if_ready(self) -> None:
        if self.is_done or self.finished is None or self.next_index < self.finished["num_records"]:
            return
        if self.finished["finish_reason"] == "error":
            # The one place a failed decode becomes an error: every consumer gets it as the
            # stream's last item, with the worker's reason, never as a finished chunk.
            self.fail(CbatchError(self.finished.get("error_code") or DECODE_FAILED,
                                  self.finished.get("error") or "the decode step of this request failed"))
            return
        self.is_done = True
        self._emit([], self._decoder.decode(b"", final=True), finish_reason=self.finished["finish_reason"],
                   usage=self.finished["usage"], logprobs=[] if self.wants_logprobs else None,
                   stop_string=self.finished.get("stop_string"))

    @property
    def finish_reason(self) -> str:
        """The daemon's, or "tool_calls" for an answer read as calls (a forced call that
        max_tokens cut short keeps "length": its last call's arguments are cut)."""
        is_cut = self.finished["finish_reason"] == "length"
        return "tool_calls" if self.tool_calls and not is_cut else self.finished["finish_reason"]

    def completion(self) -> Completion:
        if self.error is not None:
            raise self.error
        return Completion(self.label, "".join(self.text_parts), self.token_ids, self.finish_reason,
                          self.finished["usage"], self.request_id, self.logprobs if self.wants_logprobs else None,
                          self.tool_calls)


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Consecutive chunks of one request as one: what a server sends as one event."""
    last = chunks[-1]
    if len(chunks) == 1:
        return last
    logprobs = None if last.logprobs is None else list(itertools.chain.from_iterable(c.logprobs for c in chunks))
    token_ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
    return Chunk(last.id, "".join(c.text for c in chunks), token_ids, last.finish_reason, last.usage, logprobs,
                 last.tool_calls, stop_string=last.stop_string)


def completion_from_chunks(chunks: list[Chunk]) -> Completion:
    """One request's chunks, as the caller got them, made into its Completion."""
    whole = merge_chunks(chunks)
    return Completion(whole.id, whole.text, whole.token_ids, whole.finish_reason, whole.usage, logprobs=whole.logprobs,
                      tool_calls=whole.tool_calls)


def _logprob_entry(wire: list) -> dict:
    """[token_id, piece, logprob, [[id, piece, logprob], ...]] -> the Chunk.logprobs shape."""
    _, piece, logprob, top = wire
    return {"token": piece.decode("utf-8", errors="replace"), "bytes": list(piece), "logprob": logprob,
            "top_logprobs": [{"token": p.decode("utf-8", errors="replace"), "bytes": list(p), "logprob": lp}
                             for _, p, lp in top]}


class BatchResults:
    """A batch's arrivals, (position, chunk or error), made into results in input order:
    a Completion, or the CbatchError that item got. What finished is kept whatever
    happens to the rest."""

    def __init__(self, num_positions: int):
        self.results: list[Completion | CbatchError | None] = [None] * num_positions
        self._chunks: dict[int, list[Chunk]] = {}

    def add(self, position: int, item: Chunk | CbatchError) -> None:
        if isinstance(item, CbatchError):
            self._chunks.pop(position, None)
            self.results[position] = item
            return
        self._chunks.setdefault(position, []).append(item)
        if item.finish_reason:
            self.results[position] = completion_from_chunks(self._chunks.pop(position))
