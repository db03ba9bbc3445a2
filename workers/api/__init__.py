"""The OpenAI-compatible HTTP API in front of the queue (`inferq api`).

`protocol` (request and response shapes), `errors` (OpenAI's error body), `auth` (bearer keys → tenants),
`serving_engine` (a request as a job: submit, wait, stream) with `serving_chat` and `serving_completion`
(each endpoint's shapes), `files` and `batches` (the Files and Batch routes), `batch_driver` (advancing
batches through the bulk path), `events` (batch lifecycle events to Kafka), `metrics`, and `app` (the
wiring). The process keeps no state of its own outside Kafka and PostgreSQL.
"""
