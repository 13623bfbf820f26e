"""Which tags a model thinks in: the HTTP server splits thinking from the answer by them, and a
thinking budget that names no tags of its own uses them.

`--reasoning-tags OPEN CLOSE` names them; otherwise they are read off the chat template
(a template that mentions `<think>` thinks in `<think>...</think>`); `--reasoning off`
turns the split off. A template whose generation prompt already opens the block (as
Qwen3's adds `<think>\\n`) makes the model's output start inside it: a probe conversation
rendered at start-up tells.
"""

from cbatch.chat_messages import ChatMessage
from cbatch.config import EngineConfig
from cbatch.errors import CbatchError
from cbatch.workers.engine.model_runner import ModelRunner

KNOWN_TAGS = (("<think>", "</think>"), ("<thinking>", "</thinking>"))
PROBE = (ChatMessage("user", "Hello"),)


def model_reasoning(config: EngineConfig, runner: ModelRunner) -> dict | None:
    """{"tags": [open, close], "opened_by_prompt": bool}, or None for a model that does
    not think in tags (its output is left as it is)."""
    if config.reasoning == "off":
        return None
    tags = config.reasoning_tags
    if tags is None:
        template = runner.chat_template() or b""
        tags = next((known for known in KNOWN_TAGS if known[0].encode() in template), None)
    if tags is None:
        return None
    try:
        is_opened = runner.render_chat(PROBE).rstrip().endswith(tags[0])
    except CbatchError:  # no usable chat template: prompts are the caller's
        is_opened = False
    return {"tags": list(tags), "opened_by_prompt": is_opened}
