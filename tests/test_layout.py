"""The package layout's rules: imports point one way, and modules stay small enough to read.

    cbatch/ (errors, protocol, params, constraints, config, model, wording, embeddings)  shared by all
    cbatch/tools  ->  the shared ones and its own modules (tool calling, for the client and HTTP alike)
    cbatch/client  ->  never cbatch.workers
    cbatch/openai  ->  the shared ones, cbatch/tools and its own modules (OpenAI's shapes, never HTTP or Starlette)
    cbatch/anthropic  ->  the shared ones, cbatch/tools, cbatch/openai and its own (Anthropic's shapes on chat)
    cbatch/http_api  ->  the client, cbatch/tools, cbatch/openai, cbatch/anthropic, the batch jobs' store and its own
                         modules only
    cbatch/batch  ->  never cbatch.workers, cbatch.cli or cbatch.jobs (the batch-file engine both use)
    cbatch/jobs  ->  never cbatch.workers or cbatch.cli (the job runner is one more client of the daemon)
    cbatch/ipc (ipc/)  ->  its own modules only (the ring and its records, beneath everything)
    cbatch/ (the folder)  ->  never cbatch.workers (the processes import the library, not the other way)
    cbatch/workers/engine  ->  never the daemon or the decode process
    cbatch/workers/engine/<room>  ->  other rooms (sched, kv, sampling, structured, thinking) and, of the engine's
                                      own modules, only sequence and model_runner (the types they share)
    cbatch/protocol  ->  nothing of the project
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"cbatch": REPO / "cbatch", "cbatch.workers": REPO / "workers", "cbatch.ipc": REPO / "ipc"}
SHARED = {"cbatch", "cbatch.errors", "cbatch.protocol", "cbatch.params", "cbatch.constraints", "cbatch.config",
          "cbatch.model", "cbatch.wording", "cbatch.embeddings", "cbatch.partial_markers", "cbatch.extras",
          "cbatch.api_keys", "cbatch.images", "cbatch.chat_messages", "cbatch.text_checks"}
# A module past this many lines says in its docstring why it is one concern, in a paragraph
# that starts "One concern:". A smell detector, not a budget: no file is split or rewrapped
# to meet it; line length is ruff's (.ci/run).
MAX_MODULE_LINES = 400
# What the HTTP app may use of cbatch.jobs: the state directory's files, not the runner.
JOB_STORE = {"cbatch.jobs", "cbatch.jobs.state_dir", "cbatch.jobs.files", "cbatch.jobs.batches"}
HTTP_STACK = {"starlette", "uvicorn", "httptools", "prometheus_client", "httpx", "orjson"}


def modules() -> dict[str, Path]:
    found = {}
    for prefix, root in PACKAGE_DIRS.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def project_imports(path: Path) -> set[str]:
    """Every cbatch module a file imports, at the top or inside a function (`from
    cbatch.client import session` names the module cbatch.client.session)."""
    known, names = modules(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names} & known.keys()
    return {name for name in names if name == "cbatch" or name.startswith("cbatch.")}


def modules_under(package: str) -> list[str]:
    return [name for name in modules() if name == package or name.startswith(package + ".")]


def offenders(package: str, is_allowed) -> list[str]:
    return offenders_of(modules_under(package), is_allowed)


def offenders_of(module_names, is_allowed) -> list[str]:
    found = modules()
    return [f"{module} imports {imported}" for module in module_names
            for imported in sorted(project_imports(found[module])) if not is_allowed(imported)]


def outside(*forbidden: str):
    return lambda name: not any(name == f or name.startswith(f + ".") for f in forbidden)


@pytest.mark.parametrize("package, is_allowed", [
    ("cbatch.client", outside("cbatch.workers", "cbatch.http_api", "cbatch.cli")),
    ("cbatch.ipc", lambda name: name.startswith("cbatch.ipc")),
    ("cbatch.workers.engine", outside("cbatch.workers.daemon", "cbatch.workers.decode", "cbatch.client",
                                      "cbatch.http_api", "cbatch.cli")),
    ("cbatch.tools", lambda name: name in SHARED or name.startswith("cbatch.tools")),
    ("cbatch.openai", lambda name: name in SHARED or name.startswith(("cbatch.tools", "cbatch.openai"))),
    ("cbatch.anthropic", lambda name: name in SHARED or name.startswith(("cbatch.tools", "cbatch.openai",
                                                                         "cbatch.anthropic"))),
    ("cbatch.http_api", lambda name: name in SHARED or name in JOB_STORE or name.startswith((
        "cbatch.client", "cbatch.tools", "cbatch.openai", "cbatch.anthropic", "cbatch.http_api"))),
    ("cbatch.batch", outside("cbatch.workers", "cbatch.cli", "cbatch.jobs", "cbatch.http_api")),
    ("cbatch.jobs", outside("cbatch.workers", "cbatch.cli", "cbatch.http_api")),
    ("cbatch.protocol", lambda name: False),
])
def test_imports_point_one_way(package, is_allowed):
    assert modules_under(package), f"no modules found under {package}"
    assert offenders(package, is_allowed) == []


ENGINE = "cbatch.workers.engine"
ENGINE_ROOMS = ("sched", "kv", "sampling", "structured", "thinking")


@pytest.mark.parametrize("room", ENGINE_ROOMS)
def test_an_engine_room_imports_no_engine_module_but_the_shared_types(room):
    shared_types = (f"{ENGINE}.sequence", f"{ENGINE}.model_runner")

    def is_allowed(name):
        return not name.startswith(ENGINE) or name in shared_types or name.startswith(
            tuple(f"{ENGINE}.{other}." for other in ENGINE_ROOMS))
    assert modules_under(f"{ENGINE}.{room}") and offenders(f"{ENGINE}.{room}", is_allowed) == []


def test_the_engine_is_in_rooms():
    """The engine's folder holds its own modules and the rooms, nothing else."""
    assert {path.name for path in (PACKAGE_DIRS["cbatch.workers"] / "engine").iterdir()
            if path.is_dir() and (path / "__init__.py").exists()} == set(ENGINE_ROOMS)


