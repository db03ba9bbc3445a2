"""Async scheduling at the scheduler: step N+1 is scheduled after `advance(N)` (placeholders) and before
`commit(N)` (the real tokens). Over random workloads it must produce exactly the tokens and endings of
synchronous `update`, never feed a placeholder it cannot fill, never feed a sequence's last token, and
free every block."""

from __future__ import annotations

import dataclasses

from hypothesis import given

from scheduler.async_scheduler import PLACEHOLDER, AsyncScheduler
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.types import FinishReason
from tests.scheduler.checker import Arrival
from tests.scheduler.factories import fake_token_for, sample_all
from tests.scheduler.test_properties import PROPERTY_SETTINGS, arrivals, configs

MAX_STEPS = 3_000


def without_time_limits(workload: list[Arrival]) -> list[Arrival]:
    """Aborts and deadlines fire at a step count: async steps see tokens one step later, so those endings
    would cut at different tokens. Everything else (arrivals, priorities, aging, preemption) stays."""
    return [
        dataclasses.replace(
            a, request=dataclasses.replace(a.request, deadline=None), abort_step=None, sample_aborts=()
        )
        for a in workload
    ]


def drive(config: SchedulerConfig, workload: list[Arrival], overlapped: bool):
    s = AsyncScheduler(config) if overlapped else Scheduler(config)
    tokens: dict[str, list[int]] = {}
    endings: dict[str, FinishReason] = {}
    in_flight = None  # (pending, the tokens its step sampled)
    last_arrival = max(a.step for a in workload)
    now = 0
    while now <= last_arrival or s.has_unfinished() or in_flight is not None:
        assert now < MAX_STEPS, "no progress"
        for a in workload:
            if a.step == now:
                s.add(a.request)
        output = s.schedule(float(now))
        for finished in output.finished:
            endings[finished.seq_id] = finished.reason
        in_flight_ids = set(in_flight[0].seq_ids) if in_flight is not None else set()
        for chunk in output.chunks:
            seq = s.sequence(chunk.seq_id)
            assert seq is not None
            fed_end = chunk.start_position + len(chunk.token_ids)
            # Never the last token of a sequence: its position would pass what its blocks were sized for.
            assert fed_end <= min(seq.max_num_tokens, config.max_model_len) - 1
            assert all(t != PLACEHOLDER for t in chunk.token_ids[:-1])
            if chunk.token_ids[-1] == PLACEHOLDER:  # filled from the step in flight, which sampled it
                assert overlapped and chunk.sample and chunk.seq_id in in_flight_ids
        sampled = sample_all(output)
        if overlapped:
            pending = s.advance(output)
            new = (pending, [sampled.get(i, PLACEHOLDER) for i in pending.seq_ids])
            updates = s.commit(*in_flight) if in_flight is not None else []
            in_flight = new if output.chunks else None
        else:
            updates = s.update(output, sampled)
        for update in updates:
            tokens.setdefault(update.seq_id, []).append(update.token_id)
            if update.finish is not None:
                endings[update.seq_id] = update.finish
        now += 1
    assert s.kv.pool.num_used == 0
    return tokens, endings


@PROPERTY_SETTINGS
@given(configs(), arrivals())
def test_async_steps_give_the_tokens_and_endings_of_sync_steps(config: SchedulerConfig, workload) -> None:
    workload = without_time_limits(workload)
    sync = drive(config, workload, overlapped=False)
    overlapped = drive(config, workload, overlapped=True)
    assert overlapped == sync
    for seq_id, generated in sync[0].items():  # and they are the fake model's tokens, in order
        assert generated == [fake_token_for(seq_id, k) for k in range(len(generated))]
