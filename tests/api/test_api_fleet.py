"""The fleet's models (issue 40, item 6): `/v1/models` lists what the live workers announce (served_models),
not the API's configuration. A worker announces at start and renews its heartbeat (workers/serving/
announcer.py), a graceful stop withdraws it, and a row whose heartbeat is old is a worker that died."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import openai
import pytest
from sqlalchemy import create_engine

from tests.api.api_factories import MODEL
from workers.api.fleet import model_list
from workers.db import served_models
from workers.db.served_models import STALE_S, ServedModel
from workers.serving.announcer import Announcer

AT = datetime(2026, 12, 8, tzinfo=UTC)


def test_the_listing_is_one_card_per_model_with_the_smallest_context():
    served = [
        ServedModel("w1", "qwen", 4096, AT + timedelta(seconds=5)),
        ServedModel("w2", "qwen", 2048, AT),
        ServedModel("w3", "smollm2", None, AT),
    ]
    cards = model_list(served)
    assert [c["id"] for c in cards] == ["qwen", "smollm2"]
    assert (cards[0]["created"], cards[0]["max_model_len"]) == (int(AT.timestamp()), 2048)
    assert "max_model_len" not in cards[1] and cards[1]["owned_by"] == "inferq"
    assert model_list([]) == []


def _listed(client: openai.OpenAI, want: list[str], timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        listed = [m.id for m in client.models.list()]
        if listed == want or time.monotonic() > deadline:
            return listed
        time.sleep(0.3)


@pytest.mark.services
@pytest.mark.slow
def test_models_are_the_live_workers_and_a_body_may_name_only_theirs(idle):
    """The idle deployment has no worker: nothing is listed, and a body may name the configured model (its
    job waits). A worker announcing `other` is listed (and only its model may be named) until it stops."""
    dep, api, key = idle
    client = api.client(key)
    assert _listed(client, []) == []
    db = create_engine(dep.database_url)
    announcer = Announcer(db, f"w-fleet-{time.time()}", dep.topic_prefix, "other", 1024, interval_s=0.5)
    announcer.start()
    try:
        assert _listed(client, ["other"]) == ["other"]
        assert client.models.retrieve("other").max_model_len == 1024
        with pytest.raises(openai.NotFoundError):  # a worker runs: only what it serves may be named
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(MODEL)
        # a worker of another deployment (topic prefix) is not this one's
        with db.begin() as conn:
            served_models.announce(
                conn, "w-elsewhere", "another-prefix", "elsewhere", None, datetime.now(UTC)
            )
        assert _listed(client, ["other", "elsewhere"], timeout_s=3) == ["other"]
    finally:
        announcer.stop()  # a graceful stop withdraws its row
    assert _listed(client, []) == []
    # a worker that died leaves a row whose heartbeat grows old: not listed
    with db.begin() as conn:
        old = datetime.now(UTC) - timedelta(seconds=STALE_S + 1)
        served_models.announce(conn, "w-dead", dep.topic_prefix, "ghost", None, old)
    assert _listed(client, ["ghost"], timeout_s=3) == []
    with db.begin() as conn:
        served_models.withdraw(conn, "w-dead")
        served_models.withdraw(conn, "w-elsewhere")
    db.dispose()
