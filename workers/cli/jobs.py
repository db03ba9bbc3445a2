"""Producer-side verbs: `submit`, `cancel`, `tail`, `jobs`, `schema`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from schemas.statuses import JOB_STATUSES
from schemas.topics import PRIORITY_CLASSES
from workers.cli.options import HIDDEN, add_timeout_option

SCHEMA_NAMES = ("JobRequest", "CancelRequest", "TokenEvent", "JobResult", "Rejection")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "submit",
        help="post jobs to Kafka",
        description="Post a prompt, or a JSONL file "
        "of JobRequest objects, to a priority topic; optionally stream tokens or wait.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt (or use --file)")
    p.add_argument("--file", type=Path, help="JSONL file, one JobRequest per line")
    p.add_argument("--priority", default="normal", choices=PRIORITY_CLASSES, help="(default: normal)")
    p.add_argument("--tenant", default=None, help="(default: the job's, else default)")
    p.add_argument(
        "--model", default=None, help="the base model or a LoRA adapter (default: the job's, else the base)"
    )
    p.add_argument("--job-id", default=None, help="idempotency key (default: a new UUID)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    _add_generation_options(p)
    p.add_argument(
        "--job-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the job's deadline (its timeout_s), counted from posting",
    )
    p.add_argument("--timeout-s", dest="job_timeout", type=float, **HIDDEN)
    p.add_argument("--stream", action="store_true", help="print tokens live from the tokens topic")
    p.add_argument("--wait", action="store_true", help="print the result from the results topic")
    add_timeout_option(p, 300.0, "--stream/--wait")
    p.set_defaults(func=submit)

    c = subparsers.add_parser("cancel", help="cancel a job", description="Cancel a queued or running job.")
    c.add_argument("job_id")
    c.add_argument(
        "--tenant",
        default="default",
        help="the tenant that owns the job (only it can cancel) (default: default)",
    )
    c.set_defaults(func=cancel)

    t = subparsers.add_parser(
        "tail",
        help="stream a job's tokens",
        description="Print a job's tokens as they are generated (from the tokens topic), then its status.",
    )
    t.add_argument("job_id")
    t.add_argument(
        "--tenant", default="default", help="the job's tenant (job ids are per tenant) (default: default)"
    )
    add_timeout_option(t, 300.0, "the job's final token")
    t.set_defaults(func=tail)

    j = subparsers.add_parser("jobs", help="recent jobs from PostgreSQL", description="List recent job rows.")
    j.add_argument("--status", default=None, choices=JOB_STATUSES)
    j.add_argument("--priority", default=None, choices=PRIORITY_CLASSES)
    j.add_argument("--tenant", default=None)
    j.add_argument("--bulk-id", default=None)
    j.add_argument("--model", default=None, help="only jobs of this model (the base's name or an adapter's)")
    j.add_argument("--limit", type=int, default=20, help="(default: 20)")
    j.add_argument("--json", action="store_true", help="one JSON object per line")
    j.set_defaults(func=list_jobs)

    s = subparsers.add_parser(
        "schema",
        help="print JSON Schema of the messages",
        description="JSON Schema producers and consumers can validate against.",
    )
    s.add_argument(
        "name",
        nargs="?",
        default="JobRequest",
        choices=SCHEMA_NAMES,
    )
    s.set_defaults(func=schema)


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    """The JobRequest's issue-20 fields, spelt as the message spells them (docs/contract.md)."""
    g = p.add_argument_group("generation options (as the job message's fields)")
    g.add_argument("--n", type=int, default=None, help="samples of the prompt, each a choice (1-16)")
    g.add_argument("--logprobs", action="store_true", default=None, help="each token's log probability")
    g.add_argument("--top-logprobs", type=int, default=None, help="with --logprobs: the k most likely (0-20)")
    g.add_argument("--response-format", type=_json_arg, default=None, metavar="JSON|@FILE",
                   help='OpenAI\'s response_format, e.g. \'{"type": "json_object"}\'')  # fmt: skip
    g.add_argument("--json-schema", type=_json_arg, default=None, metavar="JSON|@FILE",
                   help="a JSON Schema the output follows (as response_format json_schema)")  # fmt: skip
    g.add_argument("--guided-regex", default=None, metavar="REGEX", help="the whole output matches it")
    g.add_argument("--guided-choice", action="append", default=None, metavar="TEXT",
                   help="the output is exactly one of these (repeatable)")  # fmt: skip
    g.add_argument("--presence-penalty", type=float, default=None, help="-2 to 2 (OpenAI's)")
    g.add_argument("--frequency-penalty", type=float, default=None, help="-2 to 2 (OpenAI's)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="above 0, at most 10 (HF's)")
    g.add_argument("--logit-bias", type=_json_arg, default=None, metavar="JSON|@FILE",
                   help='token id -> bias (-100..100), e.g. \'{"198": -100}\'')  # fmt: skip


def _json_arg(value: str) -> object:
    """A JSON value given inline, or as @path to a file holding it."""
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def _generation_fields(args: argparse.Namespace) -> dict:
    fields = {
        "n": args.n,
        "logprobs": args.logprobs,
        "top_logprobs": args.top_logprobs,
        "response_format": args.response_format,
        "guided_regex": args.guided_regex,
        "guided_choice": args.guided_choice,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "logit_bias": args.logit_bias,
    }
    if args.json_schema is not None:
        if args.response_format is not None:
            raise SystemExit("inferq submit: give --json-schema or --response-format, not both")
        fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": args.json_schema}}
    return fields


def _jobs_from_args(args: argparse.Namespace) -> list:
    overrides = {
        k: v
        for k, v in {
            **_generation_fields(args),
            "tenant": args.tenant,
            "model": args.model,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "seed": args.seed,
            "stop": args.stop,
            "timeout_s": args.job_timeout,
            "job_id": args.job_id,
        }.items()
        if v is not None
    }
    if args.file:
        shared = {k: v for k, v in overrides.items() if k != "job_id"}
        return [_job_line(line, n, shared) for n, line in enumerate(args.file.read_text().splitlines(), 1)
                if line.strip()]  # fmt: skip
    if args.prompt is None:
        raise SystemExit("inferq submit: give a prompt or --file")
    return [_job_line(json.dumps({"prompt": args.prompt}), 0, overrides)]


def _job_line(line: str, number: int, overrides: dict):
    """A JobRequest from a line of the file (validated here: a bad line stops the command before anything
    is sent, naming the line)."""
    from pydantic import ValidationError

    from schemas.jobs import JobRequest

    where = f"line {number}: " if number else ""
    try:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return JobRequest.model_validate({**data, **overrides})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'job'}: {e['msg']}" for e in exc.errors())
        raise SystemExit(f"inferq submit: {where}{problems}; nothing was sent") from None
    except ValueError as exc:
        raise SystemExit(f"inferq submit: {where}{exc}; nothing was sent") from None


def submit(args: argparse.Namespace) -> int:
    from workers.cli import progress_bars as progress
    from workers.client import DeliveryFailed, JobClient

    jobs = _jobs_from_args(args)
    with JobClient() as client:
        try:
            with progress.bar(
                "submitting", len(jobs), enabled=bool(args.file) and progress.wanted()
            ) as advance:
                sent = client.submit_many(jobs, args.priority, on_delivered=lambda _s: advance(1))
        except DeliveryFailed as exc:
            print(
                f"inferq submit: {exc}; {len(exc.delivered)} of {len(jobs)} were delivered before it "
                "(submitting the same file again is safe: job_ids make it idempotent)",
                file=sys.stderr,
            )
            return 1
        for s in sent:
            print(s.job_id, file=sys.stderr if args.stream else sys.stdout)
        for s in sent:
            if args.stream:
                _print_stream(client, s.job_id, args.timeout)
            if args.wait:
                print(client.wait(s, args.timeout).model_dump_json(indent=2))
    return 0


def _print_stream(
    client, job_id: str, timeout: float, since_ms: int | None = None, tenant: str | None = None
) -> str | None:
    """Print the job's text as it comes, then its finish reason. With n > 1 samples, choice 0 is printed
    live and the others, which would interleave with it, each after it, in index order; each choice's
    text is followed by `[choice i: reason]` on stderr."""
    others: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    for event in client.stream(job_id, timeout, since_ms, tenant):
        if event.restarted:  # an attempt that could not resume (a resumed one continues the text)
            print(f"\n[attempt {event.attempt} restarts the output]", file=sys.stderr)
            others, reasons = {}, {}
        if event.index == 0:
            print(event.text, end="", flush=True)
        else:
            others.setdefault(event.index, []).append(event.text)
        if event.finish_reason:
            reasons[event.index] = event.finish_reason
        if event.final:
            _print_choices(others, reasons, event.finish_reason or "")
            return reasons.get(0, event.finish_reason)
    return None


def _print_choices(others: dict[int, list[str]], reasons: dict[int, str], job_finish: str) -> None:
    """After choice 0's live text: its reason, then every other choice's text and reason."""
    if not others:
        print(f"\n[{reasons.get(0, job_finish)}]", file=sys.stderr)
        return
    print(file=sys.stdout, flush=True)
    print(f"[choice 0: {reasons.get(0, job_finish)}]", file=sys.stderr, flush=True)
    for index in sorted(others):
        print("".join(others[index]), flush=True)
        print(f"[choice {index}: {reasons.get(index, job_finish)}]", file=sys.stderr, flush=True)


def cancel(args: argparse.Namespace) -> int:
    from workers.client import JobClient

    with JobClient() as client:
        client.cancel(args.job_id, tenant=args.tenant)
    print(f"cancel sent for {args.job_id}")
    return 0


def tail(args: argparse.Namespace) -> int:
    from workers.client import JobClient
    from workers.db.connect import make_engine
    from workers.db.job_queries import posted

    with JobClient() as client:
        db = make_engine(client.settings.database_url)
        with db.connect() as conn:
            row = posted(conn, args.job_id, args.tenant)
        if row is not None and not row[1]:
            print(f"job {args.job_id} is not streamed (`stream: false`): it has no token events; its "
                  "result is on the results topic and in `inferq jobs`", file=sys.stderr)  # fmt: skip
            return 1
        since = int(row[0].timestamp() * 1000) - 1000 if row else 0
        _print_stream(client, args.job_id, args.timeout, since, args.tenant)
    return 0


def list_jobs(args: argparse.Namespace) -> int:
    from workers.db.connect import make_engine
    from workers.db.job_queries import recent
    from workers.settings import Settings

    filters = {
        "status": args.status,
        "priority": args.priority,
        "tenant": args.tenant,
        "bulk_id": args.bulk_id,
        "model": args.model,
    }
    with make_engine(Settings.from_env().database_url).connect() as conn:
        rows = recent(conn, args.limit, ("model", "created_at", "output_text", "error"), **filters)
    if args.json:
        for r in rows:
            print(json.dumps(r, default=str))
        return 0
    print_rows(rows)
    return 0


def print_rows(rows: list[dict], width: int = 40) -> None:
    """A plain aligned table; long cells (outputs) are cut to `width` characters."""
    from workers.cli import tables

    headers = list(rows[0]) if rows else []
    print(tables.render(headers, [[r[h] for h in headers] for r in rows], width=width))


def schema(args: argparse.Namespace) -> int:
    import schemas.jobs as messages

    print(json.dumps(getattr(messages, args.name).model_json_schema(), indent=2))
    return 0
