"""The OpenAI-compatible HTTP API in front of the queue (`inferq api`).

`protocol` (request and response shapes), `errors` (OpenAI's error body, `x-should-retry`), `auth` (bearer
keys → tenants, their caches), `limits` (429s), `request_body` and `uploads` (bounded bodies, streamed
uploads), `serving_engine` (a request as a job: post or reattach, wait, stream) with `serving_chat` and
`serving_completion` (each endpoint's shapes), `job_watch` (waiting for a job on the event loop), `retries`
(Idempotency-Key, the SDKs' own retries), `sse` (the streaming response), `fleet` (the models the workers
announce), `files` and `batches` (the Files and Batch routes), `batch_driver` (advancing batches through the
bulk path, fairly, in bounded memory), `events` (batch lifecycle events to Kafka), `metrics`, `context` (what
the routes share) and `app` (the wiring). One event loop waits for every request; the process keeps no state
of its own outside Kafka and PostgreSQL.
"""
