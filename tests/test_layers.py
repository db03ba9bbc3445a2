"""The layout is the architecture: every import edge is read from the source and checked against it.

Top level, imports point one way: schemas ← scheduler ← gpu ← workers. Inside workers/, packages by
responsibility, lowest first (a package imports its own modules and those of lower layers, never a
sibling of its own layer): base (settings, logs, clock) ← kafka_io, db ← client, services ← serving ←
bulk ← demo ← cli. Client libraries stay behind their one package: kafka-python in workers/kafka_io,
SQLAlchemy and psycopg2 in workers/db (and the table definitions in schemas/tables.py, and migrations/).
bench/ drives the worker as a user would: through the client, settings, services and a subprocess.

Inside workers/serving/, stage packages in this order (a stage imports its own modules, earlier stages
and the shared modules directly in serving/; a shared module imports no stage): streaming ← outbox ←
intake ← admission ← loop. The two sinks come first, as they know nothing of where a job came from (the
token stream sends deltas, the outbox stores write items and publishes their results); then the pipeline
from its start: intake (a record becomes an accepted job or a `Rejected` write item), admission (its
`queued` row, cancels), and loop, the engine loop that runs each job and wires every stage together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("schemas", "scheduler", "gpu", "workers")  # each may import only those before it
WORKER_LAYERS = (
    ("workers.settings", "workers.logs", "workers.clock", "workers.naming"),
    ("workers.kafka_io", "workers.db"),
    ("workers.client", "workers.services"),
    ("workers.serving",),
    ("workers.bulk",),
    ("workers.api",),  # the HTTP API: composes client, db and the bulk path
    ("workers.demo",),
    ("workers.cli",),
)
# third-party client libraries, and the only places that may import them
CONFINED = {
    "kafka": ("workers.kafka_io",),
    # bench reads the rows it made with its own SQL, as an operator queries job history
    "sqlalchemy": ("workers.db", "schemas.tables", "migrations", "bench"),
    "psycopg2": ("workers.db", "migrations"),
    "alembic": ("workers.db", "migrations"),
    "celery": ("workers.bulk", "workers.cli.bulk"),
    "fastapi": ("workers.api",),
    "starlette": ("workers.api",),
    "uvicorn": ("workers.api",),
    "torch": ("gpu", "workers", "bench"),
    # imported lazily, on CUDA only; bench.host_overhead.launches counts (and skips) Triton launches on the
    # CPU
    "triton": ("gpu.triton_kernels", "bench.host_overhead.launches"),
    "xgrammar": ("gpu.grammar",),  # structured outputs; imported once a grammar is used
}
SERVING = "workers.serving"
SERVING_STAGES = ("streaming", "outbox", "intake", "admission", "loop")  # each may import those before it
MAX_SERVING_MODULES = 8  # modules directly in serving/ (its __init__ included): shared by the stages
BENCH_MAY_USE = ("workers.client", "workers.settings", "workers.services")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, those inside functions and TYPE_CHECKING blocks too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from workers.db import jobs` imports the module workers.db.jobs
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _worker_layer(module: str) -> tuple[int, str] | None:
    for rank, packages in enumerate(WORKER_LAYERS):
        for package in packages:
            if _within(module, package):
                return rank, package
    return None


def _serving_stage(module: str) -> int | None:
    """The rank of a serving module's stage; None for a shared module (or one outside serving/)."""
    if not module.startswith(SERVING + "."):
        return None
    head = module.removeprefix(SERVING + ".").split(".")[0]
    return SERVING_STAGES.index(head) if head in SERVING_STAGES else None


def _sources() -> list[Path]:
    roots = [*TOP_LEVEL, "bench", "migrations"]
    return sorted(p for root in roots for p in (REPO / root).rglob("*.py"))


