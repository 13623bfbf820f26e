"""A model's own Jinja chat template, rendered as Hugging Face transformers and llama-server
`--jinja` do: by the client for a chat with tools, by the decode worker for every other
chat (the same class both ways, so a conversation renders the same).

The daemon's WELCOME carries the GGUF's `tokenizer.chat_template` and its BOS/EOS texts
(the decode worker reads them); the client renders the prompt and sends it as `prompt`.
The template runs sandboxed (it comes with a model file, it is code) with what such
templates expect: `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`,
`raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text.
"""

import datetime
import functools
import json

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cbatch.params import invalid
from cbatch.tools.formats import TOOL_CALL_OPEN, BareJson, JsonAnswer, Tagged


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _call_format(source: str) -> JsonAnswer:
    """The format the template teaches: `<tool_call>` blocks when it writes them, else a bare
    JSON call with the arguments under the key it names."""
    if TOOL_CALL_OPEN in source:
        return Tagged()
    return BareJson("parameters" if '"parameters"' in source and '"arguments"' not in source else "arguments")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", adds_bos: bool = False):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self._template = env.from_string(source)
        self.knows_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
        self.call_format = _call_format(source)
        self.bos_token, self.eos_token, self.adds_bos = bos_token, eos_token, adds_bos

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The prompt for template_messages() and the offered tools (None: none offered),
        ending where the assistant's answer begins; without the BOS the daemon's tokenizer adds."""
        try:
            text = self._template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as err:  # the template is the model's code: any failure of it is this request's
            raise invalid(f"messages: the model's chat template cannot render them: {err}") from None
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


@functools.lru_cache(maxsize=8)
def _compiled(source: str, bos_token: str, eos_token: str, adds_bos: bool) -> ChatTemplate | None:
    try:
        return ChatTemplate(source, bos_token, eos_token, adds_bos)
    except jinja2.TemplateError:  # one jinja2 cannot compile: llama.cpp's built-in renderer still may
        return None


def compiled_template(texts: dict | None) -> ChatTemplate | None:
    """The model's own template from its chat texts (workers/engine/chat_texts.py, relayed in
    the daemon's handshake), or None when it has none or jinja2 cannot compile it."""
    source = (texts or {}).get("chat_template")
    if not source:
        return None
    return _compiled(source, texts.get("bos_token", ""), texts.get("eos_token", ""), bool(texts.get("adds_bos")))


def template_of(welcome: dict | None) -> ChatTemplate | None:
    """The daemon's chat template from its handshake, when it has one that knows tools."""
    template = compiled_template(welcome)
    return template if template is not None and template.knows_tools else None
