"""Claude Code's per-request billing line, taken out of a chat's system prompt.

Claude Code, and the agents built on the Anthropic SDK's command-line entry point, put a
line such as `x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli;
cch=eb6c6;` first in the system prompt. Its `cch` changes on every request, so with it
no two turns of a conversation share more than the tokens before it: every turn would
prefill the whole conversation again. The line means nothing to the model; it is removed
before the chat is rendered, unless the daemon runs with --keep-billing-header.
"""

import re

BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)")
SYSTEM_ROLES = ("system", "developer")


def strip_billing_header(messages):
    """The messages with the billing line taken off the start of each system message's
    text (a string, or its first text part); anything else is left for validation."""
    if not isinstance(messages, list):
        return messages
    return [_stripped(message) if isinstance(message, dict) and message.get("role") in SYSTEM_ROLES else message
            for message in messages]


def _stripped(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": BILLING_LINE.sub("", content, count=1)}
    if isinstance(content, list) and content and isinstance(content[0], dict) and isinstance(content[0].get("text"),
                                                                                              str):
        first = {**content[0], "text": BILLING_LINE.sub("", content[0]["text"], count=1)}
        return {**message, "content": [first, *content[1:]] if first["text"] else content[1:]}
    return message
