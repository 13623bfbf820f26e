"""Imported by every Python process started with this folder on PYTHONPATH (site's
sitecustomize hook): in the decode worker, compiling a constraint whose text names
`slow_compile` takes SLOW_S longer, as a large schema's compile does. The preparer tests
use it; nothing of the project ships it."""

import time

from cbatch.workers.engine.sampling import constraint

SLOW_S = 8.0
_compile = constraint.ConstraintCompiler._compile


def slow_compile(self, params):
    if "slow_compile" in (params.json_schema or ""):
        time.sleep(SLOW_S)
    return _compile(self, params)


constraint.ConstraintCompiler._compile = slow_compile
