"""A streamed answer's text cut into the parts the item-based APIs stream apart: the
reasoning (the text inside the model's thinking tags), then the content and the calls
(reasoning.py and cbatch/tools/stream.py do the cutting). OpenAI's Responses and
Anthropic's Messages turn the parts into their own events."""

from cbatch.openai.mapping import ApiRequest
from cbatch.openai.reasoning import ReasoningSplitter
from cbatch.tools import ToolCallStream


class AnswerParts:
    def __init__(self, api: ApiRequest):
        self._splitter = ReasoningSplitter(api.reasoning) if api.reasoning else None
        self._tools = ToolCallStream(api.tools) if api.tools else None

    def push(self, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """(the reasoning in `text`, the deltas of content and of whole calls after it, the
        finish reason): a call's text is held back until the call is whole, and a choice
        that ended on calls ends with "tool_calls"."""
        reasoning, content = "", text
        if self._splitter is not None:
            reasoning, content = self._splitter.push(text, is_last=finish_reason is not None)
        deltas = [{"content": content}] if content else []
        if self._tools is not None:
            deltas, finish_reason = self._tools.push(content, finish_reason)
        return reasoning, deltas, finish_reason
