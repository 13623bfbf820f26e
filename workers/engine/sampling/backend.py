"""Sampling inside llama.cpp's graph (backend sampling): only token ids come back.

A sampler chain attached to a KV sequence id runs as part of llama_decode's graph on the
device that holds the output layer, so the step brings back one token id per sequence
instead of a full row of logits (262k floats for gemma), and the host runs no argmax and
no chain. llama.cpp copies the raw logits of a ubatch only while one of its outputs
belongs to a sequence without a chain, so a request that needs the host chain still gets
its row when it shares a step with backend-sampled ones.

Only chains made entirely of samplers llama.cpp can run in the graph are attached:
greedy, temperature, top-k, top-p, min-p, the seeded distribution and the logit bias that
ignore_eos uses (sampling.needs_host_sampling names the rest). The context is made with
one output per sequence per step (n_outputs_max_per_seq = 1), so a chain's random draw
happens when the graph runs and reading the sampled token is all the host does: there is
nothing to accept.
"""

import ctypes

import llama_cpp.llama_cpp as lc

from cbatch.workers.engine.sched.step_batch import BatchSpan


def _address(chain) -> int:
    return ctypes.cast(chain, ctypes.c_void_p).value


def make_greedy_chain():
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
    return chain


class BackendSamplers:
    """Which chain is attached to each KV sequence id of one context.

    Invariants: a chain is attached to at most one id, and at most once in its life
    (llama.cpp prepares a chain for the graph when it is attached and cannot do so twice),
    so a sequence whose chain was attached before (preempted, then re-admitted under
    another id or under the same one, which another request's chain took meanwhile) gets
    a clone that carries its state. Every change makes llama.cpp re-plan its
    graph at the next decode, so greedy, which has no state, uses one chain per id, owned
    here, that stays attached while requests on that id come and go.
    """

    def __init__(self, ctx):
        self._ctx = ctx
        self._chain_of_id: dict[int, object] = {}
        self._id_of_chain: dict[int, int] = {}  # chain address -> seq id
        self._greedy_ids: set[int] = set()  # ids whose attached chain is an owned greedy one
        self._ever_attached: set[int] = set()  # addresses of the live chains attached once, now or before

    def prepare(self, spans: list[BatchSpan]) -> None:
        """Before a decode: each sequence with an output row gets the chain it samples
        with (its own, or greedy) attached to its id, or none if it needs the host chain."""
        for span in spans:
            seq = span.seq
            if not span.wants_logits:
                continue
            if not seq.is_backend_sampled:
                self._detach(seq.seq_id)
            elif seq.sampler is None:
                if seq.seq_id not in self._greedy_ids:
                    self._attach(seq.seq_id, make_greedy_chain())
                    self._greedy_ids.add(seq.seq_id)
            elif self._chain_of_id.get(seq.seq_id) is not seq.sampler:  # the common case, attached, costs no cast
                if _address(seq.sampler) in self._ever_attached:  # to another id, or detached since
                    old = seq.sampler
                    self.release(old)
                    seq.sampler = lc.llama_sampler_clone(old)
                    lc.llama_sampler_free(old)
                self._attach(seq.seq_id, seq.sampler)

    def sampled_tokens(self, batch_indices: list[int]) -> list[int]:
        """One C call per row (llama.cpp returns one id at a time), in one comprehension."""
        get, ctx = lc.llama_get_sampled_token_ith, self._ctx
        return [get(ctx, batch_index) for batch_index in batch_indices]

    def release(self, chain) -> None:
        """Detach a request's own chain (before it is freed); a no-op if not attached."""
        if chain is None:
            return
        seq_id = self._id_of_chain.get(_address(chain))
        if seq_id is not None:
            self._detach(seq_id)
        self._ever_attached.discard(_address(chain))  # a chain made later may get the same address

    def close(self) -> None:
        """Detach everything and free the owned greedy chains."""
        for seq_id in list(self._chain_of_id):
            self._detach(seq_id)

    def _attach(self, seq_id: int, chain) -> None:
        self._detach(seq_id)
        if not lc.llama_set_sampler(self._ctx, seq_id, chain):
            raise RuntimeError(f"llama.cpp could not attach a sampler chain to sequence {seq_id}")
        self._chain_of_id[seq_id] = chain
        self._id_of_chain[_address(chain)] = seq_id
        self._ever_attached.add(_address(chain))

    def _detach(self, seq_id: int) -> None:
        chain = self._chain_of_id.pop(seq_id, None)
        if chain is None:
            return
        lc.llama_set_sampler(self._ctx, seq_id, None)
        del self._id_of_chain[_address(chain)]
        if seq_id in self._greedy_ids:
            self._greedy_ids.discard(seq_id)
            self._ever_attached.discard(_address(chain))
            lc.llama_sampler_free(chain)
