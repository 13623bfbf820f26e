"""The peers a benchmark starts and measures: a cbatch daemon (cbatch-worker, optionally
with --http) and llama.cpp's llama-server, where scripts/build_llama_server.sh put it (or
the bench's --llama-server), each on its own files and port and stopped at the end."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx

from cbatch.client import Client
from cbatch.errors import CbatchError

BIN_DIR = Path(sys.executable).parent
LLAMA_SERVER = Path(__file__).resolve().parents[2] / "build" / "llama-server" / "bin" / "llama-server"
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(base_url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the HTTP server did not become healthy")


class CbatchDaemon:
    def __init__(self, model_path: str, parallel: int, flags: list[str], extra_env: dict | None = None):
        self.workdir = Path(tempfile.mkdtemp(prefix="cbb-"))
        self.endpoint = f"ipc://{self.workdir / 'cbatch.sock'}"
        self.env = {**os.environ, **(extra_env or {}), "XDG_RUNTIME_DIR": str(self.workdir),
                    "CBATCH_ENDPOINT": self.endpoint}
        self.log = open(self.workdir / "daemon.log", "w")
        self.process = subprocess.Popen([str(BIN_DIR / "cbatch-worker"), "-m", model_path, "-np", str(parallel),
                                         *flags],
                                        env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with Client(self.endpoint, connect_timeout_s=1.0) as client:
                    if client.health()["status"] == "ok":
                        return
            except CbatchError:
                time.sleep(0.2)
        raise RuntimeError(f"cbatch-worker did not start: {(self.workdir / 'daemon.log').read_text()}")

    def send(self, max_tokens: int):
        local = threading.local()

        def send(prompt: str) -> int:
            if not hasattr(local, "client"):
                local.client = Client(self.endpoint)
            result = local.client.generate(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
            return result.usage["completion_tokens"]

        return send

    def stats(self) -> dict:
        with Client(self.endpoint) as client:
            return client.stats()

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class LlamaServer:
    def __init__(self, model_path: str, parallel: int, ctx_per_seq: int, threads: int, num_clients: int = 0,
                 flags: tuple[str, ...] = ()):
        self.port = free_port()
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [str(LLAMA_SERVER), "-m", model_path, "-np", str(parallel), "-c", str(parallel * ctx_per_seq),
             "-t", str(threads), "-b", "512", "--port", str(self.port), "--no-webui",
             "--threads-http", str(max(parallel, num_clients) + 4), *flags],  # a connection per client, as cbatch's
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("llama-server did not start")

    def send(self, max_tokens: int):
        def send(prompt: str) -> int:
            body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                               "cache_prompt": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=3600) as reply:
                return json.load(reply)["tokens_predicted"]

        return send

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=60)


def http_pid(daemon: CbatchDaemon) -> int:
    for line in reversed((daemon.workdir / "daemon.log").read_text().splitlines()):
        if line.startswith("cbatch http: serving"):
            return int(line.rsplit("pid ", 1)[1].rstrip(")"))
    raise RuntimeError("no HTTP server in the daemon's log")
