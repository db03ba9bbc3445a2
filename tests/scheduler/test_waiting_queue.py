import gc
import math
import weakref

from scheduler.fairness import TenantLedger
from scheduler.sequence import Sequence
from scheduler.types import Priority
from scheduler.waiting_queue import WaitingQueue
from tests.scheduler.factories import make_request

_order = iter(range(1_000_000))


def make_seq(seq_id, priority=Priority.NORMAL, tenant="t", arrival=0.0):
    return Sequence(make_request(seq_id, priority=priority, tenant=tenant, arrival=arrival), next(_order))


def make_queue(aging_s=math.inf):
    ledger = TenantLedger()
    return WaitingQueue(ledger, aging_s), ledger


def add(queue, ledger, seq):
    ledger.join(seq.tenant)
    queue.add(seq)
    return seq


def drain(queue):
    order = []
    while (seq := queue.pop()) is not None:
        order.append(seq.seq_id)
    return order


def test_classes_are_served_best_first_then_by_arrival():
    queue, ledger = make_queue()
    add(queue, ledger, make_seq("low", Priority.LOW, arrival=0))
    add(queue, ledger, make_seq("n2", Priority.NORMAL, arrival=2))
    add(queue, ledger, make_seq("high", Priority.HIGH, arrival=3))
    add(queue, ledger, make_seq("n1", Priority.NORMAL, arrival=1))
    assert queue.counts() == {Priority.HIGH: 1, Priority.NORMAL: 2, Priority.LOW: 1}
    assert drain(queue) == ["high", "n1", "n2", "low"]


def test_preempted_sequence_returns_to_the_front_of_its_class():
    queue, ledger = make_queue()
    early = add(queue, ledger, make_seq("early", arrival=0))
    add(queue, ledger, make_seq("later", arrival=1))
    add(queue, ledger, make_seq("high", Priority.HIGH, arrival=5))
    preempted = make_seq("preempted", arrival=3)
    ledger.join("t")
    queue.push_front(preempted, now=10)
    assert drain(queue) == ["high", "preempted", "early", "later"]
    assert early.queue_class is Priority.NORMAL


def test_tenant_served_least_goes_first():
    queue, ledger = make_queue()
    for i in range(3):
        add(queue, ledger, make_seq(f"a{i}", tenant="a", arrival=i))
    add(queue, ledger, make_seq("b0", tenant="b", arrival=10))
    ledger.charge("a", 100)
    assert queue.peek().seq_id == "b0"
    ledger.charge("b", 150)
    assert queue.peek().seq_id == "a0"


def test_new_tenant_starts_at_the_current_minimum_and_cannot_bank_credit():
    ledger = TenantLedger()
    ledger.join("a")
    ledger.join("b")
    ledger.charge("a", 500)
    ledger.charge("b", 300)
    ledger.join("c")
    assert ledger.served("c") == 300
    ledger.leave("c")
    ledger.charge("a", 1000)
    ledger.charge("b", 1000)
    ledger.join("c")  # idle while others were served: starts at their minimum, not at its old 300
    assert ledger.served("c") == 1300


def test_flooding_tenant_alternates_with_a_small_one_when_charged_per_pop():
    queue, ledger = make_queue()
    for i in range(50):
        add(queue, ledger, make_seq(f"a{i}", tenant="a", arrival=i))
    for i in range(5):
        add(queue, ledger, make_seq(f"b{i}", tenant="b", arrival=100 + i))
    served = []
    for _ in range(10):
        seq = queue.pop()
        ledger.charge(seq.tenant, 10)
        served.append(seq.tenant)
    assert served.count("b") == 5 and served.count("a") == 5


