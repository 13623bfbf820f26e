"""The options most benches share, said once: a bench's parser, whose --help is the
bench's docstring as written, with the model it runs and the counts it is sized by
(`--parallel`, `--requests`, `--max-tokens`, ...), each at that bench's own default."""

import argparse

EMBEDDED = "the embedded gemma-3-270m"
REQUIRED = "required"  # `model=REQUIRED`: the bench has no default model
TINY_MODEL_HELP = "a GGUF file (scripts/make_tiny_model.py writes a tiny one)"


def bench_parser(doc: str, *, model: str | None = EMBEDDED, **counts) -> argparse.ArgumentParser:
    """`model` is what runs without --model (REQUIRED: --model must be given; None: the
    bench adds its own --model, or takes none). Each of `counts` adds an integer option of
    that name (`max_tokens` is --max-tokens) whose default is the value: a list takes one
    or more values; a (default, help) pair says what the count is."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model == REQUIRED:
        parser.add_argument("--model", required=True, help=TINY_MODEL_HELP)
    elif model is not None:
        parser.add_argument("--model", default=None, help=f"a GGUF file (default: {model})")
    for name, value in counts.items():
        default, help_text = value if isinstance(value, tuple) else (value, None)
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=help_text,
                            **({"nargs": "+"} if isinstance(default, list) else {}))
    return parser
