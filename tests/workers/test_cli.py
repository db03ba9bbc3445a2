"""The command line as people use it: --version, one spelling per idea (old ones hidden but working),
allowed values in --help, and `submit --file` end to end against the real broker."""

from __future__ import annotations

import json
import os
from importlib.metadata import version

import pytest

from schemas.jobs import JobRequest, TokenEvent, Usage
from schemas.statuses import JOB_STATUSES
from tests.services.factories import run_cli
from tests.workers.worker_factories import make_deployment, now_ms, read_topic
from workers.cli import build_parser
from workers.cli.jobs import _jobs_from_args, _print_stream


def test_version():
    assert run_cli("--version").stdout.strip() == f"inferq {version('inferq')}"


def test_allowed_values_are_listed_and_enforced():
    help_text = run_cli("jobs", "--help").stdout
    assert "{" + ",".join(JOB_STATUSES) + "}" in help_text.replace("\n", "").replace(" ", "")
    bad = run_cli("jobs", "--status", "done", check=False)
    assert bad.returncode == 2 and "invalid choice: 'done'" in bad.stderr
    assert "{text,json}" in run_cli("worker", "--help").stdout


@pytest.mark.parametrize(
    ("argv", "hidden", "dest", "value"),
    [
        (["submit", "x", "--wait-timeout", "5"], "--wait-timeout", "timeout", 5.0),
        (["submit", "x", "--timeout-s", "3"], "--timeout-s", "job_timeout", 3.0),
        (["bulk", "wait", "b", "--wait-timeout", "7"], "--wait-timeout", "timeout", 7.0),
        (["bulk-worker", "--loglevel", "debug"], "--loglevel", "log_level", "DEBUG"),
        (["worker", "--max-batched-tokens", "64"], "--max-batched-tokens", "max_num_batched_tokens", 64),
        (["worker", "--no-prefix-caching"], "--no-prefix-caching", "enable_prefix_caching", False),
    ],
)
def test_old_spellings_still_work_but_are_not_shown(argv, hidden, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value
    verb = argv[:2] if argv[0] == "bulk" else argv[:1]
    assert hidden not in run_cli(*verb, "--help").stdout


def test_one_spelling_per_idea_in_help():
    for verb in (["submit"], ["tail"], ["bulk", "wait"]):
        text = run_cli(*verb, "--help").stdout
        assert "--timeout SECONDS" in text and "--wait-timeout" not in text
    assert "--job-timeout SECONDS" in run_cli("submit", "--help").stdout
    for verb in (["worker"], ["bulk-worker"], ["run-batch"]):
        text = run_cli(*verb, "--help").stdout
        assert "--log-level" in text and "--loglevel" not in text and "--log-format" in text


@pytest.mark.services
def test_submit_file_sends_every_line_confirmed_or_nothing(settings, tmp_path):
    dep = make_deployment(settings)
    env = {**os.environ, "INFERQ_TOPIC_PREFIX": dep.topic_prefix, "INFERQ_KAFKA": dep.kafka}
    lines = [{"job_id": f"file-{dep.topic_prefix}-{i}", "prompt": f"line {i}"} for i in range(5)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps(lines[0]), "", json.dumps({"prompt": "x", "colour": "red"})]))
    refused = run_cli("submit", "--file", str(bad), env=env, check=False)
    assert refused.returncode == 1 and "line 3: colour: Extra inputs" in refused.stderr
    assert "nothing was sent" in refused.stderr
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    since = now_ms()
    options = ("--priority", "low", "--tenant", "acme", "--job-timeout", "60")
    done = run_cli("submit", "--file", str(good), *options, env=env)
    assert done.stdout.split() == [line["job_id"] for line in lines]
    records = read_topic(dep, dep.topics.jobs("low"), since, lambda rs: len(rs) >= 5, timeout_s=30)
    sent = sorted((JobRequest.model_validate_json(r.value) for r in records), key=lambda j: j.job_id)
    assert [j.job_id for j in sent] == sorted(line["job_id"] for line in lines)  # nothing from bad.jsonl
    assert {(j.tenant, j.timeout_s) for j in sent} == {("acme", 60.0)}


