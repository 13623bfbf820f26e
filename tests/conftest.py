import importlib.util
from pathlib import Path

import llama_cpp  # noqa: F401  first: see cbatch/__init__.py (CUDA builds and import order)
import pytest

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """Import a module from scripts/ (they are thin entry points, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny-llama.gguf"
    return load_script("make_tiny_model").llama.make_tiny_model(str(path))


@pytest.fixture(scope="session")
def tiny_bert_path(tmp_path_factory) -> str:
    """An embedding-only model: a tiny random-weight BERT declaring mean pooling."""
    path = tmp_path_factory.mktemp("models") / "tiny-bert.gguf"
    return load_script("make_tiny_model").embedding.make_tiny_embedding_model(str(path))


@pytest.fixture(scope="session")
def tiny_tools_model_path(tmp_path_factory) -> str:
    """The tiny model with a chat template that knows tools (Hermes-style <tool_call> tags)."""
    path = tmp_path_factory.mktemp("models") / "tiny-tools.gguf"
    template = (REPO / "scripts" / "chatml_tools.jinja").read_text()
    return load_script("make_tiny_model").llama.make_tiny_model(str(path), chat_template=template)


@pytest.fixture(scope="session")
def tiny_projector_path(tmp_path_factory) -> str:
    """A random-weight LLaVA-style vision projector (mmproj) for the tiny model."""
    path = tmp_path_factory.mktemp("models") / "tiny-projector.gguf"
    return load_script("make_tiny_model").projector.make_tiny_projector(str(path))


@pytest.fixture(scope="session")
def gemma_model_path() -> str:
    from cbatch.model import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture
def make_engine(tiny_model_path):
    """Engines on the tiny model (4 sequences of 256 tokens unless overridden), closed at teardown."""
    from cbatch.config import EngineConfig
    from cbatch.workers.engine.engine import Engine

    engines = []

    def make(**overrides):
        settings = {"model_path": tiny_model_path, "parallel": 4, "ctx_size": 4 * 256, "batch_size": 64, **overrides}
        engine = Engine(EngineConfig(**settings))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def start_daemon():
    """Start real cbatch-worker daemons; each is stopped and its files removed at teardown."""
    from daemonkit import Daemon

    started = []

    def start(model_path: str, *args: str, **options):
        daemon = Daemon(model_path, *args, **options)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        daemon.remove_workdir()


@pytest.fixture
def start_http_daemon():
    """As start_daemon, for daemons with their HTTP server (HttpDaemon)."""
    from httpkit import HttpDaemon

    started = []

    def start(*args, **options):
        started.append(HttpDaemon(*args, **options))
        return started[-1]

    yield start
    for daemon in started:
        daemon.stop()
        daemon.remove_workdir()


@pytest.fixture
def api(daemon):
    """An openai client of the test module's HTTP daemon (its `daemon` fixture)."""
    return daemon.openai()


@pytest.fixture
def ring():
    """A 64-record token ring in shared memory, owned by the test; unlinked at teardown."""
    import os

    from cbatch.ipc.ring import create_ring

    owner = create_ring(f"cbatch-test-ring-{os.getpid()}", 64)
    yield owner
    owner.close()
    owner.unlink()
