"""Which running sequences give way to better-class work: seats and KV blocks for waiting work, and a
step's decode token for a better-class prefill.

Pure choices: these functions pick victims (worst class first, latest arrival first within a class);
the scheduler preempts them. Nothing is preempted unless it lets the better-class work in.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from scheduler.kv_manager import KVCacheManager
from scheduler.sequence import Sequence
from scheduler.types import Priority
from scheduler.waiting_queue import WaitingQueue


def seat_victims(running: Seq[Sequence], waiting: WaitingQueue, max_num_seqs: int) -> list[Sequence]:
    """When the running set is full, enough worst-class sequences to seat every better-class waiter."""
    if len(running) < max_num_seqs or not waiting.num_better_than(max(Priority)):
        return []  # seats left, or nothing waits that is better than even the worst class
    free_seats = max_num_seqs - len(running)
    victims: list[Sequence] = []
    for victim in sorted(running, key=Sequence.sort_key, reverse=True):
        # A victim's own class is never "better than" the next (no better) victim's, so counting the
        # waiting queue once is exact.
        if waiting.num_better_than(victim.queue_class) <= free_seats + len(victims):
            break
        victims.append(victim)
    return victims


def block_victims(
    head: Sequence,
    cached: list[int],
    running: Seq[Sequence],
    kv: KVCacheManager,
    max_num_batched_tokens: int,
) -> list[Sequence]:
    """Worse-class running sequences whose blocks, freed, let the head of the waiting queue in.

    The head needs blocks for its first chunk (after `cached`, the blocks it would share) plus what the
    running sequences of its own class or better take this step, since they are scheduled before it.
    Victims are taken worst first until that fits; if freeing every worse-class sequence would still not
    make room, none is taken (preempting them would only waste their work).
    """
    worse = sorted(
        (s for s in running if s.queue_class > head.queue_class), key=Sequence.sort_key, reverse=True
    )
    if not worse:
        return []
    first_chunk = min(head.num_tokens - len(cached) * kv.block_size, max_num_batched_tokens)
    need = kv.blocks_needed(head, first_chunk, cached)
    for seq in running:
        if seq.queue_class <= head.queue_class:
            next_chunk = min(seq.num_uncomputed_tokens, max_num_batched_tokens)
            need += kv.blocks_needed(seq, next_chunk)
    free = kv.pool.num_free
    victims: list[Sequence] = []
    for victim in worse:
        if free >= need:
            break
        victims.append(victim)
        free += kv.exclusive_blocks(victim)
    return victims if victims and free >= need else []


def lora_victims(head: Sequence, running: Seq[Sequence]) -> list[Sequence]:
    """The head waits for a LoRA adapter slot: the running sequences of the adapter with the fewest of
    them, if every one is of a worse class than the head (preempting them frees the slot); else none."""
    by_adapter: dict[str, list[Sequence]] = {}
    for seq in running:
        if seq.lora is not None:
            by_adapter.setdefault(seq.lora, []).append(seq)
    worse = [seqs for seqs in by_adapter.values() if all(s.queue_class > head.queue_class for s in seqs)]
    return min(worse, key=len, default=[])


def decodes_deferred_after(waiting_head: Sequence | None, running: Seq[Sequence]) -> Priority | None:
    """The best class with a prompt to prefill (the waiting head, or a running prefill) when it is better
    than some running decode's class: decodes worse than it may sit out one step. None otherwise."""
    best_prefill = waiting_head.queue_class if waiting_head is not None else None
    worst_decode = None
    for s in running:  # one pass without per-sequence lists: this runs every step
        if len(s.token_ids) - s.num_computed_tokens == 1:
            if worst_decode is None or s.queue_class > worst_decode:
                worst_decode = s.queue_class
        elif best_prefill is None or s.queue_class < best_prefill:
            best_prefill = s.queue_class
    if best_prefill is None or worst_decode is None:
        return None
    return best_prefill if best_prefill < worst_decode else None