def test_the_library_folder_imports_no_process():
    """cbatch/ is the library every caller installs; workers/ holds the processes that import it."""
    library = [name for name, path in modules().items() if path.is_relative_to(PACKAGE_DIRS["cbatch"])]
    assert library and offenders_of(library, outside("cbatch.workers")) == []


def top_level_imports(path: Path) -> set[str]:
    """The top-level names of every module a file imports, the project's and others'."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_one_chat_renderer_in_the_decode_worker():
    """Every chat is rendered by the model's template in the decode worker
    (workers/engine/chat_template.py): nothing in cbatch/, the library callers install,
    imports jinja2."""
    library = {name: top_level_imports(path) for name, path in modules().items()
               if path.is_relative_to(PACKAGE_DIRS["cbatch"])}
    assert library and [name for name, imported in library.items() if "jinja2" in imported] == []
    assert "jinja2" in top_level_imports(modules()["cbatch.workers.engine.chat_template"])


def test_the_openai_shapes_know_nothing_of_http():
    """cbatch/openai serves cbatch-submit on a client-only install too: no web framework in it."""
    shapes = {name: top_level_imports(path) for name, path in modules().items() if name.startswith("cbatch.openai")}
    assert shapes and {name: imported & HTTP_STACK for name, imported in shapes.items() if imported & HTTP_STACK} == {}


def test_the_rules_see_a_wrong_import(tmp_path):
    """Control: an engine module importing the daemon is caught."""
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def f():\n    from cbatch.workers.daemon.supervisor import run_daemon\n")
    assert "cbatch.workers.daemon.supervisor" in project_imports(wrong)
    assert not outside("cbatch.workers.daemon")("cbatch.workers.daemon.supervisor")


def test_a_long_module_says_why_it_is_one_concern():
    unexplained = {name: n for name, path in modules().items()
                   if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
                   and "\nOne concern:" not in (ast.get_docstring(ast.parse(path.read_text())) or "")}
    assert unexplained == {}


def test_every_package_is_in_the_distribution():
    """pyproject.toml lists the packages (the package-dir mapping needs that): one left out
    installs nowhere but an editable checkout, where its imports still work."""
    import tomllib
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages == listed, {"not listed": packages - listed, "listed, no such package": listed - packages}
