"""The engine in a process of its own, behind the interface the worker drives (`inferq worker
--engine-process`).

In one process, the model's forward shares the GIL with everything else the worker runs in Python: Kafka's
I/O threads, the persister, admission, the job log. The forward releases the GIL inside each torch op and
takes it back after; whenever another thread holds it then, the forward waits. Measured on the 2-core CPU
machine with the tiny model: a step of 64 one-token jobs took 40 ms of wall time for 29 ms of CPU in a
loaded worker, 30 ms alone. Here the engine (model, scheduler, KV cache, sampler, grammars) runs in a child
process and the worker's own threads no longer stand in its way.

Each `step()` returns one engine step's outputs and launches the next before it returns, so the child
runs step N+1 while the worker handles step N's outputs (writes, token events, admission). Requests added
meanwhile go with the next message; a reply carries what the worker reads between steps (whether work is
left, the running requests, stats). Aborts are a round trip of their own (cancels, deadlines: rare). A
failed step raises StepFailed with its sequences and outputs, as in-process; `only` (the step guard's
probe) runs one request alone with nothing launched ahead.

The child is spawned (CUDA cannot be used in a forked child), dies with its parent (PR_SET_PDEATHSIG: a
worker killed with SIGKILL leaves nothing running) and stops when its pipe closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, NoReturn

from gpu.engine_types import (
    EngineRequest,
    EngineStats,
    GrammarSpec,
    LoraRequest,
    RequestOutput,
    StepFailed,
)
from gpu.grammar.constraints import Constraints
from gpu.lora import LoraError
from gpu.resume import check_resume
from scheduler.types import FinishReason

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class EngineProcessDied(RuntimeError):
    """The engine's process is gone (killed, or out of memory): the worker cannot go on."""


@dataclass(frozen=True)
class EngineFacts:
    """What the worker reads from its engine besides steps: sent once, when the child is ready."""

    tokenizer: Any
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    generation_defaults: Any
    fingerprint: str = ""  # the model and tokenizer (gpu/fingerprint.py): whose saved progress it resumes


@dataclass(frozen=True)
class _State:
    """The engine as the last reply left it."""

    has_unfinished: bool
    running_ids: list[str]
    last_step: tuple[str, ...]
    stats: EngineStats


