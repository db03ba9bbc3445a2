"""The default worker (SmolLM2-135M-Instruct) through Kafka and PostgreSQL: greedy chat and plain jobs return
exactly what HF `generate` returns for the same weights and chat template, streamed and stored alike."""

from __future__ import annotations

import pytest

from gpu.model import load_model
from gpu.model_source import DEFAULT_MODEL
from tests.gpu.factories import assert_matches_hf
from tests.workers.worker_factories import now_ms, read_topic, serving_worker, token_events, wait_terminal

pytestmark = [pytest.mark.services, pytest.mark.slow]

MAX_TOKENS = 24
CHATS = ("What is the capital of France?", "Name two uses of a message queue.")
PLAINS = ("The three primary colours are", "Kafka consumers in a group")


def test_greedy_jobs_on_the_default_worker_equal_hf_generate(settings, tmp_path):
    model = load_model(DEFAULT_MODEL, "float32", "cpu", cache_dir=settings.cache_dir)
    with serving_worker(settings, tmp_path, "w-smollm2", "--model", "smollm2") as (dep, client, db, _):
        since = now_ms()
        jobs = {}  # job_id -> the prompt's token ids, as HF would be given them
        for i, question in enumerate(CHATS):
            messages = [{"role": "user", "content": question}]
            body = {"job_id": f"chat-{i}-{dep.topic_prefix}", "messages": messages}
            sent = client.submit(body | {"temperature": 0, "max_tokens": MAX_TOKENS})
            jobs[sent.job_id] = tuple(model.tokenizer.apply_chat_template(messages))
        for i, text in enumerate(PLAINS):
            body = {"job_id": f"plain-{i}-{dep.topic_prefix}", "prompt": text}
            sent = client.submit(body | {"temperature": 0, "max_tokens": MAX_TOKENS})
            jobs[sent.job_id] = tuple(model.tokenizer.encode(text))
        client.flush()
        rows = wait_terminal(db, list(jobs), timeout_s=300)
        finals = lambda rs: sum(b'"finish_reason":"' in r.value for r in rs) >= len(jobs)  # noqa: E731
        events = token_events(read_topic(dep, dep.topics.tokens, since, finals, timeout_s=60))
        for job_id, prompt in jobs.items():
            row = rows[job_id]
            assert row["status"] == "succeeded" and row["prompt_tokens"] == len(prompt), row
            tokens = [t for e in events[job_id] for t in e.token_ids]
            assert_matches_hf(model, prompt, tokens, MAX_TOKENS)
            assert "".join(e.text for e in events[job_id]) == row["output_text"]
            assert row["output_text"] == model.tokenizer.decode(tokens) and row["output_text"].strip()
