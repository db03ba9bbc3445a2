"""Admission: an accepted job becomes a `queued` row (fenced by attempt) before it may run; cancels."""
