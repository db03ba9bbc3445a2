"""`inferq adapter add|list|remove` against the real PostgreSQL (the shared test database: names unique to
each test, removed after)."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from tests.services.factories import run_cli

pytestmark = pytest.mark.services


def peft_dir(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_add_list_remove(tmp_path):
    tag = uuid.uuid4().hex[:8]
    shared, private = f"house-style-{tag}", f"acme/extract-{tag}"
    directory = peft_dir(tmp_path / "ad")
    try:
        added = run_cli("adapter", "add", shared, str(directory))
        assert added.stdout.strip() == f"adapter {shared} ({directory}) registered for every tenant"
        run_cli("adapter", "add", private, str(directory), "--tenant", "acme")
        again = run_cli("adapter", "add", private, str(directory), check=False)
        assert again.returncode == 1 and f"'{private}' exists ({directory}, tenant acme)" in again.stderr

        listed = [json.loads(line) for line in run_cli("adapter", "list", "--json").stdout.splitlines()]
        mine = {a["name"]: (a["path"], a["tenant"]) for a in listed if tag in a["name"]}
        assert mine == {shared: (str(directory), None), private: (str(directory), "acme")}
        # a tenant sees its own and the shared ones, never another's
        for tenant, expected in (("acme", {shared, private}), ("globex", {shared})):
            out = run_cli("adapter", "list", "--tenant", tenant, "--json").stdout.splitlines()
            assert {json.loads(line)["name"] for line in out} & {shared, private} == expected
        table = run_cli("adapter", "list").stdout
        assert table.startswith("name") and f"{shared}" in table and "(every tenant)" in table

        assert run_cli("adapter", "remove", private).stdout.startswith(f"adapter {private} removed")
        gone = run_cli("adapter", "remove", private, check=False)
        assert gone.returncode == 1 and f"no adapter '{private}'" in gone.stderr
    finally:
        run_cli("adapter", "remove", shared, check=False)
        run_cli("adapter", "remove", private, check=False)


@pytest.mark.parametrize(
    ("name", "directory", "why"),
    [
        ("smollm2", "ok", "'smollm2' is a name of the served base model"),
        ("served-x", "ok", "'served-x' is a name of the served base model"),  # INFERQ_SERVED_MODEL_NAME
        ("a,b", "ok", "must start with a letter or digit and hold only letters, digits and ._:/@+-"),
        (".hidden", "ok", "must start with a letter or digit"),
        ("x" * 129, "ok", "an adapter name has 1-128 characters, got 129"),
        ("fine", "missing", "does not exist"),
        ("fine", "empty", "has no adapter_config.json or adapter_model.safetensors"),
    ],
)
def test_add_refuses_bad_names_and_directories_with_the_reason(tmp_path, name, directory, why):
    peft_dir(tmp_path / "ok")
    (tmp_path / "empty").mkdir()
    env = {**os.environ, "INFERQ_SERVED_MODEL_NAME": "served-x,served-y"}
    done = run_cli("adapter", "add", name, str(tmp_path / directory), env=env, check=False)
    assert done.returncode == 2 and why in done.stderr and not done.stdout


def test_no_check_registers_a_directory_this_machine_cannot_see(tmp_path):
    name = f"remote-{uuid.uuid4().hex[:8]}"
    try:
        done = run_cli("adapter", "add", name, "/mnt/adapters/remote", "--no-check")
        assert "(/mnt/adapters/remote) registered" in done.stdout
    finally:
        run_cli("adapter", "remove", name, check=False)
