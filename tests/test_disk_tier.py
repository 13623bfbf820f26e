"""The disk tier (--cache-dir) through the engine on the fake runner: conversations that
come back after a restart, files that are truncated, corrupt or foreign, and the bound on
the directory."""

import logging
import os
from pathlib import Path

from common import GREEDY
from enginekit import generate
from fakerunner import FakeRunner

from cbatch.config import EngineConfig
from cbatch.workers.engine.engine import Engine
from cbatch.workers.engine.kv.disk_tier import MAGIC


def disk_engine(cache_dir: Path, has_swa=False, max_gb=1.0, parallel=2) -> Engine:
    config = EngineConfig(parallel=parallel, ctx_size=parallel * 512, batch_size=64, cache_dir=str(cache_dir),
                          cache_dir_max_gb=max_gb)
    return Engine(config, FakeRunner(parallel * 512, parallel, config.num_seq_ids, True, has_swa, unified=False))


def conversations(count: int) -> list[str]:
    return [f"conversation {i} " + "pqrstuvw"[i % 8] * (80 + 5 * i) for i in range(count)]


def bodies(prompts: list[str]) -> list[dict]:
    return [{"prompt": p, "max_tokens": 6, **GREEDY} for p in prompts]


def first_turns(cache_dir: Path, count: int, has_swa=False) -> list[str]:
    """Run each conversation's first turn on an engine with the disk tier, stop it (its
    streams are saved too), and return each conversation's second prompt."""
    engine = disk_engine(cache_dir, has_swa)
    prompts = conversations(count)
    results = generate(engine, bodies(prompts))
    engine.close()
    return [p + r.text + " and then" for p, r in zip(prompts, results)]


def state_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*/*.kv"))


def reference(prompts: list[str]) -> list[str]:
    engine = Engine(EngineConfig(parallel=2, ctx_size=1024, batch_size=64, prefix_cache=False),
                    FakeRunner(1024, 2, 8, False, unified=False))
    return [r.text for r in generate(engine, bodies(prompts))]


def test_conversations_come_back_after_a_restart_from_the_directory(tmp_path):
    returning = first_turns(tmp_path, 6, has_swa=True)
    assert len(state_files(tmp_path)) == 6  # 4 saved as streams were reused, 2 saved at the stop
    assert {path.stat().st_mode & 0o777 for path in state_files(tmp_path)} == {0o600}  # the prompts' tokens
    assert state_files(tmp_path)[0].parent.stat().st_mode & 0o777 == 0o700
    engine = disk_engine(tmp_path, has_swa=True)
    results = generate(engine, bodies(returning))
    assert [r.text for r in results] == reference(returning)
    assert all(r.usage["cached_tokens"] >= r.usage["prompt_tokens"] - 2 * 16 - 10 for r in results)
    stats = engine.snapshot()
    assert stats["disk_cache_hits"] == 6 and stats["disk_cache_loaded"] == 6
    engine.close()


def test_a_truncated_corrupt_or_foreign_file_is_skipped_with_one_line_and_never_restored(tmp_path, caplog):
    returning = first_turns(tmp_path, 6)
    files = state_files(tmp_path)
    os.truncate(files[0], files[0].stat().st_size - 5)  # found at start
    data = bytearray(files[1].read_bytes())
    data[-3] ^= 0xFF  # a state byte: found when read
    files[1].write_bytes(bytes(data))
    files[2].write_bytes(b"not a state file at all")
    foreign = files[3].parent / ("f" * 40 + ".kv")  # another model's header
    foreign.write_bytes(files[3].read_bytes().replace(files[3].parent.name.encode()[:8], b"00000000", 1))
    (files[3].parent / "leftover.kv.123.tmp").write_bytes(MAGIC)  # a crashed writer's
    with caplog.at_level(logging.WARNING, logger="cbatch.kv"):
        engine = disk_engine(tmp_path)
        results = generate(engine, bodies(returning))
    assert [r.text for r in results] == reference(returning)  # nothing wrong restored
    skipped = [record.getMessage() for record in caplog.records if "skipped the KV cache file" in record.getMessage()]
    assert len(skipped) == 4, skipped  # truncated, corrupt, not a state, foreign: one line each
    assert sum(r.usage["cached_tokens"] == 0 for r in results) == 3  # the three conversations whose file was bad
    engine.close()
    names = {path.name for path in state_files(tmp_path)}
    assert not names & {files[0].name, foreign.name} and not list(tmp_path.glob("*/*.tmp"))


def test_the_directory_keeps_at_most_its_bound_least_recently_used_out_first(tmp_path):
    engine = disk_engine(tmp_path)
    generate(engine, bodies(conversations(1)))
    engine.close()
    (one,) = state_files(tmp_path)
    max_bytes = 3.5 * one.stat().st_size  # room for about three files (later conversations' are longer)
    engine = disk_engine(tmp_path, max_gb=max_bytes / 1e9)
    generate(engine, bodies(conversations(10)))
    engine.close()
    files = state_files(tmp_path)
    assert sum(path.stat().st_size for path in files) <= max_bytes and 2 <= len(files) <= 3
    assert engine.snapshot()["disk_cache_removed"] >= 7


def test_another_layout_uses_a_directory_of_its_own(tmp_path):
    returning = first_turns(tmp_path, 3, has_swa=False)
    engine = disk_engine(tmp_path, has_swa=True)  # a different fingerprint
    results = generate(engine, bodies(returning))
    assert all(r.usage["cached_tokens"] == 0 for r in results) and engine.snapshot()["disk_cache_hits"] == 0
    engine.close()
    assert len(list(tmp_path.iterdir())) == 2
