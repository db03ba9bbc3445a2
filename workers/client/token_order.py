"""A job's token events handed on in order: each attempt's seqs 0, 1, 2… once each, with no hole.

What comes off the topic may not be that: a producer retry writes an event twice, a redone job starts a
new attempt while the old worker's last events still arrive, and a record can be missed by the reader
(or written after a later one, when a send was retried). `TokenOrder` keeps what is early until the events
before it come; the caller then reads the job's partition again (`StreamHub.rewind`), and only once that
read has caught up with the partition is a hole taken to be final (`skip_gap`).
"""

from __future__ import annotations

from schemas.chat import FunctionCallDelta, ToolCallDelta
from schemas.jobs import TokenEvent


class TokenOrder:
    def __init__(self) -> None:
        self.attempt: int | None = None  # the latest attempt seen: its events are the job's text
        self.next_seq = 0  # the seq of that attempt to hand on next
        self._early: dict[int, TokenEvent] = {}  # seq -> event that came before the ones ahead of it

    @property
    def gap(self) -> bool:
        """Events wait for an earlier one that has not come."""
        return bool(self._early)

    def add(self, event: TokenEvent) -> list[TokenEvent]:
        """The events that are next in line now (none, this one, or this one and those it was holding up)."""
        if self.attempt is not None and event.attempt < self.attempt:
            return []  # an attempt a later one replaced: its text is not the job's
        if event.attempt != self.attempt:  # a new attempt restarts the text at seq 0
            self.attempt, self.next_seq, self._early = event.attempt, 0, {}
        if event.seq < self.next_seq or event.seq in self._early:
            return []  # a copy: a producer retry, or the partition read again
        self._early[event.seq] = event
        return self._take_ready()

    def skip_gap(self) -> list[TokenEvent]:
        """The missing events will not come (the partition was read again to its end): hand on the rest."""
        ready = []
        while self._early:
            self.next_seq = min(self._early)
            ready += self._take_ready()
        return ready

    def _take_ready(self) -> list[TokenEvent]:
        ready = []
        while self.next_seq in self._early:
            ready.append(self._early.pop(self.next_seq))
            self.next_seq += 1
        return ready


class ContinuousOutput:
    """A job's output as its consumer should see it: each position of each sample once, never restarted.

    Takes the events TokenOrder hands on (each attempt's in seq order, earlier attempts dropped once a
    later one shows) and passes on only what is new: an event's tokens and text before what was already
    passed on for its sample are cut off (the same positions carry the same text, whichever attempt sent
    them), and an event with nothing new, and no end to tell, is dropped. Its `offset` and `text_offset`
    then say where the cut event starts. The output starts over only where an attempt says it does
    (`restarted`: it could not resume), or for events from a worker older than offsets (`offset` None),
    whose every new attempt restarts; the first event passed on after that has `restarted` set, and the
    consumer drops what it had of the job.

    Tool-call deltas (a job with tools) are cut alike, per call: a call's head (`id`, name) is passed on
    once, and its arguments from where what was passed on ends. Where a delta's arguments start is counted
    within its attempt: an attempt's events restate each call from its head, and its later deltas of the
    call follow on.
    """

    def __init__(self) -> None:
        self.attempt: int | None = None
        self._tokens: dict[int, int] = {}  # by sample: tokens passed on
        self._chars: dict[int, int] = {}  # by sample: characters of text passed on
        self._ended: set[int] = set()  # samples whose finish_reason was passed on
        self._call_chars: dict[int, dict[int, int]] = {}  # by sample, by call: its arguments passed on
        self._attempt_chars: dict[int, dict[int, int]] = {}  # the same, as this attempt's events sent them

    def take(self, event: TokenEvent) -> TokenEvent | None:
        """The part of `event` not passed on before (the event itself when all of it is new), or None."""
        restart = False
        if event.attempt != self.attempt:
            # a legacy attempt always restarts, as does one that says so; a restart of nothing is none
            shown = any(self._tokens.values()) or any(self._chars.values())
            restart = shown and (event.offset is None or event.restarted)
            self.attempt, self._attempt_chars = event.attempt, {}
            if restart:
                self._tokens, self._chars, self._ended, self._call_chars = {}, {}, set(), {}
        index = event.index
        have_tokens, have_chars = self._tokens.get(index, 0), self._chars.get(index, 0)
        offset = have_tokens if event.offset is None else event.offset
        text_offset = have_chars if event.text_offset is None else event.text_offset
        skip_tokens = max(0, have_tokens - offset)
        skip_chars = max(0, have_chars - text_offset)
        # (a position past what was passed on means events were missed: what follows is passed on as is)
        self._tokens[index] = max(have_tokens, offset + len(event.token_ids))
        self._chars[index] = max(have_chars, text_offset + len(event.text))
        finish = event.finish_reason if index not in self._ended else None
        if finish is not None:
            self._ended.add(index)
        new_ids = event.token_ids[skip_tokens:]
        new_text = event.text[skip_chars:]
        calls, calls_cut = self._new_calls(event) if event.tool_calls else (None, False)
        if (
            not new_ids
            and not new_text
            and not calls
            and finish is None
            and event.usage is None
            and not restart
        ):
            return None
        unchanged = not (skip_tokens or skip_chars or calls_cut)
        if unchanged and restart == event.restarted and finish == event.finish_reason:
            return event
        logprobs = event.logprobs[skip_tokens:] if event.logprobs is not None else None
        return event.model_copy(
            update={
                "token_ids": new_ids,
                "text": new_text,
                "logprobs": logprobs,
                "offset": offset + skip_tokens,
                "text_offset": text_offset + skip_chars,
                "finish_reason": finish,
                "restarted": restart,
                "tool_calls": calls,
            }
        )

    def _new_calls(self, event: TokenEvent) -> tuple[list[ToolCallDelta] | None, bool]:
        """The part of `event`'s call deltas not passed on before, and whether any was cut."""
        passed = self._call_chars.setdefault(event.index, {})
        sent = self._attempt_chars.setdefault(event.index, {})
        kept: list[ToolCallDelta] = []
        cut = False
        for delta in event.tool_calls or ():
            call, args = delta.index, delta.function.arguments
            start = 0 if delta.id is not None else sent.get(call, 0)
            sent[call] = start + len(args)
            have = passed.get(call)
            passed[call] = max(have or 0, start + len(args))
            if have is None:  # a call not passed on before: all of it is new
                kept.append(delta)
                continue
            skip = max(0, have - start)
            if delta.id is None and not skip:
                kept.append(delta)
                continue
            cut = True  # its head, or arguments, were passed on already
            if args[skip:]:
                kept.append(ToolCallDelta(index=call, function=FunctionCallDelta(arguments=args[skip:])))
        return kept or None, cut
