"""Ring tests speak in records' terms (bytes of text, finish codes); the writer takes TokenEvents."""

from cbatch.ipc.records import FINISH_CODES, FINISH_NONE, TokenEvent

_REASONS = {code: reason for reason, code in FINISH_CODES.items()}


def event(request_id: int, index: int, token_ids: list[int], text: bytes = b"",
          finish: int = FINISH_NONE) -> TokenEvent:
    return TokenEvent(request_id, token_ids, text.decode(), _REASONS[finish], index=index)


def publish(writer, request_id: int, index: int, token_ids: list[int], text: bytes = b"",
            finish: int = FINISH_NONE) -> int:
    """Publish one event; the index its request's next record will have."""
    return writer.publish_many([event(request_id, index, token_ids, text, finish)])[0]
