"""The outbox: row writes, then results published and marked, then offsets released for committing."""
