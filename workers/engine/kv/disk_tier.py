"""The disk tier below the host-memory one (--cache-dir): saved states as files that outlive
the daemon, so a conversation that returns after a restart costs only its new tokens.

Layout: DIR/<fingerprint>/<sha-256 of the tokens>.kv. The fingerprint names everything a
state depends on (the model file, llama.cpp's build, the KV layout and types: see
LlamaRunner.state_fingerprint); a daemon with another model, build or layout uses a
directory of its own and never reads these files.

A file: MAGIC, the header's length (4 bytes, little-endian), the header (msgpack: the
fingerprint, the tokens as int64 little-endian since an image's placeholder ids go below
-2^31, the checkpoint's length, both states' sizes and CRC-32s), then the state and the
checkpoint's state (host_tier.py's terms).
Written under a temporary name and renamed: a file under its final name was whole when
written, and the checksums catch what the disk lost since. A file that fails a check
(truncated, corrupt, foreign, stale) is removed with one log line and never restored: the
stored tokens must also equal the ones the index matched.

Threads: one writer thread takes writes, removals and touches in order, off the decode
loop; files are read by the preparer threads (HostTier.prefetch). At most max_bytes of
files, least recently used removed first; writes beyond MAX_QUEUED_BYTES waiting are
dropped (those states stay in memory only), so a slow disk never holds memory.
"""

import hashlib
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict

import msgpack
import numpy as np

from cbatch.workers.engine.kv.host_tier import state_buffer

MAGIC = b"CBKVST1\n"
HEADER_LENGTH = struct.Struct("<I")
MAX_HEADER_BYTES = 64 << 20  # tokens of a sequence of a few million at most
MAX_QUEUED_BYTES = 512 << 20
SUFFIX = ".kv"
# A state holds its conversation's tokens and what the model computed from them: the
# daemon's user alone may read them.
PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600

log = logging.getLogger("cbatch.kv")


class BadFile(Exception):
    pass


def file_name(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, "<i8").tobytes()).hexdigest()[:40] + SUFFIX


