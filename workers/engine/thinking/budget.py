"""A thinking budget: a request that thinks in tags (`<think>...</think>`) and sets
`reasoning_budget` gets at most that many tokens inside its thinking block; once they are
spent without the close tag, the close tag's tokens are forced, one a step, in place of
sampled ones, and the answer follows.

A forced token is consumed by the sequence's constraint and accepted by its sampler
chain as a sampled one would be, so a constraint goes on from after the tag. A token the
constraint does not allow at that point is not forced (a matcher never takes a token it
rejects): the close tag is tried again from its start at the next step, and the model
samples meanwhile. Forcing is decided from token ids and pieces
only, when the step samples, so it is the same with overlap on or off (the next batch is
queued after the forced token is appended) and with backend sampling (the token llama.cpp
sampled in its graph is replaced; such chains hold no state to accept into).
"""

import llama_cpp.llama_cpp as lc


class ThinkingBudget:
    """One sequence's thinking state: before the block, inside it (counting tokens), or
    past its close tag (only one block is budgeted)."""

    def __init__(self, budget: int, tags: tuple[str, str], close_ids: list[int], is_open: bool):
        self.budget = budget
        self.open_tag, self.close_tag = (tag.encode() for tag in tags)
        self.close_ids = close_ids  # the close tag's tokens, forced in order
        self.is_thinking = is_open  # the prompt opened the block (a template's generation prompt)
        self.is_done = False
        self.num_thinking = 0  # tokens generated inside the block
        self.num_forced = 0  # of close_ids forced so far; the rest go next, a step each
        self._tail = b""  # the output's last bytes, where a tag is looked for
        self._max_tag_bytes = max(len(self.open_tag), len(self.close_tag))

    def next_forced(self) -> int | None:
        """The token to force at this step, or None to sample."""
        if self.num_thinking < self.budget or not self.is_thinking:
            return None
        return self.close_ids[self.num_forced]

    def on_token(self, token: int, piece: bytes) -> None:
        """After each token of the sequence, sampled or forced (never after is_done: the
        budget is dropped then, track_budgets)."""
        if self.next_forced() == token:
            self.num_forced += 1
        self._tail = (self._tail + piece)[-self._max_tag_bytes - len(piece):]
        if not self.is_thinking:
            if self.open_tag in self._tail:
                self.is_thinking, self._tail = True, self._tail[self._tail.index(self.open_tag) + len(self.open_tag):]
            return
        self.num_thinking += 1
        if self.close_tag in self._tail or self.num_forced == len(self.close_ids):
            self.is_done = True

    def on_refused(self) -> None:
        """The constraint does not allow the token to force now: start the tag over."""
        self.num_forced = 0


def forced_tokens(logit_rows) -> dict:
    """sequence -> the token forced on it at this step, for the sampling sequences whose
    budget is spent; each forced token is consumed by its constraint and accepted into its
    host chain here."""
    forced = {}
    for seq, _, _ in logit_rows:
        budget = seq.budget
        token = budget.next_forced() if budget is not None else None
        if token is None:
            continue
        if seq.matcher is not None and seq.matcher.try_consume_tokens([token]) != 1:
            budget.on_refused()
            continue
        chain = seq.sampler if not seq.is_backend_sampled else None
        if chain is not None:
            lc.llama_sampler_accept(chain, token)
        forced[seq] = token
    return forced


def track_budgets(sampled, token_piece) -> None:
    """Every sampled or forced token, to the budget of its sequence (if it has one); a
    spent budget is dropped, so its sequence costs the step nothing more."""
    for seq, token in sampled:
        if seq.budget is not None:
            seq.budget.on_token(token, token_piece(token))
            if seq.budget.is_done:
                seq.budget = None
