"""A request's tools: which functions, whether and how many calls are forced, and in
which format the model writes them (formats.py).

With `tool_choice` "required" or a named function the answer is constrained to a call of
them (constraint(): the decode worker builds the grammar around the functions' parameter
schemas), so it is always a call whose arguments match its function's schema; with
"auto" the model answers freely and an answer that is a call becomes `tool_calls`; with
"none" the tools are not offered. A forced answer that
max_tokens cut short is still a call, never content: its calls as far as they were
written (cut_calls), with `finish_reason: "length"`, as OpenAI answers it.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from cbatch.chat_messages import MAX_JSON_CHARS, MAX_TOOLS, json_text
from cbatch.constraints import MAX_SCHEMA_DEPTH, schema_depth
from cbatch.params import invalid
from cbatch.text_checks import checked_text
from cbatch.tools.formats import JSON_ANSWER, JsonAnswer

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# How every forced call begins (workers/engine/structured/tool_grammar.py): its name, then its arguments' key.
_CALL_HEAD = re.compile(r'\{"name": ("[A-Za-z0-9_-]{1,64}"), "(?:arguments|parameters)": ')
ANY_OBJECT = {"type": "object"}  # the parameters of a function that declares none


@dataclass
class ToolPlan:
    functions: dict[str, dict]  # name -> {"description", "parameters"}, in the request's order
    choice: str  # "auto", "required", or the one function's name that must be called
    is_parallel: bool  # several calls in one answer (never for a named function: it is called once)
    format: JsonAnswer = field(default=JSON_ANSWER)  # how the model writes calls: its template's way, or cbatch's

    @property
    def is_forced(self) -> bool:
        """The answer is a call: a grammar makes it one."""
        return self.choice != "auto"

    def tools(self) -> list[dict]:
        """The functions in OpenAI's shape, as chat templates take them."""
        return [{"type": "function", "function": {"name": name, **spec}} for name, spec in self.functions.items()]

    def instructions(self) -> str:
        """cbatch's own call format taught in words, for a template that knows no tools."""
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

    def constraint(self) -> dict:
        """A forced call's `tool_call` (cbatch.params.ToolCall): the format, the allowed
        functions' parameter schemas and whether the answer is one call; the decode worker
        builds its grammar."""
        return {"format": self.format.name, "arguments_key": self.format.arguments_key,
                "functions": {name: spec["parameters"] for name, spec in self.functions.items()
                              if self.choice in ("required", name)},
                "is_one_call": self.choice != "required" or not self.is_parallel}

    def parse(self, text: str) -> tuple[str | None, list[dict]] | None:
        """(the answer's text besides its calls or None, its calls in OpenAI's shape); None
        when the answer holds no call."""
        parsed = self.format.parse(text, self.functions)
        if parsed is None:
            return None
        content, calls = parsed
        return content or None, [_openai_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                                 for c in calls]

    def cut_calls(self, text: str) -> list[dict]:
        """The calls of a forced answer that max_tokens cut short, in OpenAI's shape: each
        whose name was written, its arguments as JSON when whole, else as far as written
        (the cut one). None begun: []."""
        heads = list(_CALL_HEAD.finditer(text))
        calls = []
        for head, after in zip(heads, [*(h.start() for h in heads[1:]), len(text)]):
            written = text[head.end():after]
            try:
                arguments = json.dumps(json.JSONDecoder().raw_decode(written)[0], ensure_ascii=False)
            except json.JSONDecodeError:
                arguments = written
            calls.append(_openai_call(json.loads(head.group(1)), arguments))
        return calls


def _openai_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


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
        if schema_depth(parameters, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise invalid(f"tools[{i}].function.parameters nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep")
        json_text(f"tools[{i}].function.parameters", parameters)  # the daemon's check, under the caller's name
        description = function.get("description")
        if description is not None:
            description = checked_text(f"tools[{i}].function.description", description, MAX_JSON_CHARS,
                                       allow_empty=True)
        functions[name] = {"description": description or "", "parameters": parameters}
    return functions


def tool_plan(raw: dict, call_format: JsonAnswer = JSON_ANSWER) -> ToolPlan | None:
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
        return None if choice == "none" else ToolPlan(functions, choice or "auto", is_parallel, call_format)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name not in functions:
        raise invalid("tool_choice must be none, auto, required or {type: function, function: {name}} naming one "
                      f"of the tools, got {choice!r}")
    return ToolPlan(functions, name, is_parallel, call_format)
