"""Announcing the worker's model to the fleet: its served_models row, written at start, renewed every
HEARTBEAT_S by a thread of its own, removed at a graceful stop. The HTTP API lists the models of the rows
that are live (`/v1/models`). A database that is away costs a warning and a retry at the next beat: the
worker serves its jobs whether or not it is listed."""

from __future__ import annotations

import logging
import threading

from workers.clock import utcnow
from workers.db import Engine
from workers.db import served_models as store

log = logging.getLogger(__name__)


class Announcer:
    def __init__(
        self,
        db: Engine,
        worker_id: str,
        topic_prefix: str,
        model: str,
        max_model_len: int | None,
        interval_s: float = store.HEARTBEAT_S,
    ) -> None:
        self.db, self.worker_id, self.topic_prefix = db, worker_id, topic_prefix
        self.model, self.max_model_len, self.interval_s = model, max_model_len, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inferq-announcer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop renewing and remove the row (a graceful stop: the API stops listing this worker at once)."""
        self._stop.set()
        self._thread.join(timeout_s)
        try:
            with self.db.begin() as conn:
                store.withdraw(conn, self.worker_id)
        except Exception as exc:  # noqa: BLE001 - the row goes stale and is ignored instead
            log.warning("could not withdraw worker %s from served_models: %s", self.worker_id, exc)

    def beat(self) -> None:
        with self.db.begin() as conn:
            store.announce(conn, self.worker_id, self.topic_prefix, self.model, self.max_model_len, utcnow())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the database away: next beat
                log.warning("could not announce model %s: %s", self.model, exc)
            self._stop.wait(self.interval_s)
