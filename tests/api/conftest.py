"""Fixtures of the HTTP API tests: a deployment with a worker and an API process, and one with an API
process but no worker (jobs stay queued: expiry, timeouts, limits)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.api.api_factories import MODEL, create_key, migrated_database, start_api, wait_models
from tests.workers.worker_factories import make_deployment, start_worker


@pytest.fixture(scope="package")
def api_database(settings, services_up):
    with migrated_database(settings) as url:
        yield url


@pytest.fixture(scope="package")
def served(settings, api_database, tmp_path_factory):
    """(deployment, API process, keys by tenant) with one tiny-model worker."""
    dep = make_deployment(dataclasses.replace(settings, database_url=api_database))
    tmp = tmp_path_factory.mktemp("api")
    worker = start_worker(dep, tmp, "w-api", "--served-model-name", MODEL)
    api = start_api(dep, tmp)
    keys = {t: create_key(dep, t) for t in ("acme", "globex")}
    try:
        wait_models(api, keys["acme"], [MODEL])  # the worker announced its model: it serves
        yield dep, api, keys
    finally:
        code = api.stop()
        assert worker.stop() == 0, worker.output()[-3000:]
        assert code == 0, api.output()[-3000:]  # SIGTERM: a graceful shutdown


@pytest.fixture(scope="package")
def idle(settings, api_database, tmp_path_factory):
    """(deployment, API process, key) without a worker: 3 s batch window, 2 s request timeout, 4 KB files."""
    dep = make_deployment(dataclasses.replace(settings, database_url=api_database))
    tmp = tmp_path_factory.mktemp("api-idle")
    api = start_api(
        dep,
        tmp,
        INFERQ_API_BATCH_WINDOW="3",
        INFERQ_API_REQUEST_TIMEOUT="2",
        INFERQ_API_MAX_FILE_BYTES="4096",
    )
    try:
        yield dep, api, create_key(dep, "acme")
    finally:
        assert api.stop() == 0, api.output()[-3000:]
