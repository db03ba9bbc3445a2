"""A front door that holds (issue 40, item 4): requests waiting for slow jobs hold no thread (`/health` and
another tenant's small request answer beside 200 of them), bodies and uploads are bounded however they
arrive (a chunked 300 MiB upload is refused with 413 while the process stays small), files are stored and
read in chunks, listings refuse a cursor they do not know, bad keys are refused by address after a few."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx2 as httpx
import openai
import psutil
import pytest
from sqlalchemy import create_engine, text

from tests.api.api_factories import MODEL, cli, create_key, start_api, wait_models
from tests.workers.worker_factories import make_deployment, start_worker

pytestmark = [pytest.mark.services, pytest.mark.slow]

MiB = 1024 * 1024


class PeakRSS:
    """The largest resident set of a process while the block runs (sampled every 20 ms)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self._stop.wait(0.02)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _multipart(boundary: str, size: int, fields: dict[str, str] | None = None):
    """A multipart body streamed as it is made (sent chunked: no Content-Length), its file `size` bytes."""
    for name, value in (fields or {"purpose": "batch"}).items():
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    yield (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
           "Content-Type: application/jsonl\r\n\r\n").encode()  # fmt: skip
    line = b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}\n'
    block = line * (MiB // len(line))
    sent = 0
    while sent < size:
        part = block[: size - sent]
        sent += len(part)
        yield part
    yield f"\r\n--{boundary}--\r\n".encode()


def test_200_slow_requests_leave_health_and_another_tenant_answering(settings, api_database, tmp_path):
    """Each of 200 requests waits for a job of hundreds of tokens; meanwhile `/health` answers and a small
    request of another tenant gets its answer (the worker's tenant fairness runs it ahead of the queue):
    a process that held a thread per request (40 of them) kept both waiting behind the 200."""
    dep = make_deployment(dataclasses.replace(settings, database_url=api_database))
    worker = start_worker(dep, tmp_path, "w-front-door", "--served-model-name", MODEL)
    api = start_api(dep, tmp_path)
    try:
        acme, globex = create_key(dep, "acme"), create_key(dep, "globex")
        wait_models(api, acme, [MODEL])

        async def load() -> tuple[int, int, list]:
            limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
            async with httpx.AsyncClient(timeout=600, limits=limits) as http:

                async def slow(i: int):
                    body = {
                        "model": MODEL,
                        "prompt": f"slow {i}",
                        "max_tokens": 400,
                        "logit_bias": {"2": -100},
                    }
                    try:
                        answer = await http.post(f"{api.base_url}/v1/completions", json=body,
                                                 headers={"Authorization": f"Bearer {acme}"})  # fmt: skip
                        return answer.status_code
                    except httpx.HTTPError as exc:
                        return repr(exc)

                waiting = [asyncio.create_task(slow(i)) for i in range(200)]
                await asyncio.sleep(5)  # all 200 posted and waiting
                health = await http.get(f"{api.base_url}/health", timeout=30)
                small = await http.post(
                    f"{api.base_url}/v1/completions", timeout=120,
                    json={"model": MODEL, "prompt": "small", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {globex}"},
                )  # fmt: skip
                still = sum(not task.done() for task in waiting)
                for task in waiting:  # leave: their jobs are cancelled
                    task.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)
                return health.status_code, small.status_code, still

        health, small, still = asyncio.run(load())
        assert (health, small) == (200, 200)
        assert still > 100  # most of the 200 were still waiting when both were answered
    finally:
        assert api.stop() == 0, api.output()[-3000:]
        assert worker.stop() == 0, worker.output()[-3000:]


def test_a_chunked_300_mib_upload_is_refused_with_413_while_the_process_stays_small(served):
    _, api, keys = served
    boundary = "inferq-test-boundary"
    headers = {
        "Authorization": f"Bearer {keys['acme']}",
        "Content-Type": f"multipart/form-data; boundary={boundary}",
    }
    with PeakRSS(api.proc.pid) as rss:
        body = _multipart(boundary, 300 * MiB)
        answer = httpx.post(f"{api.base_url}/v1/files", headers=headers, content=body, timeout=600)
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["code"] == "file_too_large" and answer.headers["x-should-retry"] == "false"
    assert rss.peak < 500 * MiB, f"peak RSS {rss.peak / MiB:.0f} MiB"
    # stored as it came, a chunk at a time: the 200 MiB it took before refusing never sat in memory
    assert rss.peak - rss.start < 128 * MiB, f"grew {(rss.peak - rss.start) / MiB:.0f} MiB"
    assert "big.jsonl" not in [f.filename for f in api.client(keys["acme"]).files.list()]  # nothing kept


def test_bodies_past_the_limit_are_refused_however_they_arrive(served, tmp_path):
    dep, _, keys = served
    api = start_api(dep, tmp_path, INFERQ_API_MAX_BODY_BYTES="4096", INFERQ_API_MAX_FILE_BYTES="8192")
    headers = {"Authorization": f"Bearer {keys['acme']}", "Content-Type": "application/json"}

    def body(size: int) -> bytes:
        return b'{"model": "%s", "prompt": "%s", "max_tokens": 2}' % (MODEL.encode(), b"x" * size)

    try:
        with httpx.Client(timeout=60) as http:
            url = f"{api.base_url}/v1/completions"
            declared = http.post(url, headers=headers, content=body(8000))
            chunked = http.post(url, headers=headers, content=iter([body(8000)[:100], body(8000)[100:]]))
            ok = http.post(url, headers=headers, content=iter([body(1000)[:100], body(1000)[100:]]))
            form = {**headers, "Content-Type": "multipart/form-data; boundary=b"}
            upload = http.post(f"{api.base_url}/v1/files", content=_multipart("b", 9000), headers=form)
        assert [declared.status_code, chunked.status_code] == [413, 413]
        assert declared.json()["error"]["code"] == "request_too_large"
        assert ok.status_code == 200
        assert upload.status_code == 413 and upload.json()["error"]["code"] == "file_too_large"
    finally:
        assert api.stop() == 0, api.output()[-3000:]


def test_files_are_stored_in_chunks_and_read_back_whole(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    line = b'{"custom_id": "c%d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}\n'
    content = b"".join(line % i for i in range(int(2.5 * MiB) // len(line)))
    stored = client.files.create(file=("chunks.jsonl", content), purpose="batch")
    assert stored.bytes == len(content)
    db = create_engine(dep.database_url)
    try:
        with db.connect() as conn:
            sizes = conn.execute(
                text("SELECT length(data) FROM api_file_chunks WHERE file_id = :f ORDER BY seq"),
                {"f": stored.id},
            ).scalars().all()  # fmt: skip
    finally:
        db.dispose()
    assert sizes[:-1] == [MiB, MiB] and sum(sizes) == len(content)
    assert client.files.content(stored.id).read() == content


def test_an_unknown_cursor_is_an_error_not_a_listing_from_the_start(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    for listing in (
        lambda: client.files.list(after="file-nosuchfile"),
        lambda: client.batches.list(after="batch_x"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            listing()
        assert caught.value.body["param"] == "after" and caught.value.body["code"] == "invalid_cursor"
    other = api.client(keys["globex"]).files.create(file=("o.jsonl", b'{"a": 1}\n'), purpose="batch")
    with pytest.raises(openai.BadRequestError):  # another tenant's id is not a cursor of this one
        client.files.list(after=other.id)


def test_bad_keys_are_refused_by_address_after_a_few(served, tmp_path):
    """Past its allowance an address is refused (429) before any key of its is looked up; another address
    is not (127.0.0.2 reaches the same server: the loopback network)."""
    dep, _, keys = served
    api = start_api(dep, tmp_path, INFERQ_API_BAD_KEY_RPM="3")

    def client(key: str, address: str) -> openai.OpenAI:
        http = httpx.Client(transport=httpx.HTTPTransport(local_address=address))
        return openai.OpenAI(base_url=f"{api.base_url}/v1", api_key=key, max_retries=0, http_client=http)

    def status(call) -> int:
        try:
            call()
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    try:
        codes = [status(client(f"iq-guess-{i}", "127.0.0.1").models.list) for i in range(5)]
        assert codes == [401, 401, 401, 429, 429]
        assert status(client(keys["acme"], "127.0.0.2").models.list) == 200
        assert status(client("iq-guess-again", "127.0.0.2").models.list) == 401
    finally:
        assert api.stop() == 0, api.output()[-3000:]


def test_a_key_is_refused_for_a_tenant_no_job_could_name(served):
    dep, _, _ = served
    for tenant in ("", "t" * 129):
        done = cli(dep, "api-key", "create", "--tenant", tenant)
        assert done.returncode == 2 and "tenant" in done.stderr, done.stderr
