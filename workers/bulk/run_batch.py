"""An OpenAI Batch file through the engine in this process (`inferq run-batch`, as `vllm run-batch`): no
Kafka, no PostgreSQL, no Celery. Lines are read, validated and answered exactly as the bulk path does
(workers/bulk/batch_format.py, workers/bulk/output.py); the answers are written in input order.

At most `window` requests are in the engine at once, so a file of any size runs in bounded memory; lines
that finish early wait in a small reorder buffer until the lines before them are written.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpu.engine import Engine, EngineRequest, RequestOutput
from schemas.jobs import JobRequest
from schemas.statuses import STATUS_OF_FINISH
from schemas.topics import Topics
from schemas.validation import InvalidMessage, Limits
from workers.bulk.batch_format import BatchLine, LineError, job_id_for, to_job
from workers.bulk.output import failed_line, invalid_line, success_line
from workers.clock import utcnow
from workers.serving.admission.models import ServedModel, ServedModels
from workers.serving.intake.sampling import sampling_params
from workers.serving.intake.validation import Intake
from workers.serving.loop.choices import REQUEST_ENDS, Choices, LogprobFormatter

Answer = tuple[dict[str, Any], bool]  # (the output line, whether it succeeded)


@dataclass
class _Running:
    line: BatchLine
    job_id: str
    prompt_tokens: int
    choices: Choices = field(default_factory=Choices)
    model: str | None = None  # what served it: the base's name or the adapter's


class BatchRunner:
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        limits: Limits | None = None,
        window: int | None = None,
        models: ServedModels | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        # what a line's body.model may name: the base's names and the --lora-modules adapters
        self.models = models or ServedModels((model_name,))
        max_len = engine.scheduler.config.max_model_len
        self.intake = Intake(
            Topics(),
            limits or Limits(),
            engine.tokenizer,
            max_len,
            vocab_size=engine.model.config.vocab_size,
            compile_grammar=lambda spec: engine.compile_grammar(spec),
        )
        self.logprob_format = LogprobFormatter(engine.tokenizer)
        self.window = window or 4 * engine.scheduler.config.max_num_seqs
        self.run_id = f"batch-{uuid.uuid4().hex[:12]}"  # response ids: <run id>:<custom_id>

    def run(
        self, items: Iterable[BatchLine | LineError], on_answer: Callable[[Answer], None] | None = None
    ) -> Iterator[Answer]:
        """The answer of every item, in input order; `on_answer` is told of each as soon as it exists."""
        ready: dict[int, Answer] = {}
        running: dict[str, tuple[int, _Running]] = {}
        next_out = 0
        source = enumerate(items)
        exhausted = False
        while not exhausted or running:
            while not exhausted and len(running) < self.window:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                index, line = item
                answer = self._start(line, index, running)
                if answer is not None:
                    ready[index] = answer
                    _tell(on_answer, answer)
            if running:
                finished = [self._on_output(out, running) for out in self.engine.step()]
                if running and not self.engine.has_unfinished():  # never wait on samples that cannot come
                    finished += [self._lost(job_id, running) for job_id in list(running)]
                for done in finished:
                    if done is not None:
                        ready[done[0]] = done[1]
                        _tell(on_answer, done[1])
            while next_out in ready:
                yield ready.pop(next_out)
                next_out += 1

    def _start(self, item: BatchLine | LineError, index: int, running: dict) -> Answer | None:
        if isinstance(item, LineError):
            return invalid_line(item), False
        job = to_job(item, bulk_id=self.run_id, tenant="default")
        job_id = job_id_for(self.run_id, item.custom_id)
        try:
            served = self._model(job)
            _, ids, max_tokens = self.intake.prepare(job)
            grammar = self.intake.grammar(job)
        except InvalidMessage as exc:  # what only the model can tell (vocabulary, context): an invalid line,
            # as bulk's finalize reports a line its worker refused
            return invalid_line(LineError(item.line_no, item.custom_id, f"line {item.line_no}: {exc}")), False
        sampling = sampling_params(job, max_tokens, self.engine)
        self.engine.add_request(
            EngineRequest(
                job_id, ids, sampling, stop=tuple(job.stop), n=job.n, grammar=grammar, lora=served.lora
            )
        )
        dialect = self.intake.tool_dialect(job)
        tools = (dialect, f"default/{job_id}") if dialect is not None else None
        choices = Choices(job.n, self.logprob_format if job.logprobs else None, tools)
        running[job_id] = (index, _Running(item, job_id, len(ids), choices, served.name))
        return None

    def _model(self, job: JobRequest) -> ServedModel:
        """The base or one of the --lora-modules adapters (this run reads no registry), or InvalidMessage."""
        served = self.models.local(job)
        if served is None:
            names = ", ".join([*self.models.base_names, *self.models.own])
            raise InvalidMessage(f"the model {job.model!r} does not exist: this run serves {names}")
        return served

    def _on_output(self, out: RequestOutput, running: dict) -> tuple[int, Answer] | None:
        if out.request_id not in running:  # a sample's output after its request ended (aborted, expired)
            return None
        index, job = running[out.request_id]
        text = out.text_delta
        if job.choices.parses_tools:
            text = job.choices.parse(out.index, text).content
        job.choices.add(out.index, len(out.new_token_ids), text, out.logprobs)
        if out.finish_reason is None:
            return None
        if job.choices.parses_tools:
            job.choices.add(out.index, 0, job.choices.parse_end(out.index).content)
        finish = job.choices.end(out.index, out.finish_reason.value)
        if finish is None:
            return None
        if finish in REQUEST_ENDS:  # one sample ended the request (a grammar's dead end): stop the others
            self.engine.abort_request(out.request_id)
        return self._answer(out.request_id, running, finish, out.detail or None)

    def _lost(self, job_id: str, running: dict) -> tuple[int, Answer]:
        """A request the engine no longer has, some of whose samples never ended."""
        return self._answer(job_id, running, "error", "the engine ended the request before all its samples")

    def _answer(self, job_id: str, running: dict, finish: str, error: str | None) -> tuple[int, Answer]:
        index, job = running.pop(job_id)
        row = {
            "job_id": job.job_id,
            "status": STATUS_OF_FINISH.get(finish, "failed"),
            "output_text": job.choices.text(0),
            "choices": job.choices.as_json(finish),
            "finish_reason": finish,
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.choices.completion_tokens,
            "finished_at": utcnow(),
            "error": error,
            "model": job.model,
        }
        if row["status"] == "succeeded":
            return index, (success_line(job.line, row, self.model_name), True)
        return index, (failed_line(job.line, row), False)


def _tell(on_answer: Callable[[Answer], None] | None, answer: Answer) -> None:
    if on_answer is not None:
        on_answer(answer)


@dataclass
class Tally:
    succeeded: int = 0
    failed: int = 0  # ran, or could not run, and ended otherwise (too long, rejected by the engine, ...)
    invalid: int = 0  # lines that are not valid Batch requests
    completion_tokens: int = 0

    def add(self, answer: Answer) -> None:
        line, succeeded = answer
        if succeeded:
            self.succeeded += 1
            self.completion_tokens += line["response"]["body"]["usage"]["completion_tokens"]
        elif line["id"] is None:  # never became a request
            self.invalid += 1
        else:
            self.failed += 1
