"""compose.yaml: valid by the Compose Specification, and consistent with the code it runs.

No Docker engine runs here, so what can be checked without one is checked: the schema, every inferq
command line against the real parser, every INFERQ_* variable against workers/settings.py, and the
details that once made the file lose data or race (Kafka's log dirs, PostgreSQL's readiness check).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from workers.cli import build_parser
from workers.settings import ENV_VARIABLES, REPO_ROOT

SCHEMA = Path(__file__).resolve().parent.parent / "data" / "compose-spec.json"
INFERQ_SERVICES = ("migrate", "worker", "worker-gpu", "bulk-worker")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


def test_compose_file_is_valid_by_the_compose_specification(compose):
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_catches_a_broken_file(compose):
    """The validation above can fail: a misspelt key is an error under this schema."""
    broken = {**compose, "services": {**compose["services"], "worker": {**compose["services"]["worker"]}}}
    broken["services"]["worker"]["enviroment"] = {"INFERQ_KAFKA": "x"}
    assert list(jsonschema.Draft7Validator(json.loads(SCHEMA.read_text())).iter_errors(broken))


def test_settings_list_every_variable_they_read():
    source = (REPO_ROOT / "workers" / "settings.py").read_text()
    read = set(re.findall(r"env(?:\.get\(|\[)\s*\"(INFERQ_[A-Z0-9_]+)\"", source))
    assert read == set(ENV_VARIABLES)


def test_every_inferq_variable_compose_sets_is_a_setting(compose):
    for name in INFERQ_SERVICES:
        env = compose["services"][name].get("environment") or {}
        names = env if isinstance(env, dict) else [item.split("=", 1)[0] for item in env]
        inferq = [n for n in names if n.startswith("INFERQ_")]
        assert inferq, f"{name} sets no INFERQ_ variable"
        assert set(inferq) <= set(ENV_VARIABLES), f"{name}: unknown {set(inferq) - set(ENV_VARIABLES)}"


def test_every_inferq_command_parses_to_its_verb(compose):
    parser = build_parser()
    verbs = {  # service -> the verb it must run, and the module that defines it
        "migrate": ("up", "workers.cli.services"),
        "worker": ("worker", "workers.cli.worker"),
        "worker-gpu": ("worker", "workers.cli.worker"),
        "bulk-worker": ("bulk-worker", "workers.cli.bulk"),
    }
    assert set(verbs) == set(INFERQ_SERVICES)
    for name in INFERQ_SERVICES:
        service = compose["services"][name]
        args = parser.parse_args(service["command"])  # exits (fails the test) if wrong
        assert (args.command, args.func.__module__) == verbs[name], name
        if args.command != "up":  # the long-running ones log JSON (docs/operations.md: "Containers log JSON")
            assert args.log_format == "json", name
        for mapping in service.get("ports", []):  # each published port is the one the worker serves
            assert int(mapping.rsplit(":", 1)[1]) == args.metrics_port, name


def test_kafka_writes_its_log_dirs_into_its_volume(compose):
    kafka = compose["services"]["kafka"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in kafka["volumes"]}
    assert mounts.get(kafka["environment"]["KAFKA_LOG_DIRS"]) == "kafka-data"


def test_postgres_is_ready_only_when_it_answers_over_tcp(compose):
    test = compose["services"]["postgres"]["healthcheck"]["test"]
    assert test[1] == "pg_isready" and test[test.index("-h") + 1] == "localhost"


def test_worker_publishes_the_metrics_port_it_serves(compose):
    for name, host_port in (("worker", "9400"), ("worker-gpu", "9401")):
        service = compose["services"][name]
        command = service["command"]
        port = command[command.index("--metrics-port") + 1]
        assert f"127.0.0.1:{host_port}:{port}" in service["ports"]


def test_gpu_worker_reserves_an_nvidia_device_behind_a_profile(compose):
    gpu = compose["services"]["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["command"][gpu["command"].index("--device") + 1] == "cuda"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_model_cache_and_bulk_state_live_in_volumes_at_the_images_dirs(compose):
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    cache = re.search(r"INFERQ_CACHE=(\S+)", dockerfile).group(1)
    state = re.search(r"INFERQ_STATE_DIR=(\S+)", dockerfile).group(1)
    for name in ("worker", "worker-gpu"):
        assert f"model-cache:{cache}" in compose["services"][name]["volumes"]
    assert f"bulk-state:{state}" in compose["services"]["bulk-worker"]["volumes"]
    assert {"kafka-data", "postgres-data", "model-cache", "bulk-state"} <= set(compose["volumes"])
