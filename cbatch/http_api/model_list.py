"""What `GET /v1/models` tells a client about the model it may send to: OpenAI's model
object, with the context a sequence is served (a client that guesses 8k or 256k instead
overflows mid-conversation) under the names clients read it by, `context_length`
(OpenRouter, Ollama, LM Studio), `max_model_len` (vLLM) and `meta.n_ctx` /
`meta.n_ctx_train` (llama-server); cbatch's `reasoning` (the tags the model thinks in, or
null) and `takes_images`. Anthropic's SDKs (a request carrying `anthropic-version`) get
their own list shape. Before the model has loaded the sizes are null."""

import time


def model_entry(name: str, created: int, ctx_per_seq: int | None, info: dict, reasoning: dict | None) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "cbatch",
            "context_length": ctx_per_seq, "max_model_len": ctx_per_seq,
            "meta": {"n_ctx": ctx_per_seq, "n_ctx_train": info.get("n_ctx_train")},
            "reasoning": reasoning, "takes_images": bool(info.get("takes_images"))}


def anthropic_model(entry: dict) -> dict:
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry["created"]))
    return {"type": "model", "id": entry["id"], "display_name": entry["id"], "created_at": created_at,
            "context_length": entry["context_length"]}


def anthropic_models(entries: list[dict]) -> dict:
    data = [anthropic_model(entry) for entry in entries]
    return {"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]}
