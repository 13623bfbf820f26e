"""A request as the engine tracks it while it waits, runs and finishes."""

import enum
import math
import time
from dataclasses import dataclass, field

from cbatch.api_keys import DEFAULT_TENANT
from cbatch.params import SamplingParams
from cbatch.workers.engine.structured.gate import ThinkingGate
from cbatch.workers.engine.text_stream import TextStream
from cbatch.workers.engine.thinking.budget import ThinkingBudget


class SeqStatus(enum.Enum):
    """Where a sequence is; the scheduler makes every transition.

    WAITING -> PREFILLING (admitted with more than its last token to compute) or DECODING
    WAITING -> FORKING (admitted while a running sequence prefills the same prompt: it
               holds a KV id and waits to copy that KV, see forks.py)
    PREFILLING -> DECODING (its last prompt token computed: it samples from now on)
    FORKING -> DECODING (the parent's prompt is computed and copied)
    PREFILLING / DECODING -> WAITING (preempted: recomputed on re-admission)
    FORKING -> WAITING (its parent ended or was preempted first)
    PREFILLING / DECODING / WAITING -> PARKED (paused for its slow client while others wait:
               it holds no slot, its KV kept in the prefix cache)
    PARKED -> WAITING (its client caught up)
    any -> FINISHED
    """

    WAITING = "waiting"
    PREFILLING = "prefilling"
    FORKING = "forking"
    DECODING = "decoding"
    PARKED = "parked"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens or the per-sequence context cap
    CANCELLED = "cancelled"
    ERROR = "error"
    TIMEOUT = "timeout"  # its deadline passed while it ran: it keeps what it produced


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    seq_id: int | None = None  # KV sequence id while running (prefilling or decoding)
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens of prompt + output whose KV is computed
    num_prompt_cached: int = 0  # prompt tokens its first admission found computed (any cache tier, or a fork's copy)
    sampler: object | None = None  # llama.cpp sampler chain, None for plain greedy
    is_backend_sampled: bool = False  # sampled inside llama_decode's graph (backend sampling)
    matcher: object | None = None  # its constraint's llguidance matcher, at the end of output_ids
    gate: ThinkingGate | None = None  # holds the matcher while the thinking block the prompt opened is open
    text: TextStream = None  # type: ignore[assignment]
    max_output_tokens: int = 0  # the output length that ends it (set by the engine when it is added)
    arrived_s: float = field(default_factory=time.monotonic)  # when the engine got it (monotonic clock)
    is_batch: bool = False  # admitted only when no interactive request waits
    budget: ThinkingBudget | None = None  # a thinking budget (reasoning_budget), forced in sampling
    deadline_s: float = math.inf  # on the monotonic clock, which every process of the host shares
    tenant: str = DEFAULT_TENANT  # whose request: admission shares the steps among tenants (sched/fair_share.py)
    tenant_weight: float = 1.0
    is_charged: bool = False  # its prompt was charged to its tenant (at its first admission)
    is_resumed: bool = False  # preempted or requeued, waiting to be admitted again (sched/waiting_queue.py)
    # Its client reads slower than it generates: it decodes no more until told (engine.pause).
    paused_since_s: float | None = None  # when its current pause began (monotonic), None while not paused
    num_paused_s: float = 0.0  # its ended pauses since its last admission, in seconds
    images: tuple = ()  # the prompt's vision.ImageSpans, in position order

    def __post_init__(self):
        if self.text is None:
            self.text = TextStream(self.params.stop)

    @property
    def is_paused(self) -> bool:
        return self.paused_since_s is not None

    def set_paused(self, is_paused: bool, now_s: float) -> None:
        if is_paused and self.paused_since_s is None:
            self.paused_since_s = now_s
        elif not is_paused and self.paused_since_s is not None:
            self.num_paused_s += now_s - self.paused_since_s
            self.paused_since_s = None

    def paused_for_s(self, now_s: float) -> float:
        """Seconds paused since its last admission, the pause under way included: a reader
        that takes a little now and then adds up as one that stopped."""
        return self.num_paused_s + (now_s - self.paused_since_s if self.paused_since_s is not None else 0.0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens to feed before the next sample: the prompt (or its rest) while
        prefilling, exactly one (the last sampled token) while generating."""
        return self.num_tokens - self.num_cached

    @property
    def is_prefilling(self) -> bool:
        return self.status is SeqStatus.PREFILLING

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the concatenation."""
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - num_prompt]

    def image_at(self, position: int):
        """The image whose embeddings take `position`, or None (a text token's)."""
        return next((image for image in self.images if image.start <= position < image.end), None)

    def num_text_ahead(self) -> int:
        """Uncached tokens before the next image (all of them when no image is ahead)."""
        start = next((image.start for image in self.images if image.end > self.num_cached), None)
        return self.num_uncached if start is None else max(0, start - self.num_cached)
