"""No one gets in where they don't belong: loopback by default, CurveZMQ when asked, owner-only files."""

import os
import stat
import subprocess

import pytest
from common import GREEDY, free_port
from conftest import load_script
from daemonkit import SCRIPTS_DIR

from cbatch.errors import CbatchError


def test_listening_beyond_loopback_needs_an_explicit_flag(tiny_model_path):
    run = subprocess.run([str(SCRIPTS_DIR / "cbatch-worker"), "--model", tiny_model_path,
                          "--endpoint", f"tcp://0.0.0.0:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--allow-remote" in run.stderr


def test_default_files_are_owner_only(tiny_model_path, start_daemon):
    d = start_daemon(tiny_model_path, "--parallel", "1")
    ring = f"/dev/shm/{d.ring_name()}"
    assert stat.S_IMODE(os.stat(ring).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d.endpoint[len("ipc://"):]).st_mode) == 0o600
    for runtime_dir in d.runtime_dir.iterdir():
        assert stat.S_IMODE(os.stat(runtime_dir).st_mode) == 0o700


def test_curve_admits_listed_clients_only(tiny_model_path, start_daemon, tmp_path):
    make_keys = load_script("make_curve_keys")
    keys = tmp_path / "keys"
    allowed = tmp_path / "allowed"
    for name in ("daemon", "alice", "mallory"):
        subprocess.run([str(SCRIPTS_DIR / "python"), make_keys.__file__, str(keys), name], check=True,
                       capture_output=True)
    allowed.mkdir()
    (allowed / "alice.key").write_bytes((keys / "alice.key").read_bytes())
    d = start_daemon(tiny_model_path, "--parallel", "1",
                     "--curve-secret-key", str(keys / "daemon.key_secret"), "--curve-clients", str(allowed),
                     endpoint=f"tcp://127.0.0.1:{free_port()}", client_options={
                         "curve_server_key": str(keys / "daemon.key"),
                         "curve_client_key": str(keys / "alice.key_secret")})
    with d.client() as alice:
        assert alice.generate(prompt="hi", max_tokens=4, **GREEDY).finish_reason == "length"
        assert alice.info["use_ring"] is False  # tcp: tokens are relayed, not read from shared memory
    for options in ({"curve_client_key": str(keys / "mallory.key_secret")}, {"curve_client_key": None},
                    {"curve_server_key": None, "curve_client_key": None}):
        with pytest.raises(CbatchError) as err:
            d.client(connect_timeout_s=1.5, **options)
        assert err.value.code == "unavailable" and "--curve-server-key" in err.value.message
