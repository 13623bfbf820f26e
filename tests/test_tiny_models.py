"""The test models' one entry, scripts/make_tiny_model.py: each kind is written by the
command as by the writer it imports, byte for byte, and an option of another kind is refused."""

import subprocess
import sys

import pytest
from conftest import REPO, load_script

ENTRY = REPO / "scripts" / "make_tiny_model.py"


def write(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind, options, written_by", [
    ("llama", ["--chat-template", str(REPO / "scripts" / "chatml_tools.jinja")],
     lambda models, path: models.llama.make_tiny_model(path, chat_template=(REPO / "scripts" / "chatml_tools.jinja")
                                                       .read_text())),
    ("embedding", ["--pooling", "cls"], lambda models, path: models.embedding.make_tiny_embedding_model(path, "cls")),
    ("projector", ["--n-embd-text", "32"], lambda models, path: models.projector.make_tiny_projector(path, 32)),
])
def test_each_kind_is_written_by_the_command_as_by_its_writer(tmp_path, kind, options, written_by):
    done = write("--kind", kind, str(tmp_path / "by-command.gguf"), *options)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "by-command.gguf")
    by_writer = written_by(load_script("make_tiny_model"), tmp_path / "by-writer.gguf")
    assert (tmp_path / "by-command.gguf").read_bytes() == open(by_writer, "rb").read()


def test_an_option_of_another_kind_or_a_missing_path_is_refused_and_writes_nothing(tmp_path):
    stray = write("--kind", "embedding", str(tmp_path / "e.gguf"), "--chat-template", "x.jinja")
    assert stray.returncode == 2 and "--chat-template is not an option of --kind embedding" in stray.stderr
    missing = write("--kind", "projector")
    assert missing.returncode == 2 and "--kind projector needs OUT_PATH" in missing.stderr
    assert list(tmp_path.iterdir()) == []