def test_aging_promotes_one_class_per_period():
    queue, ledger = make_queue(aging_s=10)
    low = add(queue, ledger, make_seq("low", Priority.LOW, arrival=0))
    add(queue, ledger, make_seq("normal", Priority.NORMAL, arrival=5))
    assert queue.promote_aged(now=9.9) == []
    assert [s.seq_id for s in queue.promote_aged(now=10)] == ["low"]
    assert low.queue_class is Priority.NORMAL
    assert queue.peek().seq_id == "low"  # older arrival inside NORMAL now
    queue.promote_aged(now=14.9)
    assert low.queue_class is Priority.NORMAL
    queue.promote_aged(now=20)
    assert low.queue_class is Priority.HIGH
    assert queue.counts() == {Priority.HIGH: 2, Priority.NORMAL: 0, Priority.LOW: 0}


def test_aging_several_periods_at_once_promotes_several_classes():
    queue, ledger = make_queue(aging_s=10)
    low = add(queue, ledger, make_seq("low", Priority.LOW, arrival=0))
    queue.promote_aged(now=100)
    assert low.queue_class is Priority.HIGH


def test_remove_skips_the_sequence_everywhere():
    queue, ledger = make_queue(aging_s=10)
    gone = add(queue, ledger, make_seq("gone", Priority.LOW, arrival=0))
    add(queue, ledger, make_seq("kept", Priority.LOW, arrival=1))
    queue.remove(gone)
    assert gone not in queue and len(queue) == 1
    assert queue.promote_aged(now=100)[0].seq_id == "kept"
    assert drain(queue) == ["kept"]


def test_num_better_than_counts_strictly_better_classes():
    queue, ledger = make_queue()
    add(queue, ledger, make_seq("h", Priority.HIGH))
    add(queue, ledger, make_seq("n", Priority.NORMAL))
    assert queue.num_better_than(Priority.LOW) == 2
    assert queue.num_better_than(Priority.NORMAL) == 1
    assert queue.num_better_than(Priority.HIGH) == 0


def test_the_ledger_forgets_idle_tenants_and_stays_bounded():
    ledger = TenantLedger(max_idle=100)
    ledger.join("steady")
    ledger.charge("steady", 50)
    for i in range(10_000):  # a stream of one-off tenants, each served a little
        ledger.join(f"t{i}")
        ledger.charge(f"t{i}", i % 7)
        ledger.leave(f"t{i}")
    assert ledger.tracked() <= 1 + 100
    assert ledger.served("steady") == 50 and ledger.is_live("steady")


def test_a_forgotten_tenant_rejoins_where_it_would_have_anyway():
    ledger = TenantLedger()
    ledger.join("a")
    ledger.charge("a", 10)
    ledger.join("b")  # starts at the live floor: 10
    ledger.leave("b")  # served no more than the floor: nothing to remember
    assert ledger.tracked() == 1
    ledger.charge("a", 5)
    ledger.join("b")
    assert ledger.served("b") == 15  # the floor, as if remembered
    ledger.charge("b", 30)
    ledger.leave("b")  # served more than the floor: remembered, so it cannot bank a fresh start
    ledger.charge("a", 5)
    ledger.join("b")
    assert ledger.served("b") == 45


def test_sequences_that_left_the_queue_are_not_kept_alive_until_their_aging_is_due():
    """The aging heap is due only aging_s after an insertion: left alone, its stale entries would keep
    every sequence served in the last aging_s alive (30 s of finished requests, for the collector to walk)."""
    queue, ledger = make_queue(aging_s=30)
    kept = add(queue, ledger, make_seq("kept", Priority.LOW, arrival=0))
    served = []
    for i in range(1000):
        add(queue, ledger, make_seq(f"s{i}", Priority.NORMAL, arrival=1 + i))
        seq = queue.pop()
        served.append(weakref.ref(seq))
        del seq
    gc.collect()
    assert sum(ref() is not None for ref in served) <= 2 * len(queue) + 64
    assert [s.seq_id for s in queue.promote_aged(now=30)] == ["kept"]  # live entries survive compaction
    assert kept.queue_class is Priority.NORMAL and drain(queue) == ["kept"]
