"""Turning a validated request into a Sequence: the prompt's text and tokens, the checks
that it fits, its sampler chain and its constraint's matcher. Reads only the model, never engine state, so the
decode worker runs it off the decode loop's thread."""


from cbatch.errors import INVALID_REQUEST, MODEL_EMBEDS_ONLY, PROMPT_TOO_LONG, CbatchError
from cbatch.params import BATCH, Request
from cbatch.workers.engine.model_runner import ModelRunner
from cbatch.workers.engine.sampling.host import make_sampler_chain, needs_host_sampling
from cbatch.workers.engine.sequence import Sequence
from cbatch.workers.engine.structured.manager import StructuredOutput
from cbatch.workers.engine.thinking.budget import ThinkingBudget


def prompt_text(runner: ModelRunner, request: Request) -> str:
    """The request's prompt, or its chat rendered with the model's template (tools too)."""
    return request.prompt if request.messages is None else runner.render_chat(request.messages, request.offered_tools)


def prepare_sequence(runner: ModelRunner, structured: StructuredOutput, request: Request, ctx_per_seq: int,
                     model_reasoning: dict | None, deadline_s: float) -> Sequence:
    """Tokenize the request, build its sampler and its constraint; raises CbatchError if it
    cannot run. `model_reasoning` holds the thinking block's tags the model uses
    (thinking/tags.py), or is None."""
    if runner.is_embedding_only:
        raise CbatchError(MODEL_EMBEDS_ONLY, f"this model ({runner.architecture}) only computes embeddings: "
                                             "send it to /v1/embeddings (Client.embed), or serve a generative model")
    text = prompt_text(runner, request)
    max_prompt_bytes = ctx_per_seq * runner.max_token_bytes
    if len(text) > max_prompt_bytes or len(text.encode()) > max_prompt_bytes:  # not worth tokenizing
        raise CbatchError(
            PROMPT_TOO_LONG,
            f"the prompt is {len(text.encode())} bytes; a sequence holds {ctx_per_seq} tokens of at most "
            f"{runner.max_token_bytes} bytes each (shorten the prompt or raise --ctx-size)",
        )
    prompt_ids, images = prompt_tokens(runner, request, text)
    if len(prompt_ids) >= ctx_per_seq:
        raise CbatchError(
            PROMPT_TOO_LONG,
            f"the prompt is {len(prompt_ids)} tokens; a sequence holds {ctx_per_seq} "
            "(shorten the prompt or raise --ctx-size)",
        )
    on_backend = runner.has_backend_sampling and not needs_host_sampling(request.params)
    # Compiled (or taken from the cache) and the budget made before the chain is: a refusal leaks no chain.
    matcher, gate = structured.constraint(request.params, text, _tags(request, model_reasoning))
    budget = _budget(runner, request, text, model_reasoning)
    # Penalties count the prompt's tokens; image positions hold no token (vision.py).
    text_ids = [token for token in prompt_ids if token >= 0] if images else prompt_ids
    sampler = make_sampler_chain(runner.vocab, runner.eog_ids, request.params, text_ids, on_backend)
    return Sequence(request.request_id, prompt_ids, request.params, sampler=sampler,
                    matcher=matcher, gate=gate, is_backend_sampled=on_backend,
                    is_batch=request.priority == BATCH, deadline_s=deadline_s,
                    budget=budget,
                    tenant=request.tenant, tenant_weight=request.tenant_weight, images=images)


def count_prompt_tokens(runner: ModelRunner, request: Request) -> int:
    """The prompt's tokens as the model sees it (the chat rendered, an image's positions
    counted), for a count only: nothing is checked against a sequence's context."""
    if runner.is_embedding_only:
        raise CbatchError(MODEL_EMBEDS_ONLY, f"this model ({runner.architecture}) only computes embeddings")
    text = prompt_text(runner, request)
    return len(prompt_tokens(runner, request, text)[0])


def prompt_tokens(runner: ModelRunner, request: Request, text: str) -> tuple[list[int], tuple]:
    """The prompt's token ids, and its images' embeddings and positions when it has images."""
    if not request.images:
        return runner.tokenize(text), ()
    if runner.vision is None:
        raise CbatchError(INVALID_REQUEST, "images: this model takes no images; start the daemon with "
                                           "--mmproj PROJECTOR.gguf, the model's vision projector")
    prompt_ids, images = runner.vision.prompt_with_images(text, request.images)
    if prompt_ids[-1] < 0:
        raise CbatchError(INVALID_REQUEST, "images: the prompt must not end with an image: text must follow it")
    return prompt_ids, images


def _budget(runner: ModelRunner, request: Request, prompt_text: str,
            model_reasoning: dict | None) -> ThinkingBudget | None:
    """The request's thinking budget, in the request's tags or else the model's; the block is
    open from the start when the prompt ends in its open tag (a chat template whose generation
    prompt opens it)."""
    if request.params.reasoning_budget is None:
        return None
    tags = _tags(request, model_reasoning)
    if tags is None:
        raise CbatchError(INVALID_REQUEST, "reasoning_budget needs the thinking block's tags, and the daemon knows "
                                          "none for this model: send reasoning_tags [open, close], or start the "
                                          "daemon with --reasoning-tags OPEN CLOSE")
    open_tag, close_tag = tags
    close_ids = runner.tokenize(close_tag, add_special=False)
    return ThinkingBudget(request.params.reasoning_budget, tags, close_ids,
                          is_open=prompt_text.rstrip().endswith(open_tag))


def _tags(request: Request, model_reasoning: dict | None) -> tuple[str, str] | None:
    """The thinking block's tags: the request's, else the model's, else None."""
    return request.params.reasoning_tags or (tuple(model_reasoning["tags"]) if model_reasoning else None)
