"""Tool calling for every way in (the ZeroMQ client, batch files, HTTP): OpenAI's `tools`,
`tool_choice`, `parallel_tool_calls` and tool-call messages made into what the daemon
renders, a forced call's constraint, and the calls read back from the answer."""

from cbatch.tools.chat import TOOL_FIELDS, prepare_chat
from cbatch.tools.formats import JsonAnswer, format_of
from cbatch.tools.plan import ToolPlan, tool_plan
from cbatch.tools.stream import ToolCallStream

__all__ = ["TOOL_FIELDS", "JsonAnswer", "ToolCallStream", "format_of", "ToolPlan", "prepare_chat", "tool_plan"]
