"""A chat request body in OpenAI's terms made into the body cbatch's daemon takes."""

from cbatch.params import invalid
from cbatch.tools.formats import JsonAnswer, format_of
from cbatch.tools.messages import cbatch_messages, template_messages
from cbatch.tools.plan import ToolPlan, tool_plan

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def prepare_chat(body: dict, call_format: JsonAnswer | None) -> tuple[dict, ToolPlan | None]:
    """(cbatch's body, the tool plan or None) for a body with `messages` that may hold tool
    calls and results, and TOOL_FIELDS beside cbatch's own fields.

    With `call_format` (the model's chat template knows tools and teaches that format:
    formats.format_of), the messages, calls and results among them, and the offered tools
    go to the daemon, whose decode worker renders them with that template, and calls are
    read in that format; otherwise the tools are described in a system message, calls and
    results told in words. A forced call adds its `tool_call` constraint.
    """
    if "prompt" in body:
        raise invalid("tools and tool_choice take 'messages', not 'prompt'")
    rest = {name: value for name, value in body.items() if name not in TOOL_FIELDS and name != "messages"}
    if call_format is not None:
        plan = tool_plan(body, call_format)
        rest["messages"] = template_messages(body.get("messages"))
        if plan is not None:
            rest["offered_tools"] = plan.tools()
    else:
        plan = tool_plan(body)
        messages = cbatch_messages(body.get("messages"))
        rest["messages"] = plan.with_instructions(messages) if plan else messages
    if plan is not None and plan.is_forced:
        if "grammar" in rest or "json_schema" in rest:
            raise invalid("tool_choice required or a named function constrains the answer to a call: "
                          "give no grammar or response_format with it")
        rest["tool_call"] = plan.constraint()
    return rest, plan


def prepare_request(body: dict, welcome: dict | None) -> tuple[dict, ToolPlan | None]:
    """A native request body (the ZeroMQ client's, a batch file line's) as the daemon takes
    it: one with tools or tool turns goes through prepare_chat with the call format the
    daemon's handshake names; any other is left as it is."""
    messages = body.get("messages")
    has_tool_turns = isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or "tool_calls" in m) for m in messages)
    if not has_tool_turns and not any(name in body for name in TOOL_FIELDS):
        return body, None
    return prepare_chat(body, format_of(welcome))
