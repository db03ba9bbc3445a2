"""Progress bars on the terminal (rich), for commands a person watches: `submit --file`, `run-batch`, and
the one-off model conversion. Off when stderr is not a terminal (logs, pipes, CI): there the commands
print their plain summary lines instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

Advance = Callable[[int], None]


def wanted() -> bool:
    return sys.stderr.isatty()


@contextmanager
def bar(description: str, total: int | None, enabled: bool | None = None) -> Iterator[Advance]:
    """A bar of `total` items (None: unknown, a spinner); yields `advance(n)`."""
    if not (wanted() if enabled is None else enabled):
        yield lambda _n=1: None
        return
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


@contextmanager
def stages(description: str, enabled: bool | None = None) -> Iterator[Callable[[str, int, int], None]]:
    """A bar over named stages, for gpu.gguf_cache's `progress` hook: `report(stage, number, of)`."""
    if not (wanted() if enabled is None else enabled):
        yield lambda _stage, _number, _of: None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task(description, total=None)

        def report(stage: str, number: int, of: int) -> None:
            progress.update(task, description=f"{description}: {stage}", completed=number - 1, total=of)

        yield report
        progress.update(task, completed=progress.tasks[0].total or 1)
