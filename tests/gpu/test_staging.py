"""gpu/cuda/staging.py's rotation, on the CPU with a fake event: a pinned buffer is rewritten only after
the event recorded when its last step was enqueued has been waited on, whatever the steps read back."""

from __future__ import annotations

import torch

from gpu.cuda.staging import PinnedStaging


class FakeEvent:
    def __init__(self, log: list[tuple[str, int]], number: int) -> None:
        self.log, self.id = log, number
        self.pending = False  # recorded, not yet waited on: copies from its slot may still be queued

    def record(self) -> None:
        self.pending = True
        self.log.append(("record", self.id))

    def synchronize(self) -> None:
        self.pending = False
        self.log.append(("wait", self.id))


def make(depth: int = 2) -> tuple[PinnedStaging, list[tuple[str, int]], list[FakeEvent]]:
    log: list[tuple[str, int]] = []
    events: list[FakeEvent] = []

    def factory() -> FakeEvent:
        event = FakeEvent(log, len(events))
        events.append(event)
        return event

    return PinnedStaging(torch.device("cpu"), depth=depth, event_factory=factory), log, events


def test_consecutive_steps_use_different_buffers_and_a_slot_is_reused_after_its_event():
    staging, log, events = make()
    seen = []
    for step in range(5):
        staging.begin_step()
        slot = staging._slot
        # a step may only write a buffer no queued copy still reads
        assert not events[slot].pending, f"step {step} writes slot {slot} before its last copies ran"
        buffer = staging.buffer("ids", (3,), torch.long)
        buffer.fill_(step)
        seen.append(buffer.data_ptr())
        staging.end_step()
    assert seen[0] != seen[1] and seen[0] == seen[2] == seen[4] and seen[1] == seen[3]
    # the first use of each slot waits for nothing; every later one waits for that slot's record first
    assert log == [
        ("record", 1),
        ("record", 0),
        ("wait", 1),
        ("record", 1),
        ("wait", 0),
        ("record", 0),
        ("wait", 1),
        ("record", 1),
    ]


def test_a_step_that_reads_nothing_back_cannot_overwrite_the_previous_steps_inputs():
    staging, _, events = make()
    staging.begin_step()
    first = staging.to_device("ids", torch.tensor([1, 2, 3]))
    staging.end_step()  # nothing read back, no synchronisation by the caller
    staging.begin_step()
    staging.to_device("ids", torch.tensor([7, 8, 9]))
    staging.end_step()
    assert staging._slots[0] is not staging._slots[1]
    assert all(b.data_ptr() != first.data_ptr() for b in staging._buffers.values())
    assert events[0].pending and events[1].pending


def test_without_cuda_there_are_no_events():
    staging = PinnedStaging(torch.device("cpu"))
    for _ in range(3):
        staging.begin_step()
        assert staging.to_device("x", torch.arange(4)).tolist() == [0, 1, 2, 3]
        staging.end_step()
    assert staging._events == [None, None]
