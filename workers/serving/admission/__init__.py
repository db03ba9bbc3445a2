"""Admission: an accepted job becomes a `queued` row (fenced by attempt) before it may run; cancels.

Facade: `thread.AdmissionThread`, over an `admitter.Admitter`, which decides batches on its own thread
so the engine loop never waits for PostgreSQL; `cancels` parses control records and remembers cancels.
"""
