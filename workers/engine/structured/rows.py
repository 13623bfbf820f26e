"""A step's constrained rows: check first, mask on a miss, every miss of the batch at once.

Each constrained row first gets the token the plain path picks for it: the argmax, or
its sampler chain's pick over the raw row (not yet accepted into the chain). When the
row's matcher accepts that token (most steps: a model mostly wants what its constraint
allows) it is consumed and kept, which costs microseconds. The rows that miss get their
masks filled together by one llguidance call that releases the GIL and spreads them over
its threads; each such row then picks again among its allowed tokens only (the argmax,
or its chain over the masked row). Greedy stays exact, and sampling draws from the
constrained distribution: a draw kept when allowed, else drawn again from the allowed
tokens alone, gives p(t) + p(miss) p(t) / p(allowed) = p(t) / p(allowed).

With overlap on (a GPU build), the rows that missed at one step get their next masks
while the next batch decodes (prefetch_masks: llguidance and llama_decode both release
the GIL), and their next pick skips the check: a row that misses tends to miss again (a
literal the model does not expect, a closing bracket it does not want). The mask is of
the matcher's state after its last token, which is the state its next pick starts from;
a row whose matcher consumes a token elsewhere meanwhile (a forced close tag) drops it.

Invariants: a matcher never consumes a token it rejects, and a chain accepts only the
token kept; a masked row is a copy, so a fork that shares the row reads it raw. When the
mask leaves nothing (a logit_bias of -inf on every allowed token, min_tokens holding back
the end that is all the constraint allows) or the matcher fails (a step past llguidance's
limits), the sequence reaches a dead end: it ends as `stop` when its constraint is
complete, else with an error. It never goes on unconstrained.
"""

import ctypes
from dataclasses import dataclass

import llama_cpp.llama_cpp as lc
import llguidance
import numpy as np

from cbatch.errors import INVALID_REQUEST, CbatchError
from cbatch.ipc.ring import SEVERAL_REQUESTS
from cbatch.workers.engine.sequence import SeqStatus, Sequence

# llama_token_data, field for field (int32 id, float logit, float p; 12 bytes, no padding).
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
NEG_INF = np.float32(-np.inf)


class Candidates:
    """The whole vocabulary as one reusable llama_token_data_array (one per engine: the
    decode loop applies one chain at a time)."""

    def __init__(self, n_vocab: int):
        self.ids = np.arange(n_vocab, dtype=np.int32)
        self.data = np.zeros(n_vocab, TOKEN_DATA)
        self.array = lc.llama_token_data_array(self.data.ctypes.data_as(lc.llama_token_data_p), n_vocab, -1, False)

    def pick(self, chain, logits_row: np.ndarray, banned_ids: np.ndarray | None) -> int | None:
        """The token the chain picks from the row, the banned tokens at -inf, without
        accepting it into the chain; None when no token is left."""
        data = self.data
        data["id"] = self.ids
        data["logit"] = logits_row
        if banned_ids is not None:
            data["logit"][banned_ids] = NEG_INF
        logits = data["logit"]
        if not np.isfinite(logits).any():
            return None
        self.array.size, self.array.selected, self.array.sorted = len(data), -1, False
        lc.llama_sampler_apply(chain, ctypes.byref(self.array))
        selected = self.array.selected
        if not 0 <= selected < self.array.size or not np.isfinite(logits[selected]):
            # A distribution may land on a zero-probability token in rounding: take the best allowed one.
            selected = int(np.argmax(logits[:self.array.size]))
        return int(data["id"][selected])


@dataclass
class Proposal:
    """A constrained row's first pick, to be checked against its matcher."""
    seq: Sequence
    row: int  # in the step's logits
    token: int | None  # None: its chain found no token it may take
    banned_ids: np.ndarray | None  # end-of-generation ids while min_tokens holds them back


def dead_end_error(seq: Sequence) -> CbatchError | None:
    """Why a constrained sequence with nothing left to take ends: None (as `stop`) when its
    constraint is complete, else the error that fails it."""
    matcher = seq.matcher
    if matcher.is_accepting() and not matcher.is_error():
        return None
    if matcher.is_error():
        # llguidance's first line names what failed; the rest is its debugging detail
        reason = f"llguidance: {matcher.get_error().splitlines()[0]}"
    else:
        reason = "every token it allows is banned here"
    return CbatchError(INVALID_REQUEST, f"the constraint allows no next token after {seq.num_output_tokens} tokens "
                                        f"({reason})")


