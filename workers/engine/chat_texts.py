"""What a client needs to render the GGUF's own Jinja chat template itself (for tool
calls, which llama.cpp's built-in renderer cannot); the decode worker sends it in its
READY, and the front-end relays it in every WELCOME."""

import llama_cpp.llama_cpp as lc


def _special_text(vocab, token: int) -> str:
    """A special token's text as written in a prompt ("<s>"); "" for no token (-1)."""
    return (lc.llama_vocab_get_text(vocab, token) or b"").decode("utf-8", errors="replace") if token >= 0 else ""


def chat_texts(model, vocab) -> dict:
    """The template, the texts of its BOS and EOS tokens, and whether tokenizing adds BOS;
    empty when the GGUF has no template of its own."""
    template = lc.llama_model_chat_template(model, None)
    if not template:
        return {}
    return {"chat_template": template.decode("utf-8", errors="replace"),
            "bos_token": _special_text(vocab, lc.llama_vocab_bos(vocab)),
            "eos_token": _special_text(vocab, lc.llama_vocab_eos(vocab)),
            "adds_bos": bool(lc.llama_vocab_get_add_bos(vocab))}
