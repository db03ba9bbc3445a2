"""Kafka topic names of the contract (prefix configurable, default `inferq`)."""

from __future__ import annotations

from dataclasses import dataclass

Partition = tuple[str, int]  # topic, partition
Coordinates = tuple[str, int, int]  # topic, partition, offset: where one record is

PRIORITY_CLASSES = ("high", "normal", "low")


@dataclass(frozen=True)
class Topics:
    prefix: str = "inferq"

    def jobs(self, priority: str) -> str:
        if priority not in PRIORITY_CLASSES:
            raise ValueError(f"unknown priority {priority!r}; expected one of {PRIORITY_CLASSES}")
        return f"{self.prefix}.jobs.{priority}"

    @property
    def all_jobs(self) -> tuple[str, ...]:
        return tuple(self.jobs(p) for p in PRIORITY_CLASSES)

    @property
    def control(self) -> str:
        return f"{self.prefix}.control"

    @property
    def tokens(self) -> str:
        return f"{self.prefix}.tokens"

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    def priority_of(self, topic: str) -> str:
        for p in PRIORITY_CLASSES:
            if topic == self.jobs(p):
                return p
        raise ValueError(f"{topic!r} is not a jobs topic of prefix {self.prefix!r}")

    def partitions(self, jobs: int = 4, stream: int = 4) -> dict[str, int]:
        """Topic → partition count that `inferq up` creates: `jobs` per jobs topic (workers share a class by
        its partitions), `stream` for tokens and results; control and the DLQ keep one (order matters)."""
        counts = {t: jobs for t in self.all_jobs}
        counts.update({self.control: 1, self.tokens: stream, self.results: stream, self.dlq: 1})
        return counts