class EngineProcess:
    """An Engine in a child process; `build` (picklable: a module-level function or a partial of one)
    makes and warms up the engine there."""

    def __init__(self, build: Callable[[], Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # grammars go to the child as intake compiles them, on a pipe of their own: compiled there off the
        # step path, they are cached before their jobs are admitted
        grammars_in, self._grammars = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_serve,
            args=(child_conn, grammars_in, build, os.getpid()),
            name="inferq-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        grammars_in.close()
        self._grammars_lock = threading.Lock()
        kind, (_, payload) = self._receive()  # however long the model takes to load (or convert)
        if kind != "ready":
            self._process.join(5)
            raise RuntimeError(f"the engine process could not start: {payload}")
        facts: EngineFacts = payload
        log.info("engine process %d ready", self._process.pid)
        self.tokenizer = facts.tokenizer
        self.eos_token_ids = facts.eos_token_ids
        self.generation_defaults = facts.generation_defaults
        self.fingerprint = facts.fingerprint
        # the attributes the worker reads on an in-process engine (intake's limits, bulk windows)
        self.scheduler = SimpleNamespace(
            config=SimpleNamespace(max_model_len=facts.max_model_len, max_num_seqs=facts.max_num_seqs)
        )
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=facts.vocab_size))
        # grammars are compiled here too, to refuse a bad one at intake; the child compiles its own copy
        self._constraints = Constraints(facts.tokenizer, facts.vocab_size, tuple(facts.eos_token_ids))
        self._adds: list[EngineRequest] = []
        # the priorities of the requests each message not answered yet carried: the last reply's stats do
        # not count them, and the worker's caps must (a job on its way to the child is held here)
        self._unanswered: deque[list[Any]] = deque()
        self._state = _State(False, [], (), _empty_stats())
        self._lock = threading.Lock()  # the pipe's messages and replies stay paired
        self._in_flight = False  # a step was launched ahead; its reply is the next one on the pipe
        self._early: list[RequestOutput] = []  # outputs of that step, read before an abort's reply
        self._early_failure: Exception | None = None  # or its failure: both come out of the next step()
        self._dead = False  # the child is gone (EngineProcessDied was raised)
        self._death = ""

    # ---- the Engine interface the worker uses ----------------------------------------------------------
    def compile_grammar(self, spec: GrammarSpec) -> Any:
        """Compiled here (a bad grammar raises now, at intake) and in the child, off its step path."""
        compiled = self._constraints.compile(spec)
        with self._grammars_lock, contextlib.suppress(OSError):  # a dead child is step()'s to report
            self._grammars.send(spec)
        return compiled

    def add_request(self, request: EngineRequest) -> None:
        """Queued until the next step or abort (a request the child refuses ends REJECTED, with why). A resume
        the engine cannot continue raises ResumeRefused here, at once, as an in-process engine's does (the
        child runs the same check on the same tokenizer, so it never refuses one that passed here)."""
        if request.resume:
            limits = (self.model.config.vocab_size, self.scheduler.config.max_model_len, self.eos_token_ids)
            check_resume(request, self.tokenizer, *limits, self._constraints.matcher)
        if request.grammar is not None and not isinstance(request.grammar, GrammarSpec):
            request = replace(request, grammar=request.grammar.spec)  # compiled objects stay in this process
        self._adds.append(request)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """As Engine's. Never raises for a dead process (it holds nothing to free): the next step() does."""
        with self._lock:
            if self._dead:
                return []
            try:
                self._settle_in_flight()
                self._send("abort", request_id)
                aborted = self._read()
            except EngineProcessDied:
                return []
            if aborted:  # it was live: what the step launched ahead made of it is not its news any more
                self._early = [o for o in self._early if o.request_id != request_id]
            return aborted

    def load_lora(self, lora: LoraRequest) -> None:
        """As Engine's: loaded into the child's host cache now (a round trip, after the step in flight); a
        bad adapter's LoraError raised here with the child's message."""
        with self._lock:
            if self._dead:
                raise EngineProcessDied(self._death)
            self._settle_in_flight()
            self._send("load_lora", lora)
            self._read()

    def step(self, only: str | None = None) -> list[RequestOutput]:
        """The outputs of one engine step. The next step is launched before this returns (unless `only`
        asks for a probe, or nothing is left): the child runs it while the worker handles these outputs."""
        with self._lock:
            if self._dead:
                raise EngineProcessDied(self._death)
            if only is not None:  # a probe runs alone: what runs now finishes first
                self._settle_in_flight()
            self._raise_early_failure()
            if not self._in_flight:
                self._send("step", only)
            self._in_flight = False
            try:
                outputs = self._read()
            except StepFailed as failed:
                raise self._with_early(failed) from failed.__cause__
            early, self._early = self._early, []
            if only is None and (self._state.has_unfinished or self._adds):
                self._send("step", None)
                self._in_flight = True
            return early + outputs

    def has_unfinished(self) -> bool:
        """Work, or news of it, is left; also once the process is gone (so that step() says so)."""
        news = self._in_flight or bool(self._adds or self._early) or self._early_failure is not None
        return news or self._state.has_unfinished or self._dead or not self._process.is_alive()

    def running_ids(self) -> list[str]:
        return list(self._state.running_ids)

    @property
    def last_step(self) -> tuple[str, ...]:
        return self._state.last_step

    def stats(self) -> EngineStats:
        """The last reply's stats, with the requests added since (queued here or on their way) as waiting."""
        stats = self._state.stats
        on_way = Counter(request.priority for request in self._adds)
        for priorities in self._unanswered:
            on_way.update(priorities)
        if not on_way:
            return stats
        waiting = dict(stats.waiting)
        for priority, n in on_way.items():
            waiting[priority] = waiting.get(priority, 0) + n
        return replace(stats, waiting=waiting)

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError):
                self._conn.send(("close", [], None))
            self._conn.close()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

    # ---- the pipe ----------------------------------------------------------------------------------
    def _send(self, op: str, arg: Any) -> None:
        """A message to the child, with the requests added since the last one (added before it runs)."""
        adds, self._adds = self._adds, []
        try:
            self._conn.send((op, adds, arg))
        except OSError as exc:
            self._died(exc)
        self._unanswered.append([request.priority for request in adds])

    def _read(self) -> list[RequestOutput]:
        """The reply to the oldest message not answered yet: its outputs, or its failure raised. Requests
        the child refused end REJECTED in `_early`, delivered by the next step() whatever the message was."""
        kind, (refused, payload) = self._receive()
        if self._unanswered:  # this reply's state counts the requests its message carried
            self._unanswered.popleft()
        self._early += refused
        if kind == "ok":
            outputs, self._state = payload
            return outputs
        if kind == "lora_error":
            raise LoraError(payload)
        if kind == "step_failed":
            seq_ids, outputs, error, self._state = payload
            cause = RuntimeError(error)
            raise StepFailed(seq_ids, outputs, cause) from cause
        raise RuntimeError(f"engine process: {payload}")

    def _settle_in_flight(self) -> None:
        """Read the reply of the step launched ahead, so the next message's reply is the next one read: its
        outputs wait in `_early`, a failure in `_early_failure`, both for step()."""
        if not self._in_flight:
            return
        self._in_flight = False
        try:
            self._early += self._read()
        except EngineProcessDied:
            raise
        except Exception as exc:  # noqa: BLE001 - the step's own failure: step() raises it
            self._early_failure = exc

    def _raise_early_failure(self) -> None:
        if self._early_failure is None:
            return
        failed, self._early_failure = self._early_failure, None
        if isinstance(failed, StepFailed):
            raise self._with_early(failed) from failed.__cause__
        raise failed

    def _with_early(self, failed: StepFailed) -> StepFailed:
        """`failed` carrying the outputs read before it, which the caller must still apply."""
        early, self._early = self._early, []
        return StepFailed(failed.seq_ids, early + failed.outputs, failed.__cause__ or failed)

    def _receive(self) -> tuple[str, Any]:
        """The child's next reply; raises EngineProcessDied once it is gone."""
        try:
            while not self._conn.poll(1.0):
                if not self._process.is_alive():
                    raise EOFError
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            self._died(exc)

    def _died(self, exc: BaseException) -> NoReturn:
        self._dead = True
        self._process.join(5)
        self._death = f"the engine process exited (code {self._process.exitcode})"
        raise EngineProcessDied(self._death) from exc


