"""Bytes between processes, installed as `cbatch.ipc` (this folder is `ipc/` in the
repository: pyproject.toml's package-dir maps it): the shared-memory token ring, its record
format, and the messages between the front-end and the decode worker."""
