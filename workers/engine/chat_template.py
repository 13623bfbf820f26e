"""The model's own Jinja chat template, the one renderer of every chat (with tools or
without, so a conversation renders the same either way), as Hugging Face transformers
and llama-server `--jinja` render it.

The template runs sandboxed (it comes with a model file, it is code) with what such
templates expect: `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`,
`raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text. The BOS the
tokenizer adds is left out of the text. A template that uses `tools` teaches a call
format (cbatch/tools/formats.py), which the handshake tells clients so they read calls
back (tool_format).
"""

import datetime
import functools
import json

import jinja2
import llama_cpp.llama_cpp as lc
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cbatch.text_checks import invalid
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
        """The prompt for messages and tools in the shape templates read (None: no tools
        offered; cbatch.chat_messages.template_input),
        ending where the assistant's answer begins; without the BOS the daemon's tokenizer adds."""
        try:
            text = self._template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception as err:  # the template is the model's code: any failure of it is this request's
            raise invalid(f"messages: the model's chat template cannot render them: {err}") from None
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


def _special_text(vocab, token: int) -> str:
    """A special token's text as written in a prompt ("<s>"); "" for no token (-1)."""
    return (lc.llama_vocab_get_text(vocab, token) or b"").decode("utf-8", errors="replace") if token >= 0 else ""


@functools.lru_cache(maxsize=8)
def compiled_template(source: str, bos_token: str, eos_token: str, adds_bos: bool) -> ChatTemplate | None:
    try:
        return ChatTemplate(source, bos_token, eos_token, adds_bos)
    except jinja2.TemplateError:  # one jinja2 cannot compile: llama.cpp's built-in renderer still may
        return None


def model_template(model, vocab) -> ChatTemplate | None:
    """The GGUF's own template compiled, with its BOS and EOS texts; None when it has none
    or jinja2 cannot compile it."""
    source = lc.llama_model_chat_template(model, None)
    if not source:
        return None
    bos_text = _special_text(vocab, lc.llama_vocab_bos(vocab))
    eos_text = _special_text(vocab, lc.llama_vocab_eos(vocab))
    return compiled_template(source.decode("utf-8", errors="replace"), bos_text, eos_text,
                             bool(lc.llama_vocab_get_add_bos(vocab)))


def tool_format(template: ChatTemplate | None) -> dict:
    """What the handshake tells clients of calls: the format the template teaches, when it
    knows tools ({"name", "arguments_key"}); nothing otherwise (cbatch's own format is told
    in words)."""
    if template is None or not template.knows_tools:
        return {}
    return {"tool_format": {"name": template.call_format.name, "arguments_key": template.call_format.arguments_key}}
