"""cbatch: serve one GGUF model to many concurrent callers with continuous batching."""

from cbatch.async_client import AsyncClient
from cbatch.client import Client
from cbatch.config import EngineConfig
from cbatch.errors import CbatchError
from cbatch.streams import Chunk, Completion

__all__ = ["AsyncClient", "CbatchError", "Chunk", "Client", "Completion", "EngineConfig"]
__version__ = "0.1.0"
