"""The pure parts of the reliability work: error classes, backoff, the decompression bound, recent cancels."""

from __future__ import annotations

import gzip

import pytest
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, NodeNotReadyError
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, StatementError

from schemas.job_key import JobKey
from workers.kafka_io.codec import DecompressedTooLarge, _bounded_gzip_decode
from workers.serving.admission import cancels
from workers.serving.errors import Backoff, is_transient


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (OperationalError("SELECT 1", {}, Exception("server closed the connection")), True),
        (KafkaTimeoutError(), True),
        (NodeNotReadyError(), True),
        (ConnectionRefusedError(), True),
        (DataError("INSERT", {}, Exception("invalid byte sequence")), False),
        (IntegrityError("INSERT", {}, Exception("duplicate key")), False),
        (StatementError("NUL", "INSERT", {}, ValueError("A string literal cannot contain NUL")), False),
        (MessageSizeTooLargeError(), False),
        (ValueError("a bug"), False),
    ],
)
def test_transient_or_not(exc, transient):
    assert is_transient(exc) is transient


def test_backoff_grows_to_its_cap_with_jitter_and_resets():
    backoff = Backoff(base_s=0.1, cap_s=2.0)
    delays = [backoff.next_delay() for _ in range(10)]
    assert 0.05 <= delays[0] <= 0.1
    assert all(1.0 <= d <= 2.0 for d in delays[5:])
    backoff.reset()
    assert backoff.next_delay() <= 0.1


def test_gzip_is_inflated_only_up_to_the_bound():
    text = b"abc" * 1_000_000
    assert _bounded_gzip_decode(10 * 2**20)(gzip.compress(text)) == text
    with pytest.raises(DecompressedTooLarge):
        _bounded_gzip_decode(2**20)(gzip.compress(text))


def test_recent_cancels_are_per_tenant_and_expire(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(cancels.time, "monotonic", lambda: now[0])
    recent = cancels.RecentCancels()
    recent.add(JobKey("acme", "job"))
    assert JobKey("acme", "job") in recent and JobKey("other", "job") not in recent
    now[0] += cancels.REMEMBER_S + 1
    assert JobKey("acme", "job") not in recent
