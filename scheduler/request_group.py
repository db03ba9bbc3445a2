"""The n samples of one request: one prefills the prompt, the others fork from it and share its KV blocks.

Every sample is a Sequence of its own (own tokens, block table, preemption and ending). Until the prompt is
computed only one of them, the prefiller, runs; the others wait in the group holding nothing. Once the
prefiller's prompt is computed they fork: each shares every full prompt block except the one holding the
prompt's last token (the pool counts references, so a block outlives whichever sample frees it first) and
computes only the rest itself, 1 to block_size tokens. Sharing only blocks that are full and computed
means no shared block is ever written and none has to be copied on the device.
"""

from __future__ import annotations

from scheduler.sequence import Sequence, SequenceStatus


def sample_seq_id(request_id: str, index: int) -> str:
    """Sample 0 is the request's own id, so an n = 1 request is what it always was; the others `id#i`
    (job ids cannot hold '#'; a clash with a live id is refused when the request is added)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class RequestGroup:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.members: list[Sequence] = []  # live samples, by index (the prefiller and the unforked too)
        self.unforked: list[Sequence] = []  # samples waiting for the prompt to be computed, by index

    def shared_prefix(self, seq: Sequence, block_size: int) -> list[int]:
        """The longest run of leading blocks some running sibling has computed that `seq`, holding no
        blocks yet, may share: prompt blocks only, and never the block of its own last token (it must
        compute at least one token to have logits)."""
        limit = min(seq.num_prompt_tokens, seq.num_tokens - 1) // block_size
        best: tuple[int, ...] = ()
        for other in self.members:
            if other is seq or other.status is not SequenceStatus.RUNNING:
                continue
            k = min(limit, other.num_computed_tokens // block_size, len(other.block_table))
            if k > len(best):
                best = other.block_table[:k]
        return list(best)

    def remove(self, seq: Sequence) -> None:
        self.members.remove(seq)
        if seq in self.unforked:
            self.unforked.remove(seq)