class ConstrainedRows:
    """The check and the masks of one engine's constrained rows, with counts of both."""

    def __init__(self, n_vocab: int, eog_ids: np.ndarray):
        self._n_vocab, self._eog_ids = n_vocab, eog_ids
        self._num_words = (n_vocab + 31) // 32
        self._executor: llguidance.LLExecutor | None = None  # threads, made at the first miss
        self._masks = np.zeros((0, self._num_words), np.int32)
        self._last_missed: list[Sequence] = []  # the rows masked at the last resolve
        self._prefetched: dict[Sequence, np.ndarray] = {}  # their next masks, made while a batch decoded
        self.candidates = Candidates(n_vocab)
        self.num_checked = 0  # constrained tokens checked
        self.num_missed = 0  # of those, the ones the matcher rejected (each cost a mask)
        self.num_prefetched = 0  # constrained tokens picked with a mask made ahead, unchecked

    def resolve(self, proposals: list[Proposal], logits: np.ndarray, mark) -> tuple[list, list]:
        """(sequence, token) for each row that keeps a token, and (sequence, error or None)
        for each dead end. `mark` is told the id of each request whose matcher runs: while
        the masks of several rows are filled at once, SEVERAL_REQUESTS (a crash there names
        no one, and puts every request on probation)."""
        sampled, dead_ends, misses, ahead = [], [], [], []
        prefetched, self._prefetched = self._prefetched, {}
        for proposal in proposals:
            seq = proposal.seq
            mark(seq.request_id)
            if seq in prefetched:
                ahead.append(proposal)
            elif proposal.token is not None and seq.matcher.try_consume_tokens([proposal.token]) == 1:
                self._keep(seq, proposal.token, sampled)
            else:
                misses.append(proposal)
        self.num_checked += len(proposals) - len(ahead)
        self.num_missed += len(misses)
        self.num_prefetched += len(ahead)
        if misses:
            mark(misses[0].seq.request_id if len(misses) == 1 else SEVERAL_REQUESTS)
        masks = self._fill_masks([proposal.seq.matcher for proposal in misses]) if misses else []
        for proposal, mask in [*zip(misses, masks), *((p, prefetched[p.seq]) for p in ahead)]:
            mark(proposal.seq.request_id)
            self._pick_allowed(proposal, logits[proposal.row], mask, sampled, dead_ends)
        self._last_missed = [proposal.seq for proposal in misses + ahead]
        return sampled, dead_ends

    def prefetch_masks(self) -> None:
        """The next masks of the rows masked at the last resolve that still run (see above)."""
        seqs = [seq for seq in self._last_missed
                if seq.status is not SeqStatus.FINISHED and not seq.matcher.is_error() and not seq.matcher.is_stopped()]
        self._last_missed = []
        if seqs:
            self._prefetched = dict(zip(seqs, self._fill_masks([seq.matcher for seq in seqs]).copy()))

    def drop_masks_ahead(self, seqs) -> None:
        """Their matchers consumed a token outside resolve (a forced one): the masks made
        ahead for them are of the state before it."""
        for seq in seqs:
            self._prefetched.pop(seq, None)

    def _fill_masks(self, matchers: list) -> np.ndarray:
        """The matchers' masks, one row each, in a buffer reused by the next call."""
        if len(self._masks) < len(matchers):
            self._masks = np.zeros((len(matchers), self._num_words), np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], self._masks.ctypes.data,
                                               self._num_words * 4, len(self._masks))
        return self._masks[:len(matchers)]

    def _pick_allowed(self, proposal: Proposal, logits_row: np.ndarray, mask: np.ndarray, sampled, dead_ends) -> None:
        seq = proposal.seq
        if seq.matcher.is_error():
            dead_ends.append((seq, dead_end_error(seq)))
            return
        allowed = np.unpackbits(mask.view(np.uint8), count=self._n_vocab, bitorder="little").view(bool)
        masked = np.where(allowed, logits_row, NEG_INF)
        if seq.sampler is None:
            token = int(masked.argmax())
            token = token if masked[token] != NEG_INF else None
        else:
            token = self.candidates.pick(seq.sampler, masked, proposal.banned_ids)
        if token is None or not seq.matcher.consume_token(token):
            dead_ends.append((seq, dead_end_error(seq)))
            return
        self._keep(seq, token, sampled)

    @staticmethod
    def _keep(seq: Sequence, token: int, sampled) -> None:
        if seq.sampler is not None:
            lc.llama_sampler_accept(seq.sampler, token)  # penalty history, the distribution's state
        sampled.append((seq, token))
