"""Fixtures of the worker tests that use the real services."""

from __future__ import annotations

import pytest

from tests.workers.worker_factories import make_deployment
from workers.db.connect import make_engine
from workers.kafka_io import Producer


@pytest.fixture(scope="module")
def env(settings):
    """(deployment, database engine, producer) on the test services, for the persistence and outbox tests."""
    dep = make_deployment(settings)
    db = make_engine(dep.database_url)
    producer = Producer(dep.kafka_connection, "inferq-test-persistence")
    yield dep, db, producer
    producer.close()
    db.dispose()
