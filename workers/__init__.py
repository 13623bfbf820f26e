"""The daemon's processes, installed as `cbatch.workers` (this folder is `workers/` in the
repository: pyproject.toml's package-dir maps it): `daemon/` (supervisor, front-end, HTTP
process manager), `decode/` (the decode worker process) and `engine/` (what that process
runs). "The worker" alone means the decode worker; `cbatch-worker` is the whole daemon."""
