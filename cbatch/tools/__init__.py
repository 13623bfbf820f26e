"""Tool calling for every way in (the ZeroMQ client, batch files, HTTP): OpenAI's `tools`,
`tool_choice`, `parallel_tool_calls` and tool-call messages made into a prompt, a grammar
when a call is forced, and the calls read back from the answer."""

from cbatch.tools.chat import TOOL_FIELDS, prepare_chat
from cbatch.tools.plan import ToolPlan, tool_plan
from cbatch.tools.stream import ToolCallStream
from cbatch.tools.template import ChatTemplate, template_of

__all__ = ["TOOL_FIELDS", "ChatTemplate", "ToolCallStream", "template_of", "ToolPlan", "prepare_chat", "tool_plan"]
