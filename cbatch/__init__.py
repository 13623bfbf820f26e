"""cbatch: serve one GGUF model to many concurrent callers with continuous batching."""

from cbatch.config import EngineConfig
from cbatch.errors import CbatchError

__all__ = ["CbatchError", "EngineConfig"]
__version__ = "0.1.0"
