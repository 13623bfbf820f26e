"""Turns a sequence's token pieces into released text.

Two things are held back until they are safe to release:
- bytes of a UTF-8 character that is not complete yet (a token may end mid-character);
- a tail of text that could still grow into one of the stop strings.
Invariant: released text never contains a stop string and never splits a character.

A stream without stop strings holds nothing back but an incomplete character, so while
no bytes are pending an ASCII piece (most tokens) is released as it is, without the
incremental decoder (a Python-level frame per call).
"""

import codecs

from cbatch.partial_markers import partial_marker_len


class TextStream:
    def __init__(self, stop: tuple[str, ...] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._held = ""  # decoded text not yet released
        self.is_stopped = False
        self.stop_string = ""  # the stop string that ended the output, once is_stopped
        # Invariant: True only without stop strings and with no undecoded bytes pending.
        self._is_passthrough = not stop

    def push(self, piece: bytes) -> str:
        """Add a token's bytes; return the text that is now safe to release."""
        if self._is_passthrough and piece.isascii():
            return piece.decode("ascii")
        if not self._stop:
            released = self._decoder.decode(piece)
            self._is_passthrough = not self._decoder.getstate()[0]
            return released
        self._held += self._decoder.decode(piece)
        cut = self._first_stop_index()
        if cut is not None:
            self.is_stopped = True
            self.stop_string = next(stop for stop in self._stop if self._held.startswith(stop, cut))
            released, self._held = self._held[:cut], ""
            return released
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._held) - keep
        released, self._held = self._held[:cut], self._held[cut:]
        return released

    def finish(self) -> str:
        """Release everything still held (the sequence ended without a stop string)."""
        released = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return released

    def _first_stop_index(self) -> int | None:
        # _held never keeps a complete stop string between pushes, so a match found now
        # is the earliest one in the whole output.
        hits = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest tail of _held that is a proper prefix of some stop string."""
        return max(partial_marker_len(self._held, stop) for stop in self._stop)
