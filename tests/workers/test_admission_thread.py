"""The engine loop can wait, briefly, for a high-priority record's admission decision."""

from __future__ import annotations

import threading

import pytest

from schemas.job_key import JobKey
from workers.db.jobs import Admitted
from workers.kafka_io.records import Record
from workers.serving.admission.admitter import Decision
from workers.serving.admission.thread import AdmissionThread


class GatedAdmitter:
    """Decides every pending record once `gate` is set (as a database round trip would, later)."""

    blocked = False

    def __init__(self) -> None:
        self.gate = threading.Event()
        self._pending: list = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, accepted) -> None:
        self._pending += accepted

    def drop(self, partitions) -> None:
        self._pending = [a for a in self._pending if a.record.source not in partitions]

    def run(self, is_held):
        if not self.gate.is_set():
            return [], []
        decided, self._pending = self._pending, []
        return [Decision(a, Admitted("held") if is_held(a) else Admitted("start", 1)) for a in decided], []


class FakeAccepted:
    def __init__(self, priority: str, offset: int, job_id: str = "j", tenant: str = "t") -> None:
        self.priority = priority
        self.job_id = job_id
        self.tenant = tenant
        self.record = Record(f"inferq.jobs.{priority}", 0, offset, None, b"{}", 0)
        self.key = JobKey(tenant, job_id)


@pytest.fixture
def admission():
    """A running admission thread over a gated admitter; the gate opens and the thread stops at the end."""
    admitter = GatedAdmitter()
    thread = AdmissionThread(admitter, lambda a: False, threading.Event(), tick_s=0.01)
    thread.start()
    yield thread, admitter
    admitter.gate.set()
    thread.close()


def test_nothing_urgent_means_no_wait(admission):
    thread, _ = admission
    thread.add([FakeAccepted("low", 1), FakeAccepted("normal", 2)])
    assert thread.wait_urgent(0.0)  # low and normal records are never waited for


def test_waits_for_a_high_priority_decision_and_times_out_without_one(admission):
    thread, admitter = admission
    thread.add([FakeAccepted("high", 7)])
    assert not thread.wait_urgent(0.05)  # undecided: the loop steps on after the timeout
    threading.Timer(0.05, admitter.gate.set).start()
    assert thread.wait_urgent(5.0)
    decisions, _ = thread.results()
    assert [d.accepted.record.offset for d in decisions] == [7]
    assert len(thread) == 0


def test_a_decided_record_counts_as_held_until_the_loop_takes_its_decision(admission):
    """Between its decision and the loop taking it, a record is in neither the engine nor admission: it
    must still count against the caps, or intake overfills the worker while decisions wait."""
    thread, admitter = admission
    admitter.gate.set()
    thread.add([FakeAccepted("high", 5)])
    assert thread.wait_urgent(5.0)  # decided
    assert len(thread) == 1
    assert len(thread.results()[0]) == 1
    assert len(thread) == 0


def test_a_revoked_partition_releases_the_wait(admission):
    thread, _ = admission
    thread.add([FakeAccepted("high", 3)])
    thread.drop({("inferq.jobs.high", 0)})
    assert thread.wait_urgent(5.0)


def _decide(thread: AdmissionThread, admitter: GatedAdmitter, a: FakeAccepted) -> Decision:
    admitter.gate.set()
    thread.add([a])
    assert thread.wait_urgent(5.0)
    [decision] = thread.results()[0]
    return decision


def test_a_copy_of_a_job_whose_start_is_not_settled_yet_is_held(admission):
    """The loop has not acted on the first copy's start yet: a second copy must not be admitted (that
    would re-queue the job as a second attempt and fence out the run the first copy starts)."""
    thread, admitter = admission
    first = _decide(thread, admitter, FakeAccepted("high", 1, "dup"))
    assert first.outcome.kind == "start"
    assert _decide(thread, admitter, FakeAccepted("high", 2, "dup")).outcome.kind == "held"
    assert _decide(thread, admitter, FakeAccepted("high", 3, "dup", "other")).outcome.kind == "start"
    thread.settled([first])  # from now on the loop says whether it holds the job (here: it does not)
    assert _decide(thread, admitter, FakeAccepted("high", 4, "dup")).outcome.kind == "start"
