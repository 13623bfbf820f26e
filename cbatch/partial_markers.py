"""Text that streams in pieces while the server looks for markers in it (stop strings,
thinking tags, tool-call tags): a marker may be cut between two pieces, so the tail that
could still become one is held back until the next piece tells."""


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (0 if none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
