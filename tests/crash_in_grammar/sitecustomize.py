"""Imported by every Python process started with this folder on PYTHONPATH (site's
sitecustomize hook): the decode worker then aborts, as llama.cpp's grammar did, inside
the sampling of any request with a grammar. The quarantine tests use it to crash the
worker from one request's sampling; nothing of the project ships it."""

import os

from cbatch.workers.engine.sampling import guarded


def _abort(*args, **kwargs):
    os.abort()


guarded.sample_guarded = _abort  # step.py imports the name after this runs
