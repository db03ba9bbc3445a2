"""The client for producer services: submit jobs, cancel them, stream their tokens, wait for results.

A light import (no torch, no Celery): `job_client` holds `JobClient`; `stream_hub` is its one consumer of
the tokens and results topics, shared by every job the client follows.
"""

from workers.client.job_client import DeliveryFailed, JobClient, JobTimeout, Submitted

__all__ = ["DeliveryFailed", "JobClient", "JobTimeout", "Submitted"]
