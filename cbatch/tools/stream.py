"""Tool calls out of a streamed answer."""

from cbatch.tools.plan import ToolPlan


class ToolCallStream:
    """One streamed choice of a request with tools: text goes out as content as soon as it
    cannot be (part of) a call (a forced answer always is one); what may be a call is held
    back and at the end goes out as one `tool_calls` delta, or as content if it was not a call
    (a forced answer cut by max_tokens: the calls as far as written, finishing `length`)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""
        self.is_start = True  # nothing released yet

    def push(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """(deltas, finish reason) for the choice's next text."""
        self.held += text
        if finish_reason is None:
            cut = 0 if self.plan.is_forced else self.plan.format.held_from(self.held, self.is_start)
            released, self.held = self.held[:cut], self.held[cut:]
            self.is_start = self.is_start and not released
            return ([{"content": released}] if released else []), None
        parsed = self.plan.parse(self.held)
        if parsed is None and self.plan.is_forced and finish_reason == "length":
            calls = self.plan.cut_calls(self.held)
            return ([{"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}] if calls else []), \
                finish_reason
        if parsed is None:
            return ([{"content": self.held}] if self.held else []), finish_reason
        content, calls = parsed
        return [*([{"content": content}] if content else []),
                {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}], "tool_calls"
