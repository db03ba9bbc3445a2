"""The worker side of inferq: everything between Kafka, the engine (`gpu/`) and PostgreSQL.

Packages by responsibility, lowest first; each imports only from those before it (tests/test_layers.py
checks it): `settings`, `logs`, `clock` and `naming` (the base) → `kafka_io/` (the only kafka-python
importer) and `db/` (the only SQLAlchemy/psycopg2 importer) → `client/` (for producer services) and
`services/` (local Kafka and PostgreSQL) → `serving/` (the worker pipeline) → `bulk/` (offline batches)
→ `demo/` → `cli/` (the composition root).
"""
