"""Imported by every Python process started with this folder on PYTHONPATH (site's
sitecustomize hook): in the decode worker, compiling a constraint whose text names
`slow_compile` takes SLOW_S longer, as a large schema's compile does. The preparer tests
use it; nothing of the project ships it."""

import time

from cbatch.workers.engine.structured import compiler

SLOW_S = 8.0
_compile = compiler.ConstraintCompiler._compile


def slow_compile(self, params):
    if "slow_compile" in (params.json_schema or ""):
        time.sleep(SLOW_S)
    return _compile(self, params)


compiler.ConstraintCompiler._compile = slow_compile