class DiskTier:
    def __init__(self, root: str, fingerprint: str, max_bytes: int):
        self.fingerprint = fingerprint
        self.dir = os.path.join(root, fingerprint[:32])
        os.makedirs(self.dir, mode=PRIVATE_DIR_MODE, exist_ok=True)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_written = self.num_removed = self.num_write_failures = self.num_skipped = 0
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> bytes, least recently used first
        self._entries: dict = {}  # name -> the host tier's SavedPrefix
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._num_queued_bytes = 0
        self._tier = None
        self._thread: threading.Thread | None = None

    # --- start ---

    def scan(self) -> list[tuple[list[int], int, str]]:
        """(tokens, checkpoint tokens, file name) of every sound file, least recently used
        first; files left half-written by a crash, and files that fail a check, are removed."""
        found = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if not name.endswith(SUFFIX):
                _remove(path)  # a temporary file a stopped writer left
                continue
            try:
                with open(path, "rb") as file:
                    header = self._read_header(file, os.fstat(file.fileno()).st_size)
                tokens = np.frombuffer(header["tokens"], "<i8").tolist()
                if file_name(tokens) != name:
                    raise BadFile("its name does not match its tokens")
            except (OSError, BadFile, ValueError, KeyError, TypeError) as err:
                self._skip(name, err)
                continue
            found.append((os.stat(path).st_mtime, tokens, header["checkpoint_tokens"], name))
            self._files[name] = os.stat(path).st_size
            self.num_bytes += self._files[name]
        found.sort(key=lambda item: item[0])
        self._files = OrderedDict((name, self._files[name]) for *_, name in found)
        return [(tokens, checkpoint_tokens, name) for _, tokens, checkpoint_tokens, name in found]

    def register(self, name: str, entry) -> None:
        self._entries[name] = entry

    def start(self, tier) -> None:
        self._tier = tier
        self._thread = threading.Thread(target=self._run, name="cbatch-kv-disk", daemon=True)
        self._thread.start()

    # --- from the host tier, with its lock held: queued for the writer ---

    def write(self, entry, tokens: list[int], state, checkpoint_state) -> None:
        size = len(state) + len(checkpoint_state or b"")
        if self._num_queued_bytes + size > MAX_QUEUED_BYTES:
            self.num_write_failures += 1
            self._tier.on_write_failed(entry)
            return
        self._num_queued_bytes += size
        self._queue.put(("write", entry, tokens, state, checkpoint_state))

    def remove(self, name: str) -> None:
        self._queue.put(("remove", name))

    def touch(self, name: str) -> None:
        self._queue.put(("touch", name))

    # --- from a preparer thread ---

    def load(self, name: str, tokens: list[int]) -> tuple | None:
        """The states of `name`, checked against its header, its checksums and `tokens`;
        None (the file removed, one log line) when any check fails."""
        try:
            with open(os.path.join(self.dir, name), "rb") as file:
                header = self._read_header(file, os.fstat(file.fileno()).st_size)
                if header["tokens"] != np.asarray(tokens, "<i8").tobytes():
                    raise BadFile("its tokens are not the ones indexed")
                state = _read_checked(file, header["state_bytes"], header["state_crc"])
                checkpoint = (_read_checked(file, header["checkpoint_bytes"], header["checkpoint_crc"])
                              if header["checkpoint_bytes"] else None)
            return state, checkpoint
        except (OSError, BadFile, ValueError, KeyError, TypeError) as err:
            self._skip(name, err)
            self.remove(name)
            return None

    # --- statistics and stop ---

    def snapshot(self) -> dict:
        return {"disk_cache_bytes": self.num_bytes, "disk_cache_max_bytes": self.max_bytes,
                "disk_cache_files": len(self._files), "disk_cache_written": self.num_written,
                "disk_cache_removed": self.num_removed, "disk_cache_write_failures": self.num_write_failures,
                "disk_cache_skipped": self.num_skipped}

    def close(self) -> None:
        """Finish the queued writes, then stop the writer."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    # --- the writer thread ---

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            kind, *args = job
            try:
                if kind == "write":
                    self._write(*args)
                elif kind == "remove":
                    self._remove_file(*args)
                else:
                    self._touch(*args)
            except OSError as err:
                log.warning("cbatch-worker: the KV cache directory %s: %s", self.dir, err)

    def _write(self, entry, tokens: list[int], state, checkpoint_state) -> None:
        name = file_name(tokens)
        path = os.path.join(self.dir, name)
        checkpoint_state = checkpoint_state or b""
        header = msgpack.packb({
            "fingerprint": self.fingerprint, "tokens": np.asarray(tokens, "<i8").tobytes(),
            "checkpoint_tokens": entry.checkpoint_tokens, "state_bytes": len(state), "state_crc": zlib.crc32(state),
            "checkpoint_bytes": len(checkpoint_state), "checkpoint_crc": zlib.crc32(checkpoint_state)})
        temporary = f"{path}.{os.getpid()}.tmp"
        try:
            with open(temporary, "wb", opener=_private_file) as file:
                file.write(MAGIC + HEADER_LENGTH.pack(len(header)) + header)
                file.write(state)
                file.write(checkpoint_state)
            os.replace(temporary, path)
        except OSError:
            _remove(temporary)
            with self._tier.lock:
                self._num_queued_bytes -= len(state) + len(checkpoint_state)
                self.num_write_failures += 1
                self._tier.on_write_failed(entry)
            raise
        size = os.stat(path).st_size
        with self._tier.lock:
            self._num_queued_bytes -= len(state) + len(checkpoint_state)
            if not self._tier.on_written(entry, name):
                _remove(path)
                return
            self.num_written += 1
            self.num_bytes += size - self._files.pop(name, 0)
            self._files[name] = size
            self._entries[name] = entry
            while self.num_bytes > self.max_bytes and len(self._files) > 1:
                old = next(iter(self._files))
                self._forget(old)
                _remove(os.path.join(self.dir, old))
                if (old_entry := self._entries.pop(old, None)) is not None:
                    self._tier.on_disk_removed(old_entry)

    def _touch(self, name: str) -> None:
        """Used now: last out, also after a restart (scan orders by modification time)."""
        with self._tier.lock:
            if name not in self._files:
                return
            self._files.move_to_end(name)
        os.utime(os.path.join(self.dir, name))

    def _remove_file(self, name: str) -> None:
        with self._tier.lock:
            self._forget(name)
            self._entries.pop(name, None)
        _remove(os.path.join(self.dir, name))

    def _forget(self, name: str) -> None:
        if name in self._files:
            self.num_bytes -= self._files.pop(name)
            self.num_removed += 1

    # --- files ---

    def _read_header(self, file, file_size: int) -> dict:
        if file.read(len(MAGIC)) != MAGIC:
            raise BadFile("not a cbatch KV state file")
        (header_size,) = HEADER_LENGTH.unpack(file.read(HEADER_LENGTH.size) or b"\0\0\0\0")
        if header_size > MAX_HEADER_BYTES:
            raise BadFile("its header is too long")
        header = msgpack.unpackb(file.read(header_size))
        if header["fingerprint"] != self.fingerprint:
            raise BadFile("written for another model, llama.cpp build or KV layout")
        expected = len(MAGIC) + HEADER_LENGTH.size + header_size + header["state_bytes"] + header["checkpoint_bytes"]
        if file_size != expected:
            raise BadFile(f"{file_size} bytes where its header says {expected}")
        return header

    def _skip(self, name: str, err: Exception) -> None:
        self.num_skipped += 1
        log.warning("cbatch-worker: skipped the KV cache file %s: %s", os.path.join(self.dir, name), err)
        _remove(os.path.join(self.dir, name))


def _read_checked(file, size: int, crc: int):
    data = state_buffer(size)
    if file.readinto(data) != size or zlib.crc32(data) != crc:
        raise BadFile("its state fails its checksum")
    return data


def _private_file(path: str, flags: int) -> int:
    return os.open(path, flags, PRIVATE_FILE_MODE)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
