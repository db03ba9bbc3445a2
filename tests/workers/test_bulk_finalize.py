"""Writing Batch output and errors files in input order (no services: rows come from a dict)."""

from __future__ import annotations

from datetime import UTC, datetime

from tests.workers.bulk_factories import CHAT, batch_line, read_jsonl, write_batch
from workers.bulk.batch_format import job_id_for, read_batch
from workers.bulk.finalize import write_results

BULK = "bulk-t"
AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def row(custom_id: str, status: str = "succeeded", **values) -> dict:
    base = {"job_id": job_id_for(BULK, custom_id), "status": status, "output_text": f"out {custom_id}",
            "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 4, "error": None,
            "created_at": AT, "finished_at": AT}  # fmt: skip
    return base | values


def lookup_from(rows: list[dict], calls: list[int] | None = None):
    by_id = {r["job_id"]: r for r in rows}

    def lookup(ids: list[str]) -> dict:
        if calls is not None:
            calls.append(len(ids))
        return {i: by_id[i] for i in ids if i in by_id}

    return lookup


def test_outputs_follow_input_order_and_split_successes_from_errors(tmp_path):
    lines = [
        batch_line("c"),
        batch_line("a", CHAT),
        "{bad",
        batch_line("b"),
        batch_line("d"),
        batch_line("e"),
    ]
    path = write_batch(tmp_path / "in.jsonl", lines)
    rows = [row("c"), row("a", output_text="chat answer", finish_reason="stop"),
            row("b", "failed", error="engine exploded"), row("d", "expired")]  # fmt: skip
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    counts = write_results(read_batch(path), BULK, lookup_from(rows), out, err, unfinished_code="cancelled")
    assert (counts.succeeded, counts.failed, counts.invalid, counts.unfinished) == (2, 2, 1, 1)

    ok = read_jsonl(out)
    assert [o["custom_id"] for o in ok] == ["c", "a"]
    completion, chat = ok[0]["response"], ok[1]["response"]
    assert completion["status_code"] == 200 and ok[0]["error"] is None
    assert completion["body"]["object"] == "text_completion"
    assert completion["body"]["choices"][0] == {"index": 0, "text": "out c", "logprobs": None,
                                                "finish_reason": "length"}  # fmt: skip
    assert completion["body"]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    assert completion["body"]["model"] == "tiny" and completion["request_id"] == "bulk-t:c"
    assert chat["body"]["choices"][0]["message"] == {"role": "assistant", "content": "chat answer"}

    errors = read_jsonl(err)
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        (None, "invalid_request", 3), ("b", "failed", 4), ("d", "expired", 5), ("e", "cancelled", 6),
    ]  # fmt: skip
    assert errors[1]["error"]["message"] == "engine exploded" and errors[1]["response"] is None
    assert errors[0]["error"]["message"].startswith("line 3: not JSON")


def test_rows_are_looked_up_a_chunk_at_a_time(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", [batch_line(f"r{i}") for i in range(25)])
    calls: list[int] = []
    rows = [row(f"r{i}") for i in range(25)]
    counts = write_results(read_batch(path), BULK, lookup_from(rows, calls), tmp_path / "o", tmp_path / "e",
                           chunk=10)  # fmt: skip
    assert calls == [10, 10, 5] and counts.succeeded == 25
    assert [o["custom_id"] for o in read_jsonl(tmp_path / "o")] == [f"r{i}" for i in range(25)]


def test_a_rerun_replaces_the_files(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", [batch_line("a"), batch_line("b")])
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_results(read_batch(path), BULK, lookup_from([row("a")]), out, err)
    write_results(read_batch(path), BULK, lookup_from([row("a"), row("b")]), out, err)
    assert [o["custom_id"] for o in read_jsonl(out)] == ["a", "b"] and read_jsonl(err) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["err.jsonl", "in.jsonl", "out.jsonl"]


def test_a_job_the_worker_refused_is_an_invalid_line_as_run_batch_reports_it(tmp_path):
    """Refused before running (attempts 0: a logit_bias id past the vocabulary, found only by the model's
    worker): `invalid_request`, `line N:`, no id, counted invalid. A job that ran and ended `rejected` (a
    grammar's dead end) stays a failed request."""
    path = write_batch(tmp_path / "in.jsonl", [batch_line("oov"), batch_line("dead"), batch_line("ok")])
    refused = "logit_bias names token 60000; this model's vocabulary has 49152 tokens (ids 0-49151)"
    rows = [row("oov", "rejected", error=refused, attempts=0, output_text=None),
            row("dead", "rejected", error="the output constraint allows no token here", attempts=1),
            row("ok", attempts=1)]  # fmt: skip
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    counts = write_results(read_batch(path), BULK, lookup_from(rows), out, err)
    assert (counts.succeeded, counts.failed, counts.invalid, counts.unfinished) == (1, 1, 1, 0)
    oov, dead = read_jsonl(err)
    error = {"code": "invalid_request", "message": f"line 1: {refused}", "line": 1}
    assert oov == {"id": None, "custom_id": "oov", "response": None, "error": error}
    assert dead["error"]["code"] == "rejected" and dead["id"] == f"batch_req_{job_id_for(BULK, 'dead')}"


def test_an_adapter_answers_by_its_name_the_base_by_the_served_name(tmp_path):
    lines = [
        batch_line("ad", model="acme/extract"),
        batch_line("alias", model="base-alias"),
        batch_line("none"),
    ]
    path = write_batch(tmp_path / "in.jsonl", lines)
    # the rows keep the model that served each job: the adapter's name, or the base's (first) served name
    rows = [row("ad", model="acme/extract"), row("alias", model="served-x"), row("none", model="served-x")]
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_results(read_batch(path), BULK, lookup_from(rows), out, err, model_name="served-x")
    models = {o["custom_id"]: o["response"]["body"]["model"] for o in read_jsonl(out)}
    assert models == {"ad": "acme/extract", "alias": "served-x", "none": "served-x"}
