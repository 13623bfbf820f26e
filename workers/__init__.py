"""The daemon's processes, installed as `cbatch.workers` (this folder is `workers/` in the
repository: pyproject.toml's package-dir maps it): `daemon/` (the `cbatch-worker` command
and its flags, supervisor, front-end, HTTP process manager), `decode/` (the decode worker
process), `engine/` (what that process runs) and `messages.py` (what the front-end and the
decode worker send each other). "The worker" alone means the decode worker; `cbatch-worker` is the whole daemon."""
