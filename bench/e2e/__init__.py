"""The end-to-end benchmark (`inferq bench e2e`): jobs through Kafka, a worker and PostgreSQL against
the engine alone; the backlog benchmark beside it."""
