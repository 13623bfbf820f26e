"""Counts in messages: "1 token", "2 tokens"."""


def counted(count: int, noun: str) -> str:
    """`noun` is the singular; the plural adds an s (true of every noun counted here)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
