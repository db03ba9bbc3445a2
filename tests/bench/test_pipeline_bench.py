"""The pipeline benchmark's whole-machine figures: CPU per job of every process, and the ceiling they set."""

from __future__ import annotations

import pytest

from bench.pipeline import machine_share, render


def test_the_machine_ceiling_is_every_core_busy_at_the_measured_cost_per_job():
    # 2 cores; 5.2 s of CPU for 8,000 jobs in 4 s: 0.65 ms a job, 1.3 cores busy, at most ~3,077 jobs/s
    share = machine_share(cpu_s=5.2, wall_s=4.0, jobs=8000, cores=2)
    assert share["cpu_ms_per_job"] == pytest.approx(0.65)
    assert share["cores_busy"] == pytest.approx(1.3)
    assert share["ceiling_jobs_s"] == pytest.approx(2000 / 0.65)
    assert machine_share(None, 4.0, 8000, 2) == {
        "cpu_ms_per_job": None,
        "cores_busy": None,
        "ceiling_jobs_s": None,
    }


def test_the_table_shows_the_workers_own_process_and_the_machines_share():
    worker = {"jobs_s": 2000.0, "jobs_per_step": 64.0, "tokens_s": 2000.0, "token_events_s": 2000.0,
              "cpu_ms_per_job": {"MainThread": 0.08, "relay process": 0.12}, "cpu_ms_per_job_total": 0.2,
              "process_cpu_ms_per_job": 0.08, "db_per_job": {}, "loop_ms_per_job": {},
              "machine": machine_share(5.2, 4.0, 8000, 2)}  # fmt: skip
    row = {"engine": "instant", "workload": "1-token", "alone": {"jobs_s": 16000.0, "jobs_per_step": 64.0},
           "worker": worker, "vs_engine": 0.125}  # fmt: skip
    payload = {"rows": [row], "bars": {"jobs_s": 1500, "instant_jobs_s": 3000, "vs_engine": 0.7},
               "machine": {"cpu_count": 2}}  # fmt: skip
    text = render(payload)
    assert "machine ceiling jobs/s" in text and "2 cores" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("instant / 1-token") and "3,07" in ln)
    assert "0.08" in line and "0.65" in line and "1.30" in line
