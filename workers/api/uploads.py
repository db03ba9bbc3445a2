"""A multipart upload (`POST /v1/files`) stored as it arrives: the body is parsed as a stream, the file part's
bytes go to PostgreSQL a chunk (FILE_CHUNK_BYTES) at a time, and the size limit is enforced on the bytes
themselves, so a body of any size, with or without a Content-Length, costs at most a chunk of memory and is
refused (413) as soon as it passes the limit. The file is invisible (`uploading`) until the whole body has
been read; a refused or broken upload is removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from schemas.tables import FILE_CHUNK_BYTES
from workers.api.context import APIContext
from workers.api.errors import APIError
from workers.api.request_body import bounded_stream, too_large
from workers.db import api_files

FORM_OVERHEAD = 64 * 1024  # multipart headers and the other fields, beyond the file itself
MAX_FIELD_BYTES = 4096  # a form field other than the file (purpose, ...)
MAX_FIELDS = 8


class FileSink:
    """A file being written: bytes in, chunks of exactly FILE_CHUNK_BYTES out to the database."""

    def __init__(self, ctx: APIContext, tenant: str, purpose: str, filename: str) -> None:
        self.ctx, self.tenant, self.purpose, self.filename = ctx, tenant, purpose, filename
        self.file_id: str | None = None
        self.size = 0
        self._seq = 0
        self._pending = bytearray()

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        self._pending += data
        while len(self._pending) >= FILE_CHUNK_BYTES:
            chunk = bytes(self._pending[:FILE_CHUNK_BYTES])
            del self._pending[:FILE_CHUNK_BYTES]
            await self._store(chunk)

    async def finish(self) -> dict[str, Any]:
        """The file complete and visible; its metadata."""
        if self._pending or self._seq == 0:
            await self._store(bytes(self._pending))
            self._pending.clear()
        file_id, size = self.file_id, self.size

        def done() -> dict[str, Any]:
            with self.ctx.db.begin() as conn:
                return dict(api_files.finish(conn, file_id, size))

        return await self.ctx.run_db(done)

    async def discard(self) -> None:
        if self.file_id is None:
            return
        file_id = self.file_id

        def drop() -> None:
            with self.ctx.db.begin() as conn:
                api_files.discard(conn, file_id)

        await self.ctx.run_db(drop)

    async def _store(self, chunk: bytes) -> None:
        if self.file_id is None:

            def begin() -> str:
                with self.ctx.db.begin() as conn:
                    return api_files.begin(conn, self.tenant, self.purpose, self.filename)

            self.file_id = await self.ctx.run_db(begin)
        file_id, seq = self.file_id, self._seq

        def append() -> None:
            with self.ctx.db.begin() as conn:
                api_files.append(conn, file_id, seq, chunk)

        await self.ctx.run_db(append)
        self._seq += 1


@dataclass
class _Part:
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)  # a field's value (files go to the sink)
    headers: dict[bytes, bytes] = field(default_factory=dict)


@dataclass
class Upload:
    """What the form carried: its fields, and the stored file (None when there was no file part)."""

    fields: dict[str, str]
    file: dict[str, Any] | None
    filename: str | None


async def receive_upload(request: Request, ctx: APIContext, tenant: str) -> Upload:
    """Parse the multipart body as it arrives, storing its one file part; 413 past the file limit."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise APIError(400, "Expected a multipart/form-data body with a boundary", code="invalid_request")
    limit = ctx.max_file_bytes
    file_too_large = too_large(limit, "file", "file_too_large", "file")
    fields: dict[str, str] = {}
    events: list[tuple[str, Any]] = []
    part = _Part()
    header_name, header_value = bytearray(), bytearray()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        part.headers[bytes(header_name).lower()] = bytes(header_value)
        header_name.clear()
        header_value.clear()

    def on_headers_finished() -> None:
        _, options = parse_options_header(part.headers.get(b"content-disposition", b""))
        part.name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" in options:
            part.filename = options[b"filename"].decode("utf-8", "replace")
            events.append(("file", part.filename))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part.filename is not None:
            events.append(("data", data[start:end]))
        else:
            part.data.extend(data[start:end])
            if len(part.data) > MAX_FIELD_BYTES:
                raise APIError(400, f"The form field {part.name!r} is too long", code="invalid_request")

    def on_part_end() -> None:
        nonlocal part
        if part.filename is None:
            if len(fields) >= MAX_FIELDS:
                raise APIError(400, "Too many form fields", code="invalid_request")
            fields[part.name] = part.data.decode("utf-8", "replace")
        part = _Part()

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field, "on_header_value": on_header_value,
            "on_header_end": on_header_end, "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data, "on_part_end": on_part_end,
        },
    )  # fmt: skip
    sink: FileSink | None = None
    try:
        async for chunk in bounded_stream(request, limit + FORM_OVERHEAD, file_too_large):
            parser.write(chunk)
            for kind, value in events:
                if kind == "file":
                    if sink is not None:
                        raise APIError(400, "Only one file may be uploaded at a time", param="file")
                    purpose = fields.get("purpose", "batch")
                    sink = FileSink(ctx, tenant, purpose, value or "upload.jsonl")
                    continue
                assert sink is not None
                if sink.size + len(value) > limit:
                    raise file_too_large
                await sink.write(value)
            events.clear()
        parser.finalize()
        if sink is None:
            return Upload(fields, None, None)
        if sink.size == 0:
            raise APIError(400, "The file is empty", param="file", code="empty_file")
        return Upload(fields, await sink.finish(), sink.filename)
    except MultipartParseError as exc:
        if sink is not None:
            await sink.discard()
        raise APIError(400, f"The multipart body is malformed: {exc}", code="invalid_request") from None
    except BaseException:
        if sink is not None:
            await sink.discard()
        raise
