"""Thinking split from the answer, for models that think in tags (`<think>...</think>`).

The daemon tells which tags the model thinks in, and whether its chat template's
generation prompt already opens the block (workers/engine/thinking/tags.py). A chat answer's
text inside the block becomes `reasoning_content` (its own deltas when streamed), what
follows the close tag `content` (leading whitespace dropped). An answer that does not
open with the tag (leading whitespace aside) has no thinking: all of it is content.

A request may cap the thinking: `reasoning_budget` (tokens inside the block, then the
close tag is forced: workers/engine/thinking/budget.py), or OpenAI's `reasoning_effort`
(chat) / `reasoning.effort` (Responses) mapped through EFFORT_BUDGETS.
"""

from cbatch.params import invalid
from cbatch.partial_markers import partial_marker_len

# reasoning_effort -> thinking budget in tokens; "none" and "minimal" close the block at once.
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": 4096, "xhigh": 16384}
BEFORE, INSIDE, AFTER_CLOSE, ANSWER = range(4)


def reasoning_fields(budget, effort, model_reasoning: dict | None) -> dict:
    """The cbatch body fields for a request's `reasoning_budget` / `reasoning_effort`.
    An effort on a model that does not think is ignored (OpenAI clients send it to any
    model); an explicit budget there is refused."""
    if budget is not None:
        if model_reasoning is None:
            raise invalid("reasoning_budget needs a model that thinks in tags (see cbatch-worker --reasoning-tags)")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise invalid(f"reasoning_budget must be a non-negative integer, got {budget!r}")
    elif effort is not None:
        if effort not in EFFORT_BUDGETS:
            raise invalid(f"reasoning_effort must be one of {list(EFFORT_BUDGETS)}, got {effort!r}")
        budget = EFFORT_BUDGETS[effort]
    if budget is None or model_reasoning is None:
        return {}
    return {"reasoning_budget": budget, "reasoning_tags": list(model_reasoning["tags"])}


class ReasoningSplitter:
    """One choice's text, pushed as it arrives, split into (reasoning, content) deltas; a
    tag split across pushes is held back until it is whole or cannot be one."""

    def __init__(self, model_reasoning: dict):
        self.open_tag, self.close_tag = model_reasoning["tags"]
        self.state = INSIDE if model_reasoning["opened_by_prompt"] else BEFORE
        self.held = ""

    def push(self, text: str, is_last: bool = False) -> tuple[str, str]:
        """The (reasoning, content) now safe to release; with `is_last`, everything."""
        reasoning, content = self._split(text)
        if is_last:
            held, self.held = self.held, ""
            if self.state == INSIDE:
                reasoning += held
            elif self.state != AFTER_CLOSE:
                content += held
        return reasoning, content

    def _split(self, text: str) -> tuple[str, str]:
        reasoning = content = ""
        self.held += text
        while self.held:
            if self.state == BEFORE:
                start = self.held.lstrip()
                if start.startswith(self.open_tag):
                    self.held, self.state = start[len(self.open_tag):], INSIDE
                elif not start or self.open_tag.startswith(start):
                    break  # may still become the open tag
                else:
                    self.state = ANSWER  # no thinking: everything is content, as it came
            elif self.state == INSIDE:
                at = self.held.find(self.close_tag)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held, self.state = self.held[at + len(self.close_tag):], AFTER_CLOSE
                    continue
                keep = partial_marker_len(self.held, self.close_tag)
                reasoning += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            elif self.state == AFTER_CLOSE:
                self.held = self.held.lstrip()
                if self.held:
                    self.state = ANSWER
            else:
                content, self.held = content + self.held, ""
        return reasoning, content


def split_reasoning(text: str, model_reasoning: dict) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    return ReasoningSplitter(model_reasoning).push(text, is_last=True)
