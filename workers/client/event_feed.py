"""A followed job's token events, handed on in order: what `JobClient.stream` and the HTTP API's streams
(its asyncio follower) both read through, so one place decides the events' order and their copies.

The follower delivers records, `CaughtUp` and `Failed` (stream_hub.py); `TokenOrder` puts the events in
order. When a hole shows, the feed asks the hub to read the job's records again (`rewind`), and only once
that read has caught up with the partition and the hole is still there is it taken to be final
(`TokenOrder.skip_gap`): the events after it go on. `ContinuousOutput` then passes on only what is new of
each event: a resumed attempt's restatement, and any event of a position already passed on, are cut to what
follows it (each position's first text is kept), so neither reader sends a piece of text twice.
"""

from __future__ import annotations

import logging

from schemas.jobs import TokenEvent
from workers.client.stream_hub import CaughtUp, Failed, Follower
from workers.client.token_order import ContinuousOutput, TokenOrder
from workers.kafka_io import Record

log = logging.getLogger(__name__)


class EventFeed:
    def __init__(self, job_id: str, follower: Follower) -> None:
        self.job_id = job_id
        self.follower = follower
        self.order = TokenOrder()
        self.output = ContinuousOutput()  # one stream across attempts: what is new of each event
        self._rewound: int | None = None  # the rewind asked for the hole waiting now, if any

    def take(self, item: Record | CaughtUp | Failed) -> list[TokenEvent]:
        """The events `item` makes ready, in order, each cut to what is new (raises the hub's error for
        `Failed`); one with `restarted` set starts the output over."""
        if isinstance(item, Failed):
            raise item.error
        order = self.order
        if isinstance(item, CaughtUp):
            if self._rewound is None or item.placement != self._rewound or not order.gap:
                return []
            # read again to the partition's end and still missing: not in the topic (retention, or a
            # `since_ms` after the job began); the events after the hole go on
            log.warning("job %s: events from seq %d are not in the topic", self.job_id, order.next_seq)
            ready = order.skip_gap()
        else:
            ready = order.add(TokenEvent.model_validate_json(item.value or b"{}"))
        if not order.gap:
            self._rewound = None
        elif self._rewound is None:  # a hole: read the job's records again before going on
            log.info("job %s: seq %d missing from its stream; reading again", self.job_id, order.next_seq)
            self._rewound = self.follower.rewind()
        return [new for event in ready if (new := self.output.take(event)) is not None]