def layer_violations(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported`, or None when the edge is allowed."""
    top = imported.split(".")[0]
    if top in CONFINED and not any(_within(importer, allowed) for allowed in CONFINED[top]):
        return f"{top} may be imported only in {', '.join(CONFINED[top])}"
    own_top = importer.split(".")[0]
    if own_top == "bench" and top == "workers":
        if not any(_within(imported, allowed) for allowed in BENCH_MAY_USE):
            return f"bench uses the worker only through {', '.join(BENCH_MAY_USE)} and a subprocess"
        return None
    if own_top in TOP_LEVEL and top in TOP_LEVEL and TOP_LEVEL.index(top) > TOP_LEVEL.index(own_top):
        return f"{own_top} sits below {top} (schemas ← scheduler ← gpu ← workers)"
    if own_top == "workers" and top == "workers":
        mine, theirs = _worker_layer(importer), _worker_layer(imported)
        if mine is None or theirs is None:
            return "every module of workers/ belongs to a layer of tests/test_layers.py"
        if mine[1] != theirs[1] and theirs[0] >= mine[0]:
            return f"{mine[1]} may import only lower layers, not {theirs[1]}"
        if _within(importer, SERVING) and _within(imported, SERVING):
            my_stage, their_stage = _serving_stage(importer), _serving_stage(imported)
            if their_stage is not None and (my_stage is None or their_stage > my_stage):
                order = " ← ".join(SERVING_STAGES)
                return f"serving stages import only earlier ones and shared modules ({order})"
    return None


def test_every_import_follows_the_layers():
    broken = []
    for path in _sources():
        importer = _module_name(path)
        for line, imported in _imports(path):
            why = layer_violations(importer, imported)
            if why:
                broken.append(f"{path.relative_to(REPO)}:{line} imports {imported}: {why}")
    assert not broken, "\n".join(broken)


def test_every_worker_module_has_a_layer():
    orphans = [
        _module_name(p) for p in (REPO / "workers").rglob("*.py") if _worker_layer(_module_name(p)) is None
    ]
    assert orphans in ([], ["workers"]), orphans


def test_serving_is_its_stages_and_a_few_shared_modules():
    root = REPO / "workers" / "serving"
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert packages == set(SERVING_STAGES)
    direct = sorted(p.name for p in root.glob("*.py"))
    assert len(direct) <= MAX_SERVING_MODULES, direct


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("workers.db.jobs", "workers.serving.loop.worker"),  # upward
        ("workers.serving.outbox.persister", "workers.serving.intake.rejected"),  # a later stage
        ("workers.serving.intake.validation", "workers.serving.loop.lifecycle"),
        ("workers.serving.errors", "workers.serving.outbox.writes"),  # a shared module imports no stage
        ("workers.kafka_io.consumer", "workers.db.connect"),  # a sibling of the same layer
        ("workers.serving.loop.worker", "kafka.errors"),  # the client library outside its package
        ("workers.bulk.tasks", "sqlalchemy"),
        ("scheduler.scheduler", "gpu.engine"),
        ("scheduler.scheduler", "torch"),
        ("bench.e2e", "workers.serving.loop.worker"),
        ("gpu.runner", "xgrammar"),
    ],
)
def test_the_check_refuses_edges_against_the_layers(importer, imported):
    assert layer_violations(importer, imported)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("workers.serving.loop.worker", "workers.db.jobs"),
        ("workers.serving.loop.worker", "workers.serving.offsets"),
        ("workers.serving.loop.worker", "workers.serving.outbox.persister"),  # an earlier stage
        ("workers.serving.intake.rejected", "workers.serving.outbox.writes"),
        ("workers.serving.admission.admitter", "workers.serving.admission.cancels"),  # its own stage
        ("workers.cli.worker", "gpu.engine"),
        ("workers.db.jobs", "schemas.tables"),
        ("bench.e2e.run", "workers.client"),
    ],
)
def test_the_check_allows_edges_along_the_layers(importer, imported):
    assert layer_violations(importer, imported) is None


def _local_graph() -> dict[str, set[str]]:
    """Module → the project's modules it imports (`from pkg import mod` counted as the module itself)."""
    paths = {_module_name(p): p for p in _sources()}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = set()
        for _, imported in _imports(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != module and not module.startswith(imported + "."):
                targets.add(imported)
        graph[module] = targets
    return graph


def test_no_import_circles():
    """Deferred imports and TYPE_CHECKING blocks count too: a circle held apart by them is still one."""
    graph, circles = _local_graph(), []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)
