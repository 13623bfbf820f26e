"""Write one of the tiny random-weight test models (scripts/tiny_models/) and print its path.

    python scripts/make_tiny_model.py [OUT_PATH] [--chat-template FILE]          the llama text model
    python scripts/make_tiny_model.py --kind embedding OUT_PATH [--pooling cls]  a BERT embedding model
    python scripts/make_tiny_model.py --kind projector OUT_PATH [--n-embd-text N]  a vision projector

Tests and benches import the writers from here: `llama.make_tiny_model`,
`embedding.make_tiny_embedding_model`, `projector.make_tiny_projector`.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_models/, beside this file
from tiny_models import embedding, llama, projector  # noqa: E402

# The options each kind takes beyond its path: a kind given another's option is refused.
OPTIONS = {"llama": {"chat_template"}, "embedding": {"pooling"}, "projector": {"n_embd_text"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random-weight test model.")
    parser.add_argument("path", nargs="?", help=f"where to write it (the llama model: default {llama.DEFAULT_PATH})")
    parser.add_argument("--kind", choices=sorted(OPTIONS), default="llama")
    parser.add_argument("--chat-template", metavar="FILE", help="llama: a Jinja chat template to embed")
    parser.add_argument("--pooling", choices=sorted(embedding.POOLING), help="embedding: how it pools (default mean)")
    parser.add_argument("--n-embd-text", type=int, help=f"projector: the text model's width ({llama.N_EMBD})")
    args = parser.parse_args(argv)
    stray = [name for name in sorted(set().union(*OPTIONS.values()) - OPTIONS[args.kind])
             if getattr(args, name) is not None]
    if stray:
        parser.error(f"--{stray[0].replace('_', '-')} is not an option of --kind {args.kind}")
    if args.path is None and args.kind != "llama":
        parser.error(f"--kind {args.kind} needs OUT_PATH")
    given = {name: getattr(args, name) for name in OPTIONS[args.kind] if getattr(args, name) is not None}
    if args.kind == "embedding":
        print(embedding.make_tiny_embedding_model(args.path, **given))
    elif args.kind == "projector":
        print(projector.make_tiny_projector(args.path, **given))
    else:
        template = Path(args.chat_template).read_text() if args.chat_template else None
        print(llama.make_tiny_model(args.path or llama.DEFAULT_PATH, chat_template=template))
    return 0


if __name__ == "__main__":
    sys.exit(main())
