"""Tool calling on /v1/chat/completions, in one call format for every model.

The tools are described to the model in a system message, and a call is the model
answering with only `{"tool_calls": [{"name": ..., "arguments": {...}}]}`. With
`tool_choice` "required" or a named function the answer is constrained by a grammar built
from the functions' parameter schemas (llama-cpp-python's JSON-schema converter, as for
`response_format`), so it is always a call whose arguments match its function's schema;
with "auto" the model answers freely and an answer that is such a call becomes
`tool_calls`; with "none" the tools are not offered.
"""

import json
import re
import uuid
from dataclasses import dataclass

from cbatch.params import invalid

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT = {"type": "object"}  # the parameters of a function that declares none


@dataclass
class ToolPlan:
    functions: dict[str, dict]  # name -> {"description", "parameters"}, in the request's order
    choice: str  # "auto", "required", or the one function's name that must be called
    is_parallel: bool  # several calls in one answer (never for a named function: it is called once)

    @property
    def is_forced(self) -> bool:
        """The answer is a call: a grammar makes it one."""
        return self.choice != "auto"

    def instructions(self) -> str:
        described = [{"name": name, **spec} for name, spec in self.functions.items()]
        example = json.dumps({"tool_calls": [{"name": "<function name>", "arguments": {"<parameter>": "<value>"}}]})
        text = (f"You can call these functions:\n{json.dumps(described, ensure_ascii=False)}\n"
                f"To call functions, answer with only this JSON and nothing else: {example}")
        if self.choice == "required":
            return text + "\nAnswer with a call now."
        if self.choice != "auto":
            return text + f"\nAnswer with a call of {self.choice} now."
        return text + "\nOtherwise, and once a call's result is given, answer in plain text."

    def with_instructions(self, messages: list[dict]) -> list[dict]:
        """The tools described before the conversation (within its system message, if any)."""
        if messages and messages[0]["role"] == "system":
            first = {"role": "system", "content": f"{self.instructions()}\n\n{messages[0]['content']}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": self.instructions()}, *messages]

    def grammar(self) -> str:
        """GBNF for an answer that is a call (calls, when parallel) of the allowed functions."""
        from llama_cpp import llama_grammar

        names = list(self.functions) if self.choice == "required" else [self.choice]
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": name}, "arguments": self.functions[name]["parameters"]}}
                 for name in names]
        is_one_call = self.choice != "required" or not self.is_parallel
        schema = {"type": "object", "additionalProperties": False, "required": ["tool_calls"], "properties": {
            "tool_calls": {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                           **({"maxItems": 1} if is_one_call else {})}}}
        try:
            return llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        except Exception as err:  # the converter raises plain exceptions for schemas it cannot take
            raise invalid(f"tools: a function's parameters cannot be converted to a grammar: {err}") from None

    def calls(self, text: str) -> list[dict] | None:
        """The answer's calls in OpenAI's shape, or None when the answer is not a call."""
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            return None
        calls = answer.get("tool_calls") if isinstance(answer, dict) else None
        if not isinstance(calls, list) or not calls or not all(
                isinstance(c, dict) and c.get("name") in self.functions and isinstance(c.get("arguments"), dict)
                for c in calls):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                for c in calls]


def _functions(tools) -> dict[str, dict]:
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise invalid(f"tools must be a list of 1 to {MAX_TOOLS} {{type: function, function}} objects")
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise invalid(f"tools[{i}] must be {{type: function, function: {{name, description, parameters}}}}")
        name, parameters = function.get("name"), function.get("parameters", ANY_OBJECT)
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name) or name in functions:
            raise invalid(f"tools[{i}].function.name must be a new name of 1 to 64 letters, digits, _ or -, "
                          f"got {name!r}")
        if not isinstance(parameters, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema object")
        functions[name] = {"description": str(function.get("description", "")), "parameters": parameters}
    return functions


def tool_plan(raw: dict) -> ToolPlan | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`; None when no tools
    are offered (none given, or tool_choice "none")."""
    tools, choice, is_parallel = raw.get("tools"), raw.get("tool_choice"), raw.get("parallel_tool_calls", True)
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools")
        return None
    functions = _functions(tools)
    if not isinstance(is_parallel, bool):
        raise invalid("parallel_tool_calls must be true or false")
    if choice in (None, "auto", "required", "none"):
        return None if choice == "none" else ToolPlan(functions, choice or "auto", is_parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name not in functions:
        raise invalid("tool_choice must be none, auto, required or {type: function, function: {name}} naming one "
                      f"of the tools, got {choice!r}")
    return ToolPlan(functions, name, is_parallel)


class ToolCallStream:
    """One streamed choice of a request with tools: text goes out as content as soon as it
    cannot be a call (a forced answer always is one); what may be a call is held back and
    at the end goes out as one `tool_calls` delta, or as content if it was not a call."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""
        self.is_content = False

    def push(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """(deltas, finish reason) for the choice's next text."""
        if self.is_content:
            return ([{"content": text}] if text else []), finish_reason
        self.held += text
        if not self.plan.is_forced and self.held.lstrip() and not self.held.lstrip().startswith("{"):
            self.is_content = True
            held, self.held = self.held, ""
            return [{"content": held}], finish_reason
        if finish_reason is None:
            return [], None
        calls = self.plan.calls(self.held)
        if calls is None:
            return ([{"content": self.held}] if self.held else []), finish_reason
        return [{"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}], "tool_calls"
