"""Local Kafka + PostgreSQL for development and CI: start, stop, health, topics, migrations.

`manager` is the entry point (`up`, `down`, `status`); the other modules each own one piece:
`paths` (where state lives), `process` (pid files, spawning, stopping), `tools` (finding binaries),
`kafka_jars` (Maven fetch), `kafka`, `postgres`. Topics are made through `kafka_io.admin`, migrations
through `db.migrate`.
"""
