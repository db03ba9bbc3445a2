"""Engine steps that raise: find the sequence at fault, or give up on a device that is.

A step that raises does not say which of its sequences broke it, or whether any did: a request can be
poison (an input that breaks a kernel), or the device can be (a CUDA error that no request will cure).
Failing the whole step punishes innocent jobs; re-running it could crash-loop every worker of the group.

So a failed step makes its sequences suspects, and the next steps run one suspect at a time. A suspect
whose step fails alone is held (never run again) until a later step succeeds: then the device works, and
that sequence is convicted (its job fails with the step's error); with nothing else to run, it is
convicted at once. Suspects whose steps succeed alone are cleared. `max_consecutive` failed steps in a row
mean the device is at fault: the worker gives up, failing no one, so another worker redoes the jobs.
"""

from __future__ import annotations

from collections.abc import Iterable


class StepGuard:
    def __init__(self, max_consecutive: int = 3) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0  # failed steps in a row
        self._suspects: dict[str, None] = {}  # to run alone, in order
        self._held: dict[str, str] = {}  # failed alone -> the step's error, until a step succeeds

    @property
    def gave_up(self) -> bool:
        return self.consecutive >= self.max_consecutive

    @property
    def isolating(self) -> bool:
        return bool(self._suspects)

    @property
    def engaged(self) -> bool:
        """Whether a step has failed and not everything is settled yet (else a step needs no bookkeeping)."""
        return bool(self.consecutive or self._suspects or self._held)

    def next_step(self, running: Iterable[str]) -> str | None:
        """Choose what the coming step runs: the next running suspect alone (returned), or every sequence
        not held (None). A suspect no longer running (ended, or preempted) is no longer suspected."""
        alive = set(running)
        for gone in [s for s in self._suspects if s not in alive]:
            del self._suspects[gone]
        return next(iter(self._suspects), None)

    def failed(self, seq_ids: Iterable[str], error: str) -> str | None:
        """The step that ran these sequences raised `error`; returns the sequence now held, if one ran
        alone (it must not run again)."""
        self.consecutive += 1
        ran = [s for s in seq_ids if s not in self._held]
        if len(ran) == 1:  # it failed alone: held until a working step shows it is at fault
            self._suspects.pop(ran[0], None)
            self._held[ran[0]] = error
            return ran[0]
        for seq_id in ran:
            self._suspects.setdefault(seq_id, None)
        return None

    def succeeded(self, seq_ids: Iterable[str]) -> dict[str, str]:
        """The step that ran these sequences went through; returns the convicted: id -> the error."""
        ran = list(seq_ids)
        if not ran:  # a step that ran nothing proves nothing about the device
            return {}
        self.consecutive = 0
        for seq_id in ran:
            self._suspects.pop(seq_id, None)
        convicted, self._held = self._held, {}
        return convicted

    def convict_when_idle(self) -> dict[str, str]:
        """Nothing but held sequences is left to run, so no step can show the device works: convict them
        anyway, keeping the count of failed steps (a device at fault fails the next job, and gives up)."""
        convicted, self._held = self._held, {}
        return convicted

    def held(self) -> list[str]:
        return list(self._held)
