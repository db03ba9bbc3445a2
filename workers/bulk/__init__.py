"""Offline bulk generation: OpenAI Batch files in, jobs through Kafka, Batch output files out (Celery)."""
