"""cbatch: serve one GGUF model to many concurrent callers with continuous batching.

The public names load on first use, so `import cbatch` (and the daemon's processes, which
import it first) pull in neither pyzmq nor llama.cpp until they need them. The decode
worker loads llama.cpp before pyzmq and numpy: a CUDA build of the bindings (on an H100
machine) crashed at model load when either was loaded first.
"""

import importlib

_EXPORTS = {
    "AsyncClient": "cbatch.client.async_client",
    "Client": "cbatch.client.sync_client",
    "EngineConfig": "cbatch.config",
    "CbatchError": "cbatch.errors",
    "Chunk": "cbatch.client.streams",
    "Completion": "cbatch.client.streams",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cbatch' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
