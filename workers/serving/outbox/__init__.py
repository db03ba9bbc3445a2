"""The outbox: row writes, then results published and marked, then offsets released for committing.

Facade: `persister.Persister`, whose thread takes the write items (`writes`) the engine loop submits;
`delivery.Deliveries` sends messages until the broker has them, `result_lookup` finds results already
out, `sweeper` publishes results no live worker is publishing.
"""
