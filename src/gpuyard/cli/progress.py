"""Progress of a long command: bars on a terminal, else a line per stage at most every few seconds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console


@contextlib.contextmanager
def progress_reporter(
    enabled: bool,
    every_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    console: Console | None = None,
) -> Iterator[Callable[[str, int, int], None] | None]:
    """A ``progress(stage, done, total)`` callback for a long command (None when not ``enabled``, e.g.
    under --json): bars on stderr when it is a terminal, else one line per stage at most every
    ``every_s`` seconds and one when a stage completes ("tokenize: 12000/50000 (24%), 10 s")."""
    if not enabled:
        yield None
        return
    err = console or Console(stderr=True)
    if not err.is_terminal:
        start = clock()
        last: dict[str, float] = {}
        finished: set[str] = set()

        def line(stage: str, done: int, total: int) -> None:
            now = clock()
            complete = total > 0 and done >= total
            if stage in finished or (not complete and now - last.get(stage, start) < every_s):
                return
            last[stage] = now
            if complete:
                finished.add(stage)
            share = f"/{total} ({done / total:.0%})" if total > 0 else ""
            err.print(f"{stage}: {done}{share}, {now - start:.0f} s", soft_wrap=True, highlight=False)

        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description:>8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    ) as prog:

        def report(stage: str, done: int, total: int) -> None:
            if stage not in bars:
                bars[stage] = prog.add_task(stage, total=total)
            prog.update(bars[stage], completed=done, total=total)

        yield report
