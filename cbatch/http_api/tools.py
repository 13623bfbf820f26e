"""Tool calling on /v1/chat/completions: the shared implementation (cbatch.tools), named here
for the HTTP API's modules."""

from cbatch.tools import ToolCallStream, ToolPlan, tool_plan

__all__ = ["ToolCallStream", "ToolPlan", "tool_plan"]
