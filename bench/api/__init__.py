"""Benchmarks of the HTTP API (`inferq api`)."""
