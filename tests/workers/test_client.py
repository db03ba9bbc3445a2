"""The producer client: confirmed delivery, one consumer for many streams, the PostgreSQL fallback for
results, bounded waits, and a light import."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import create_engine

from schemas.jobs import TokenEvent, Usage
from tests.services.factories import make_private_services
from tests.workers.worker_factories import make_deployment, now_ms, start_worker, wait_terminal
from workers.client import DeliveryFailed, JobClient, JobTimeout, Submitted
from workers.client.stream_hub import CaughtUp
from workers.kafka_io import Producer


def test_importing_the_client_loads_neither_torch_nor_celery():
    heavy = "('torch', 'celery', 'transformers')"
    code = f"import sys, workers.client; print(sorted(m for m in {heavy} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def serving(settings, tmp_path_factory):
    dep = make_deployment(settings)
    worker = start_worker(dep, tmp_path_factory.mktemp("worker"), "w-client")
    db = create_engine(dep.database_url)
    try:
        yield dep, db
    finally:
        db.dispose()
        assert worker.stop() == 0, worker.output()[-3000:]


@pytest.mark.services
@pytest.mark.slow
def test_one_consumer_serves_many_streams_and_waits(serving):
    dep, db = serving
    with JobClient(dep) as client:
        sent = client.submit_many(
            [
                {"job_id": f"many-{dep.topic_prefix}-{i}", "prompt": f"job {i}", "max_tokens": 4 + i}
                for i in range(6)
            ]
        )
        assert all(isinstance(s, Submitted) and s.offset >= 0 and s.priority == "normal" for s in sent)
        assert {s.topic for s in sent} == {dep.topics.jobs("normal")}
        texts: dict[str, str] = {}

        def follow(s: Submitted) -> None:
            texts[s.job_id] = "".join(e.text for e in client.stream(s, timeout_s=120))

        threads = [threading.Thread(target=follow, args=(s,)) for s in sent[:3]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in sent[3:]:  # their events went by while the first three streamed: read again from the time
            texts[s.job_id] = "".join(e.text for e in client.stream(s, timeout_s=120))
        results = {s.job_id: client.wait(s, timeout_s=60) for s in sent}
        hubs = [t for t in threading.enumerate() if t.name == "inferq-stream-hub"]
        assert len(hubs) == 1  # every stream and wait above went through the same consumer
    rows = wait_terminal(db, [s.job_id for s in sent])
    for s in sent:
        assert texts[s.job_id] == results[s.job_id].output_text == rows[s.job_id]["output_text"]
        assert results[s.job_id].status == "succeeded"


@pytest.mark.services
@pytest.mark.slow
def test_wait_falls_back_to_the_row_when_the_topic_has_no_result(serving):
    dep, db = serving
    with JobClient(dep) as client:
        job_id = client.submit(
            {"job_id": f"old-{dep.topic_prefix}", "tenant": "acme", "prompt": "x", "max_tokens": 3}
        ).job_id
        published = client.wait(job_id, timeout_s=120)
    later = now_ms() + 2000  # after the result was published: the topic holds nothing for it from here
    with JobClient(dep, database_url=dep.database_url) as client:
        assert client.wait(job_id, since_ms=later, tenant="acme", timeout_s=60) == published
        with pytest.raises(JobTimeout):  # another tenant's wait never reads acme's row
            client.wait(job_id, since_ms=later, tenant="intruder", timeout_s=3)
    with JobClient(dep) as client, pytest.raises(JobTimeout):  # no database: nothing to fall back on
        client.wait(job_id, since_ms=later, tenant="acme", timeout_s=3)


@pytest.mark.services
@pytest.mark.slow
@pytest.mark.timeout(300)  # a call that hung instead of raising fails here
def test_submit_raises_when_the_broker_is_gone(tmp_path):
    private = make_private_services(tmp_path / "state")
    try:
        private.cli("up")
        settings = private.settings
        client = JobClient(settings, timeout_s=5)
        sent = client.submit({"job_id": "before-the-outage", "prompt": "hi"}, "high")
        assert (sent.topic, sent.offset) == (settings.topics.jobs("high"), 0)
        private.cli("down")
        with pytest.raises(DeliveryFailed) as failed:
            client.submit({"job_id": "during-the-outage", "prompt": "hi"})
        assert failed.value.job_id == "during-the-outage" and failed.value.delivered == ()
        with pytest.raises(DeliveryFailed):
            client.cancel("before-the-outage")
        with pytest.raises(Exception):  # noqa: B017 - JobTimeout, or the client's error: never a hang
            client.wait(sent, timeout_s=3)
        client.close()  # bounded by timeout_s too
    finally:
        private.cli("down", "--purge", check=False)


@pytest.mark.services
def test_stream_skips_copies_and_the_events_of_an_attempt_a_later_one_replaced(settings):
    """Attempt 1 ran on a worker that lost the job; attempt 2 redoes it. A late event of attempt 1 and
    copies of events already seen (producer retries) are not yielded, nor do they end the stream."""
    dep = make_deployment(settings)
    job_id, since = f"dedupe-{dep.topic_prefix}", now_ms()
    sent = [(1, 0, None), (1, 1, None), (1, 1, None), (2, 0, None), (1, 2, "abort"), (2, 0, None),
            (2, 1, None), (1, 3, None), (2, 2, "stop")]  # fmt: skip
    producer = Producer(dep.kafka_connection, "inferq-test-dedupe")
    for attempt, seq, finish in sent:
        usage = Usage(prompt_tokens=1, completion_tokens=seq) if finish else None  # the attempt's last
        event = TokenEvent(job_id=job_id, attempt=attempt, seq=seq, text=f"{attempt}.{seq} ",
                           token_ids=[seq], finish_reason=finish, usage=usage)  # fmt: skip
        producer.send(dep.topics.tokens, job_id, event.model_dump_json().encode())
    producer.flush(30)
    producer.close()
    with JobClient(dep) as client:
        got = [(e.attempt, e.seq) for e in client.stream(job_id, timeout_s=60, since_ms=since)]
    assert got == [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]


def _post_events(dep, job_id: str, events: list[tuple[int, int, str | None]]) -> None:
    """Token events of `job_id` written in this order: (attempt, seq, finish_reason); one with a finish
    reason ends its attempt."""
    producer = Producer(dep.kafka_connection, "inferq-test-events")
    for attempt, seq, finish in events:
        usage = Usage(prompt_tokens=1, completion_tokens=seq) if finish else None
        event = TokenEvent(job_id=job_id, attempt=attempt, seq=seq, text=f"{attempt}.{seq} ",
                           token_ids=[seq], finish_reason=finish, usage=usage)  # fmt: skip
        producer.send(dep.topics.tokens, job_id, event.model_dump_json().encode()).wait(30)
    producer.close()


@pytest.mark.services
def test_stream_yields_an_attempt_in_seq_order_whatever_the_partition_order(settings):
    """A retried send can land after the event that followed it: the stream still yields 0, 1, 2, 3."""
    dep = make_deployment(settings)
    job_id, since = f"order-{dep.topic_prefix}", now_ms()
    _post_events(dep, job_id, [(1, 1, None), (1, 0, None), (1, 3, "stop"), (1, 2, None)])
    with JobClient(dep) as client:
        got = [e.seq for e in client.stream(job_id, timeout_s=60, since_ms=since)]
    assert got == [0, 1, 2, 3]


@pytest.mark.services
def test_a_hole_the_topic_cannot_fill_is_stepped_over_once_read_again(settings):
    """Events before `since_ms` (or gone with retention) never come: once the partition has been read
    again to its end, the stream goes on after the hole instead of waiting for its timeout."""
    dep = make_deployment(settings)
    job_id, since = f"hole-{dep.topic_prefix}", now_ms()
    _post_events(dep, job_id, [(1, 1, None), (1, 2, "stop")])
    with JobClient(dep) as client:
        started = time.monotonic()
        got = [e.seq for e in client.stream(job_id, timeout_s=60, since_ms=since)]
        assert time.monotonic() - started < 30
    assert got == [1, 2]


@pytest.mark.services
def test_a_rewound_follower_gets_its_records_again_then_caught_up(settings):
    dep = make_deployment(settings)
    job_id, since = f"rewind-{dep.topic_prefix}", now_ms()
    _post_events(dep, job_id, [(1, 0, None), (1, 1, "stop")])
    with JobClient(dep) as client:
        follower = client._follow(job_id, (dep.topics.tokens,), since)
        try:

            def read_until_caught_up(placement: int) -> list[int]:
                seqs, deadline = [], time.monotonic() + 60
                while time.monotonic() < deadline:
                    item = follower.get(1.0)
                    if isinstance(item, CaughtUp) and item.placement == placement:
                        return seqs
                    if item is not None and not isinstance(item, CaughtUp):
                        seqs.append(TokenEvent.model_validate_json(item.value).seq)
                raise AssertionError(f"not caught up; got {seqs}")

            assert read_until_caught_up(0) == [0, 1]
            assert follower.rewind() == 1
            assert read_until_caught_up(1) == [0, 1]
        finally:
            client._unfollow(follower)


@pytest.mark.services
def test_followers_placed_together_share_their_look_ups_and_get_only_their_own_records(settings):
    """The HTTP API follows every job it waits for through one hub: 300 follows that arrive together are
    placed with a few offset look-ups (not two per follower), and each gets its own record and no other."""
    from workers.client.stream_hub import StreamHub
    from workers.kafka_io import PartitionReader

    dep = make_deployment(settings)
    since = now_ms() - 1000
    keys = [f"many-{dep.topic_prefix}-{i}" for i in range(300)]
    producer = Producer(dep.kafka_connection, "inferq-test-many")
    for key in keys:
        producer.send(dep.topics.results, key, key.encode()).wait(30)
    producer.close()
    lookups = []

    class Counting(PartitionReader):
        def offsets_at(self, since_by_partition):
            lookups.append(len(since_by_partition))
            return super().offsets_at(since_by_partition)

    queued = threading.Event()

    def open_reader() -> Counting:
        # the hub opens its reader at the first follow: it waits here until all 300 are queued, so they
        # arrive together however the two threads are scheduled (on a loaded machine the hub thread could
        # otherwise take them a few at a time, which is not what this test is about)
        assert queued.wait(60)
        return Counting(dep.kafka_connection, "inferq-test-many", 10, 0.025)

    hub = StreamHub(open_reader, {dep.topics.results: dep.stream_partitions})
    got: dict[str, list] = {key: [] for key in keys}
    done = threading.Event()
    caught_up: set[str] = set()

    def sink_of(key: str):
        def sink(item) -> None:  # on the hub's thread
            if isinstance(item, CaughtUp):
                caught_up.add(key)
                if len(caught_up) == len(keys):
                    done.set()
            else:
                got[key].append(item.value)

        return sink

    try:
        followers = [hub.follow(key, (dep.topics.results,), since, sink_of(key)) for key in keys]
        queued.set()
        assert done.wait(120), f"{len(keys) - len(caught_up)} never caught up"
        assert got == {key: [key.encode()] for key in keys}
        assert len(lookups) < len(keys) // 10  # placed in a few rounds, each one look-up for its partitions
        for f in followers:
            hub.unfollow(f)
    finally:
        hub.close()


@pytest.mark.services
def test_a_follower_placed_later_reads_again_without_handing_earlier_ones_their_records_twice(settings):
    """A follow placed after others, from an earlier time, moves the partitions back (its records are behind
    the reader): the followers already there must not get their records a second time."""
    from workers.client.stream_hub import StreamHub
    from workers.kafka_io import PartitionReader

    dep = make_deployment(settings)
    since = now_ms() - 1000
    keys = [f"again-{dep.topic_prefix}-{i}" for i in range(40)]
    producer = Producer(dep.kafka_connection, "inferq-test-again")
    for key in keys:
        producer.send(dep.topics.results, key, key.encode()).wait(30)
    producer.close()
    hub = StreamHub(lambda: PartitionReader(dep.kafka_connection, "inferq-test-again", 10, 0.025),
                    {dep.topics.results: dep.stream_partitions})  # fmt: skip
    got: dict[str, list] = {key: [] for key in keys}
    caught_up: dict[str, threading.Event] = {key: threading.Event() for key in keys}

    def sink_of(key: str):
        def sink(item) -> None:  # on the hub's thread
            if isinstance(item, CaughtUp):
                caught_up[key].set()
            else:
                got[key].append(item.value)

        return sink

    try:
        first, later = keys[:20], keys[20:]
        followers = [hub.follow(key, (dep.topics.results,), since, sink_of(key)) for key in first]
        assert all(caught_up[key].wait(60) for key in first)
        followers += [hub.follow(key, (dep.topics.results,), since, sink_of(key)) for key in later]
        assert all(caught_up[key].wait(60) for key in later)
        time.sleep(0.5)  # anything read again after the later ones caught up would have come by now
        assert got == {key: [key.encode()] for key in keys}
        for f in followers:
            hub.unfollow(f)
    finally:
        hub.close()