class _Events:
    """Stands in for JobClient.stream: the events a worker sends for one job (printing is what is tested)."""

    def __init__(self, events: list[TokenEvent]) -> None:
        self.events = events

    def stream(self, job_id, timeout, since_ms=None, tenant=None):
        for event in self.events:
            yield event
            if event.final:
                return


def token_event(
    seq: int, index: int, text: str, finish: str | None = None, usage: bool = False
) -> TokenEvent:
    total = Usage(prompt_tokens=2, completion_tokens=4) if usage else None
    return TokenEvent(job_id="j", attempt=1, seq=seq, text=text, token_ids=[seq], index=index,
                      finish_reason=finish, usage=total)  # fmt: skip


def test_streamed_samples_are_printed_apart_each_with_its_reason(capsys):
    events = [token_event(0, 0, "Hel"), token_event(1, 1, "Wor"), token_event(2, 0, "lo", "stop"),
              token_event(3, 1, "ld", "length", usage=True)]  # fmt: skip
    assert _print_stream(_Events(events), "j", 1.0) == "stop"
    out, err = capsys.readouterr()
    assert out == "Hello\nWorld\n"
    assert err == "[choice 0: stop]\n[choice 1: length]\n"


def test_one_streamed_sample_prints_as_before(capsys):
    events = [token_event(0, 0, "Hel"), token_event(1, 0, "lo", "stop", usage=True)]
    assert _print_stream(_Events(events), "j", 1.0) == "stop"
    assert capsys.readouterr() == ("Hello", "\n[stop]\n")


def test_submit_flags_set_the_generation_options(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    argv = ["submit", "hi", "--n", "2", "--logprobs", "--top-logprobs", "3",
            "--json-schema", f"@{tmp_path}/s.json", "--presence-penalty", "0.5", "--frequency-penalty", "-1",
            "--repetition-penalty", "1.2",
            "--logit-bias", '{"198": -100}']  # fmt: skip
    (job,) = _jobs_from_args(build_parser().parse_args(argv))
    assert (job.n, job.logprobs, job.top_logprobs) == (2, True, 3)
    assert job.response_format.json_schema.json_schema == schema
    assert (job.presence_penalty, job.frequency_penalty, job.repetition_penalty) == (0.5, -1.0, 1.2)
    assert job.logit_bias == {"198": -100.0}
    (choice,) = _jobs_from_args(build_parser().parse_args(["submit", "hi", "--guided-choice", "yes",
                                                           "--guided-choice", "no"]))  # fmt: skip
    assert choice.guided_choice == ["yes", "no"] and choice.n == 1 and not choice.logprobs
    (regex,) = _jobs_from_args(
        build_parser().parse_args(
            ["submit", "hi", "--guided-regex", "[0-9]+", "--response-format", '{"type": "text"}']
        )  # fmt: skip
    )
    assert regex.guided_regex == "[0-9]+" and regex.response_format.type == "text"
    with pytest.raises(SystemExit, match="not both"):
        _jobs_from_args(build_parser().parse_args(["submit", "hi", "--json-schema", "{}", "--response-format",
                                                   '{"type": "json_object"}']))  # fmt: skip
    with pytest.raises(SystemExit, match="n: Input should be less than or equal to 16"):
        _jobs_from_args(build_parser().parse_args(["submit", "hi", "--n", "17"]))


def test_worker_tenant_topics_flag_overrides_the_environment_only_when_given():
    parse = build_parser().parse_args
    assert parse(["worker"]).tenant_topics is None  # INFERQ_TENANT_TOPICS decides
    assert parse(["worker", "--tenant-topics"]).tenant_topics is True
    assert parse(["worker", "--no-tenant-topics"]).tenant_topics is False
    assert parse(["worker", "--async-scheduling"]).async_scheduling is True
    assert parse(["worker"]).async_scheduling is False
