"""`inferq run-batch`: an OpenAI Batch file through the engine in-process (no Kafka, no PostgreSQL)."""

from __future__ import annotations

import json

from tests.gpu.factories import make_engine
from tests.services.factories import run_cli
from tests.workers.bulk_factories import CHAT, batch_line, write_batch
from workers.bulk.batch_format import read_batch
from workers.bulk.run_batch import BatchRunner, Tally

# Fields OpenAI and vLLM clients send that change nothing here: the file must run as it is.
NEUTRAL = {"n": 1, "logprobs": False, "user": "u", "presence_penalty": 0, "stream": False,
           "stream_options": {"include_usage": True}}  # fmt: skip


def lines(model: str) -> list:
    """Lines naming `model`, the served model's name (a line naming another is refused: see below)."""
    return [
        batch_line("first", max_tokens=5, model=model, **NEUTRAL),
        batch_line("chat", CHAT, max_tokens=3, frequency_penalty=0.0, model=model),
        batch_line("bad", n=17, model=model),
        batch_line("long", prompt="x" * 3000, max_tokens=2, model=model),  # over the context (512 or 2048)
        "{not json",
        *[batch_line(f"more-{i}", max_tokens=2 + i, model=model if i % 2 else None) for i in range(4)],
    ]


def test_answers_come_in_input_order_with_the_served_model_name(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", lines("served-x"))
    runner = BatchRunner(make_engine(max_num_seqs=2), "served-x", window=2)  # lines overtake each other
    told = []
    answers = list(runner.run(read_batch(path), on_answer=told.append))
    assert len(told) == len(answers) == 9
    assert [a[0]["custom_id"] for a in answers] == [
        "first", "chat", "bad", "long", None, "more-0", "more-1", "more-2", "more-3"
    ]  # fmt: skip
    by_id = {a[0]["custom_id"]: a for a in answers}
    for custom_id in ("first", "chat", "more-0", "more-3"):
        line, ok = by_id[custom_id]
        body = line["response"]["body"]
        assert ok and body["model"] == "served-x" and line["error"] is None
        assert body["usage"]["completion_tokens"] <= 5
    assert by_id["first"][0]["response"]["body"]["object"] == "text_completion"
    assert by_id["chat"][0]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    bad, ok = by_id["bad"]
    assert (
        not ok
        and bad["id"] is None
        and "n: Input should be less than or equal to 16" in bad["error"]["message"]
    )
    long, ok = by_id["long"]  # what only the model can tell is an invalid line too, as bulk reports it
    assert not ok and long["id"] is None and long["error"]["code"] == "invalid_request"
    assert long["error"]["message"].startswith("line 4: prompt is") and "context" in long["error"]["message"]
    tally = Tally()
    for answer in answers:
        tally.add(answer)
    assert (tally.succeeded, tally.failed, tally.invalid) == (6, 0, 3)


def test_the_command_writes_the_output_and_errors_files(tmp_path):
    path = write_batch(tmp_path / "in.jsonl", lines("my-model"))
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    done = run_cli("run-batch", "-i", str(path), "-o", str(out), "--errors-file", str(err),
                   "--model", "tiny", "--served-model-name", "my-model")  # fmt: skip
    assert "6 succeeded, 0 failed, 3 invalid lines" in done.stderr
    ok = [json.loads(line) for line in out.read_text().splitlines()]
    errors = [json.loads(line) for line in err.read_text().splitlines()]
    assert [o["custom_id"] for o in ok] == ["first", "chat", "more-0", "more-1", "more-2", "more-3"]
    assert {o["response"]["body"]["model"] for o in ok} == {"my-model"}
    assert [e["custom_id"] for e in errors] == ["bad", "long", None]
    assert not list(tmp_path.glob("*.tmp"))
    missing = run_cli("run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o", str(out), check=False)
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_lines_name_the_base_or_a_lora_module_and_another_model_is_an_invalid_line(tmp_path):
    from gpu.model import load_model
    from tests.gpu.lora_factories import make_adapter

    tiny = load_model("tiny", "float32", "cpu", 0)
    adapter, _ = make_adapter(tiny, tmp_path, "extract", seed=1)
    same = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    path = write_batch(tmp_path / "in.jsonl", [
        batch_line("base", model="tiny", **same), batch_line("adapter", model="acme/extract", **same),
        batch_line("other", model="gpt-4o", **same),
    ])  # fmt: skip
    out = tmp_path / "out.jsonl"
    done = run_cli("run-batch", "-i", str(path), "-o", str(out), "--model", "tiny",
                   "--lora-modules", f"acme/extract={adapter.path}")  # fmt: skip
    assert "2 succeeded, 0 failed, 1 invalid lines" in done.stderr
    by_id = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    base, tuned = by_id["base"]["response"]["body"], by_id["adapter"]["response"]["body"]
    assert (base["model"], tuned["model"]) == ("tiny", "acme/extract")
    assert base["choices"][0]["text"] != tuned["choices"][0]["text"]  # the adapter's weights ran
    assert by_id["other"]["error"]["message"] == (
        "line 3: the model 'gpt-4o' does not exist: this run serves tiny, acme/extract"
    )
    bad = run_cli("run-batch", "-i", str(path), "-o", str(out), "--model", "tiny",
                  "--lora-modules", f"tiny={adapter.path}", check=False)  # fmt: skip
    assert bad.returncode == 2 and "'tiny' is a name of the served base model" in bad.stderr
