"""A constraint held back while the model thinks: when the prompt opens the thinking block
(a chat template whose generation prompt ends in `<think>`, as QwQ's, DeepSeek-R1's
distills' and Qwen3's thinking ones do), the model must be free to think and to close the
block before its answer is held to the request's schema, grammar or forced call. So the
sequence starts without its matcher (sampled as an unconstrained one would be; a thinking
budget still counts and forces the close tag), and the matcher takes over from the token
after the one that completes the close tag: `reasoning_content` then holds the thinking
and `content` the constrained answer.
"""


class ThinkingGate:
    """One sequence's constraint, held until its output closes the thinking block."""

    def __init__(self, matcher, close_tag: str):
        self.matcher = matcher
        self._close_tag = close_tag.encode()
        self._tail = b""  # the output's last bytes, where the close tag is looked for

    def passes(self, piece: bytes) -> bool:
        """After each output token's bytes: whether they completed the close tag."""
        self._tail = (self._tail + piece)[-len(self._close_tag) - len(piece):]
        return self._close_tag in self._tail


def thinking_gate(matcher, prompt_text: str, tags: tuple[str, str] | None) -> ThinkingGate | None:
    """The gate of a constrained request whose prompt leaves the thinking block open."""
    if matcher is None or tags is None or not prompt_text.rstrip().endswith(tags[0]):
        return None
    return ThinkingGate(matcher, tags[1])
