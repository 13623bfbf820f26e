"""Start and stop a real cbatch-worker daemon (its console script) for tests."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

from cbatch.client import Client
from cbatch.errors import CbatchError
from cbatch.protocol import PROTOCOL_VERSION, MsgType, pack, unpack

SCRIPTS_DIR = Path(sys.executable).parent
START_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 5.0  # per try while waiting for a start: a busy machine answers late
REPLY_TIMEOUT_S = 60.0


class Daemon:
    def __init__(self, model_path: str, *args: str, endpoint: str | None = None, client_options: dict | None = None,
                 start_new_session: bool = False, workdir: Path | None = None, launcher: list[str] | None = None,
                 prefix: tuple[str, ...] = ()):
        # Socket paths must fit a Unix socket address (107 bytes): pytest's tmp_path may not.
        # A given workdir is another daemon's: this one starts where that one ran. A launcher
        # (a command line that runs cbatch-worker's main) stands in for the console script;
        # `prefix` runs it through another command (`ip netns exec NAME`), which must exec it.
        self.model_path = model_path
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="cbt-"))
        self.runtime_dir = self.workdir / "run"
        self.runtime_dir.mkdir(mode=0o700, exist_ok=True)
        self.endpoint = endpoint or f"ipc://{self.workdir / 'cbatch.sock'}"
        self.client_options = client_options or {}
        # The state directory (--http's files and batches) is the daemon's own, kept with its workdir.
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(self.runtime_dir),
                    "XDG_STATE_HOME": str(self.workdir / "state"), "CBATCH_ENDPOINT": self.endpoint}
        self.stderr_path = self.workdir / "daemon.log"
        self._stderr = open(self.stderr_path, "a")
        self.process = subprocess.Popen(
            [*prefix, *(launcher or [str(SCRIPTS_DIR / "cbatch-worker")]), "--model", model_path, *args],
            env=self.env, stdout=self._stderr, stderr=subprocess.STDOUT, start_new_session=start_new_session,
        )
        self.health = self.stopped_unless(self._wait_ready)

    def state_dir(self) -> Path:
        """Its default state directory (--http's files and batches): under its workdir's XDG_STATE_HOME."""
        from cbatch.jobs.state_dir import endpoint_dir_name, model_dir_name

        return self.workdir / "state" / "cbatch" / endpoint_dir_name(self.endpoint) / model_dir_name(self.model_path)

    def stopped_unless(self, wait_ready):
        """wait_ready()'s answer; a daemon that never gets ready is stopped before the error
        goes up (no fixture knows of a daemon whose constructor failed, so none would stop it)."""
        try:
            return wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> dict:
        started = time.monotonic()
        last_answer = "none yet"  # what the last try got: the failure message says it
        while time.monotonic() < started + START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon exited {self.process.returncode}: {self.log()}")
            if not self.endpoint.startswith("ipc://") or (self.workdir / "cbatch.sock").exists():
                try:
                    with self.client(connect_timeout_s=CONNECT_TIMEOUT_S) as client:
                        health = client.health()
                except CbatchError as err:
                    last_answer = str(err)
                    continue  # not listening yet
                if health["status"] == "ok":
                    return health
                last_answer = f"status {health['status']}"
            time.sleep(0.1)
        raise RuntimeError(f"daemon not ready after {time.monotonic() - started:.0f} s (last answer: {last_answer}): "
                           f"{self.log()}")

    def client(self, **kwargs) -> Client:
        return Client(self.endpoint, **{**self.client_options, **kwargs})

    def log(self) -> str:
        return self.stderr_path.read_text()

    def ring_name(self) -> str:
        with self.client() as client:
            return client.info["ring_name"]

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60.0) -> int:
        code = stop_process(self.process, sig, timeout_s)
        self._stderr.close()
        return code

    def leftovers(self) -> list[str]:
        """Files the daemon left in its directories (the per-user runtime dir itself may stay;
        the state directory is kept on purpose: its jobs outlive the daemon)."""
        found = [p.name for p in self.workdir.iterdir() if p.name not in ("daemon.log", "run", "state")]
        found += [q.name for p in self.runtime_dir.iterdir() for q in p.iterdir()]
        return found

    def remove_workdir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def stop_process(process: subprocess.Popen, sig=signal.SIGTERM, timeout_s: float = 60.0) -> int:
    """Signal a process we started (unless it has exited) and wait for it; killed if it
    outlasts timeout_s. Its exit code."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def serve_module(daemon: "Daemon"):
    """The body of a module-scoped daemon fixture: the module's tests share the daemon,
    which must then stop cleanly (exit code 0); its directory is removed."""
    yield daemon
    assert daemon.stop() == 0, daemon.log()
    daemon.remove_workdir()


def pid_alive(pid: int) -> bool:
    """False once the process has exited, even if its parent has not reaped it yet: an
    orphan's zombie waits for whichever process adopted it, which is not ours to hurry."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is pid (the decode worker, Python's resource tracker)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return children


def wait_until(predicate, timeout_s: float, poll_s: float = 0.05) -> float:
    """Seconds it took predicate() to hold; fails the test after timeout_s."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(poll_s)
    return time.monotonic() - started


def submit_lines(env: dict, lines: list[dict], folder: Path,
                 timeout_s: float) -> tuple[subprocess.CompletedProcess, dict]:
    """cbatch-submit over a file of `lines` (each with an "id") in folder: its run, and
    its results by id."""
    source, output = folder / "in.jsonl", folder / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([str(SCRIPTS_DIR / "cbatch-submit"), str(source), "-o", str(output)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    return done, {row["id"]: row for row in map(json.loads, output.read_text().splitlines())}


class RawPeer:
    """A bare DEALER speaking the wire protocol: for messages the client library does not
    expose to callers (FETCH), and for checking the exact reply a message gets."""

    def __init__(self, endpoint: str, use_ring: bool = False):
        self._zctx = zmq.Context()
        self.sock = self._zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.send(MsgType.HELLO, {"version": PROTOCOL_VERSION, "use_ring": use_ring})
        msg_type, self.welcome = self.recv()
        assert msg_type is MsgType.WELCOME, self.welcome

    def send(self, msg_type: MsgType, body: dict) -> None:
        self.sock.send_multipart(pack(msg_type, body))

    def recv(self, timeout_s: float = REPLY_TIMEOUT_S) -> tuple[MsgType, dict]:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply from the daemon"
        return unpack(self.sock.recv_multipart())

    def recv_until(self, msg_type: MsgType, timeout_s: float = REPLY_TIMEOUT_S) -> tuple[list, dict]:
        """Every message up to the first of msg_type, and that one's body."""
        before = []
        while True:
            got, body = self.recv(timeout_s)
            if got is msg_type:
                return before, body
            before.append((got, body))

    def close(self) -> None:
        self._zctx.destroy(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


class ScriptedFrontEnd:
    """A stand-in for the daemon's front-end on a real ipc socket, for what a real daemon
    cannot be made to do on demand. It welcomes clients without a ring, answers health
    pings, and answers each SUBMIT with the messages `answer(request_id, body)` returns
    ([(MsgType, body), ...]). With `reads=False` it stops reading once it has welcomed a
    client, as a daemon that cut the client off, and keeps its receive queue tiny so the
    client's sends back up soon."""

    def __init__(self, answer=lambda request_id, body: [], reads: bool = True):
        self.workdir = Path(tempfile.mkdtemp(prefix="cbt-"))
        self.endpoint = f"ipc://{self.workdir / 'cbatch.sock'}"
        self.env = {**os.environ, "CBATCH_ENDPOINT": self.endpoint}
        self._answer, self._reads = answer, reads
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if not reads:
            self._sock.setsockopt(zmq.RCVHWM, 1)
            self._sock.setsockopt(zmq.RCVBUF, 4096)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, *frames = self._sock.recv_multipart()
            msg_type, body = unpack(frames)
            if msg_type is MsgType.HELLO:
                replies = [(MsgType.WELCOME, {"version": PROTOCOL_VERSION, "model": "scripted", "parallel": 1,
                                              "ctx_per_seq": 0, "use_ring": False, "ring_name": "",
                                              "tick_endpoint": ""})]
            elif msg_type is MsgType.SUBMIT:
                replies = self._answer(body["request_id"], body["body"])
            elif msg_type is MsgType.HEALTH:
                replies = [(MsgType.HEALTH_REPLY, {"nonce": body["nonce"], "status": "ok", "lost_request_ids": [],
                                                    "model_names": ["scripted", "m"]})]
            else:
                replies = []
            for reply_type, reply in replies:
                self._sock.send_multipart([identity, *pack(reply_type, reply)])
            if not self._reads:
                self._stop.wait()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._zctx.term()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