def _empty_stats() -> EngineStats:
    return EngineStats(
        running=0, waiting={}, kv_blocks_used=0, kv_blocks_total=0, preemptions=0, prefix_cache_hits=0,
        prompt_tokens_computed=0, steps=0, forward_seconds=0.0, mean_batch_size=0.0, mean_batch_tokens=0.0,
        forward_by_batch={},
    )  # fmt: skip


# ---- the child -----------------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies, however it dies (Linux; elsewhere the pipe's EOF)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the call (it may be pid 1, in a container)
        os._exit(1)


def _serve(conn: Any, grammars: Any, build: Callable[[], Any], parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # the worker decides when its engine stops (a ^C in a terminal reaches both processes)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = build()
    except BaseException as exc:  # noqa: BLE001 - told to the parent, which raises it
        conn.send(("error", ([], f"{type(exc).__name__}: {exc}")))
        return
    config = engine.scheduler.config
    facts = EngineFacts(
        tokenizer=engine.tokenizer,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        vocab_size=engine.model.config.vocab_size,
        eos_token_ids=frozenset(engine.eos_token_ids),
        generation_defaults=engine.generation_defaults,
        fingerprint=engine.fingerprint,
    )
    threading.Thread(
        target=_compile_grammars, args=(grammars, engine), name="inferq-grammars", daemon=True
    ).start()
    conn.send(("ready", ([], facts)))  # every reply: (kind, (refused requests, payload))
    while True:
        try:
            op, adds, arg = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            engine.close()
            # nothing here outlives the process: leave without the interpreter's teardown of the model,
            # caches and their objects (5-8 s of CPU for the tiny model, measured: a worker's stop waited)
            logging.shutdown()
            os._exit(0)
        refused = [_refused(request, exc) for request, exc in _add_all(engine, adds)]
        if op == "load_lora":
            try:
                engine.load_lora(arg)
            except LoraError as exc:  # the adapter's fault: the parent raises it; the engine goes on
                conn.send(("lora_error", (refused, str(exc))))
                continue
            conn.send(("ok", (refused, ([], _state_of(engine)))))
            continue
        try:
            outputs = engine.step(arg) if op == "step" else engine.abort_request(arg)
        except StepFailed as failed:
            cause = failed.__cause__ or failed
            error = f"{type(cause).__name__}: {cause}"
            conn.send(("step_failed", (refused, (failed.seq_ids, failed.outputs, error, _state_of(engine)))))
            continue
        except Exception as exc:  # noqa: BLE001 - the parent raises it; the engine goes on
            log.exception("engine process: %s failed", op)
            conn.send(("error", (refused, f"{type(exc).__name__}: {exc}")))
            continue
        conn.send(("ok", (refused, (outputs, _state_of(engine)))))


def _compile_grammars(grammars: Any, engine: Any) -> None:
    """Compile each spec intake sent into the engine's cache (a bad one was refused at intake already)."""
    while True:
        try:
            spec = grammars.recv()
        except (EOFError, OSError):
            return
        try:
            engine.compile_grammar(spec)
        except Exception:  # noqa: BLE001 - intake refused it; nothing here depends on it
            continue


def _add_all(engine: Any, adds: list[EngineRequest]) -> list[tuple[EngineRequest, Exception]]:
    refused = []
    for request in adds:
        try:
            engine.add_request(request)
        except Exception as exc:  # noqa: BLE001 - this request's alone: it ends REJECTED with the reason
            refused.append((request, exc))
    return refused


def _refused(request: EngineRequest, exc: Exception) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=(),
        text_delta="",
        finish_reason=FinishReason.REJECTED,
        started=False,
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=0,
        detail=f"the engine refused the request: {type(exc).__name__}: {exc}",
    )


def _state_of(engine: Any) -> _State:
    return _State(engine.has_unfinished(), engine.running_ids(), engine.last_step, engine.stats())
