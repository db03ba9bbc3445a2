"""LoRA adapters through `inferq api` and the `openai` SDK: /v1/models lists the base and the adapters the
key's tenant may use (`parent` = the base, as vLLM lists them); requests and Batch lines name an adapter in
`model`; another tenant's adapter is `404 model_not_found`, as an unknown model."""

from __future__ import annotations

import json

import openai
import pytest
from sqlalchemy import create_engine, select

from gpu.model import load_model
from schemas.tables import jobs
from tests.api.api_factories import MODEL, cli, wait_batch
from tests.api.test_api_batches import upload
from tests.gpu.lora_factories import make_adapter

pytestmark = [pytest.mark.services, pytest.mark.slow]

SHARED, PRIVATE = "house-style", "acme/extract"


@pytest.fixture(scope="module")
def registered(served, tmp_path_factory):
    """A shared adapter and acme's own, PEFT-made for the worker's tiny model, in the API's registry."""
    dep = served[0]
    tiny = load_model("tiny", "float32", "cpu", 0)
    directory = tmp_path_factory.mktemp("api-adapters")
    shared, _ = make_adapter(tiny, directory, "shared", seed=1)
    private, _ = make_adapter(tiny, directory, "private", seed=2)
    for args in ((SHARED, shared.path), (PRIVATE, private.path, "--tenant", "acme")):
        done = cli(dep, "adapter", "add", *args)
        assert done.returncode == 0, done.stderr
    yield
    for name in (SHARED, PRIVATE):
        cli(dep, "adapter", "remove", name)


def test_models_list_the_base_and_the_adapters_the_tenant_may_use(served, registered):
    _, api, keys = served
    acme, globex = api.client(keys["acme"]), api.client(keys["globex"])
    listed = {m.id: m for m in acme.models.list()}
    assert list(listed) == [MODEL, PRIVATE, SHARED]
    assert [listed[n].model_extra["parent"] for n in (PRIVATE, SHARED)] == [MODEL, MODEL]
    assert "root" not in listed[PRIVATE].model_extra  # an adapter's directory is never shown
    assert [m.id for m in globex.models.list()] == [MODEL, SHARED]
    assert acme.models.retrieve(PRIVATE).id == PRIVATE  # a name with a '/' in the path
    with pytest.raises(openai.NotFoundError) as caught:
        globex.models.retrieve(PRIVATE)
    assert caught.value.body["code"] == "model_not_found"


def test_a_request_runs_on_the_adapter_it_names_and_another_tenants_is_not_found(served, registered):
    dep, api, keys = served
    acme, globex = api.client(keys["acme"]), api.client(keys["globex"])
    asked = dict(prompt="Once upon a time", max_tokens=12, temperature=0)
    on_adapter = acme.completions.create(model=PRIVATE, **asked)
    on_base = acme.completions.create(model=MODEL, **asked)
    assert on_adapter.model == PRIVATE and on_base.model == MODEL
    assert on_adapter.choices[0].text != on_base.choices[0].text  # its weights changed the output
    db = create_engine(dep.database_url)
    try:
        with db.connect() as conn:
            query = select(jobs.c.job_id, jobs.c.model).where(jobs.c.job_id.in_([on_adapter.id, on_base.id]))
            models = dict(conn.execute(query).all())
    finally:
        db.dispose()
    assert models == {on_adapter.id: PRIVATE, on_base.id: MODEL}  # the worker's name for its base
    with pytest.raises(openai.NotFoundError) as caught:
        globex.chat.completions.create(model=PRIVATE, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found" and PRIVATE in caught.value.body["message"]


def test_batch_lines_name_adapters_and_another_tenants_fails_validation(served, registered):
    _, api, keys = served
    acme, globex = api.client(keys["acme"]), api.client(keys["globex"])
    lines = [
        {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": f"line {i}", "max_tokens": 4, "temperature": 0}}
        for i, model in enumerate((PRIVATE, MODEL, SHARED))
    ]  # fmt: skip
    batch = acme.batches.create(input_file_id=upload(acme, lines), endpoint="/v1/completions",
                                completion_window="24h")  # fmt: skip
    batch = wait_batch(acme, batch.id, ("completed", "failed"))
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    output = [json.loads(line) for line in acme.files.content(batch.output_file_id).text.splitlines()]
    assert [o["response"]["body"]["model"] for o in output] == [PRIVATE, MODEL, SHARED]

    theirs = globex.batches.create(input_file_id=upload(globex, lines), endpoint="/v1/completions",
                                   completion_window="24h")  # fmt: skip
    theirs = wait_batch(globex, theirs.id, ("completed", "failed"))
    assert theirs.status == "failed"
    assert [(e.code, e.line) for e in theirs.errors.data] == [("model_not_found", 1)]
