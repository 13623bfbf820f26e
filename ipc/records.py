"""The record format that the ring and the front-end's relay share, and the one name for
what a decode step produced for one request on its way there (`TokenEvent`).

A 64-byte record (RECORD_DTYPE) carries one token and up to MAX_TEXT_BYTES of the text
it releases; longer text continues in token-less records. A request's records are
numbered from 0; its last record has FLAG_LAST, the finish reason and the request's
total record count, so a reader can prove it saw everything.

`TokenEvent.records()` is the one definition of that framing; `frame_events` builds the
records of a whole step at once as one numpy array and gives each event exactly what its
records() gives (the common event, one token with at most MAX_TEXT_BYTES of text, never
becomes a Python record object).
"""

import struct
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import numpy as np

RECORD_SIZE_BYTES = 64
MAX_TEXT_BYTES = 32

# A request's first record is its index 0 and a continuation is a record without a token:
# the last record, which ends the reader's watch, is the one fact the index cannot tell.
FLAG_LAST = 1
ALL_FLAGS = FLAG_LAST
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR, FINISH_TIMEOUT = range(6)
NO_TOKEN = -1
FINISH_CODES = {"": FINISH_NONE, "stop": FINISH_STOP, "length": FINISH_LENGTH, "cancelled": FINISH_CANCELLED,
                "error": FINISH_ERROR, "timeout": FINISH_TIMEOUT}
MAX_FINISH_CODE = max(FINISH_CODES.values())

_RECORD_FIELDS = {
    "names": ["seq", "request_id", "index", "token_id", "flags", "finish", "text_len",
              "count", "text"],
    "formats": ["<u8", "<u8", "<u4", "<i4", "<u2", "u1", "u1", "<u4", ("u1", MAX_TEXT_BYTES)],
    "offsets": [0, 8, 16, 20, 24, 26, 27, 28, 32],
    "itemsize": RECORD_SIZE_BYTES,
}
RECORD_DTYPE = np.dtype(_RECORD_FIELDS)
# Same layout as RECORD_DTYPE, for packing/unpacking whole records in one C call each.
RECORD_STRUCT = struct.Struct("<QQIiHBBI32s")
assert RECORD_STRUCT.size == RECORD_DTYPE.itemsize == RECORD_SIZE_BYTES


_TOKEN_IDS = attrgetter("token_ids")


class RingRecord(NamedTuple):
    request_id: int
    index: int
    token_id: int  # NO_TOKEN when the record carries only text continuation or the finish
    flags: int
    finish: int
    count: int  # on the LAST record: total records of the request
    text: bytes


@dataclass(slots=True)  # slotted: a decode step makes one per generating sequence
class TokenEvent:
    """What one decode step produced for one request: made by the engine, numbered
    (`index`) by the decode worker's publisher, written to the ring as records and sent to
    the front-end. The last event of a request carries finish_reason and usage (and error
    when the reason is "error")."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    usage: dict | None = None
    error: str | None = None
    logprobs: list | None = None  # per token, for requests that asked (engine/sampling/logprobs.py)
    index: int = 0  # the request's record index of the event's first record
    error_code: str = ""  # with "error": the stable code the caller gets (cbatch.errors); "" = decode_failed
    stop_string: str = ""  # with "stop": the request's stop string that ended it ("" for the model's own end)

    @property
    def finish(self) -> int:
        """The record format's finish code; KeyError for a reason it has none for."""
        return FINISH_CODES[self.finish_reason]

    def records(self) -> list[RingRecord]:
        """The records this event becomes, numbered from `index`: one per token, the text
        on the last token record and spilling into token-less continuation records; the
        finish (with the stream's record count) on the final one. The one framing of
        records: the writer publishes exactly these, and the front-end keeps the same for
        relay and recovery, so both agree on indices."""
        request_id, index, token_ids, finish = self.request_id, self.index, self.token_ids, self.finish
        text = self.text.encode()
        if len(token_ids) == 1 and len(text) <= MAX_TEXT_BYTES:  # the common case: one token per step
            return [RingRecord(request_id, index, token_ids[0], FLAG_LAST if finish else 0, finish,
                               index + 1 if finish else 0, text)]
        pieces = [text[at:at + MAX_TEXT_BYTES] for at in range(0, len(text), MAX_TEXT_BYTES)]
        rows = [(token_id, b"") for token_id in token_ids]
        if rows and pieces:
            rows[-1] = (rows[-1][0], pieces[0])
            rows += [(NO_TOKEN, piece) for piece in pieces[1:]]
        else:
            rows += [(NO_TOKEN, piece) for piece in pieces]
        if not rows and finish:
            rows.append((NO_TOKEN, b""))
        records = []
        for row_number, (token_id, piece) in enumerate(rows):
            is_last = bool(finish) and row_number == len(rows) - 1
            records.append(RingRecord(request_id, index + row_number, token_id, FLAG_LAST if is_last else 0,
                                      finish if is_last else 0, index + row_number + 1 if is_last else 0, piece))
        return records


def frame_events(events: list[TokenEvent]) -> tuple[np.ndarray, list[int]]:
    """(records, counts): the records of every event in event order as one RECORD_DTYPE
    array (seq left 0 for the writer), and each event's number of records. A step whose
    events are each one token with at most MAX_TEXT_BYTES of text (a decode step's usual
    events) packs each event straight into its record, one struct call each (faster than
    filling numpy columns from lists below a few hundred events), with no Python record
    object; any other step goes through each event's records(). Raises KeyError, TypeError,
    ValueError, AttributeError, OverflowError or struct.error (a field out of the record's
    range) for an event that cannot be framed."""
    texts = [event.text.encode() for event in events]
    if not events or max(map(len, texts)) > MAX_TEXT_BYTES or set(map(len, map(_TOKEN_IDS, events))) != {1}:
        return _frame_each(events)
    pack = RECORD_STRUCT.pack
    packed = []
    for event, text in zip(events, texts):
        finish, index = FINISH_CODES[event.finish_reason], event.index
        if finish:
            packed.append(pack(0, event.request_id, index, event.token_ids[0], FLAG_LAST, finish, len(text),
                               index + 1, text))
        else:
            packed.append(pack(0, event.request_id, index, event.token_ids[0], 0, 0, len(text), 0, text))
    return np.frombuffer(b"".join(packed), RECORD_DTYPE), [1] * len(events)


def _frame_each(events: list[TokenEvent]) -> tuple[np.ndarray, list[int]]:
    pack = RECORD_STRUCT.pack
    parts, counts = [], []
    for event in events:
        records = event.records()
        parts += [pack(0, *record[:5], len(record.text), record.count, record.text) for record in records]
        counts.append(len(records))
    return np.frombuffer(b"".join(parts), RECORD_DTYPE), counts


def record_request_ids(data: bytes) -> list[int]:
    """The request id of each record in framed bytes (RECORD_DTYPE rows), in one C call."""
    return np.frombuffer(data, RECORD_DTYPE)["request_id"].tolist()


def relay_rows(data: bytes) -> list[list]:
    """Framed records as the RECORDS message's rows: [index, token_id, flags, finish, count, text]."""
    return [[index, token_id, flags, finish, count, text[:text_len]]
            for _, _, index, token_id, flags, finish, text_len, count, text in RECORD_STRUCT.iter_unpack(data)]
