"""A progress line on stderr while the suites run: rich's spinner and bar, the case being
measured, the count of cases started and the elapsed time.

Contract: `start(verbose)` returns None (nothing shown) unless verbose, rich is importable and
stderr is a terminal; otherwise a Progress whose `step(label)` is the Context's progress
callback and whose `stop()` removes the line (transient). Lines printed to stderr meanwhile
(the suites' logs) appear above it.
"""
from __future__ import annotations

import sys


class Progress:
    def __init__(self):
        from rich.console import Console
        from rich.progress import (BarColumn, Progress as RichProgress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn)
        self._rich = RichProgress(SpinnerColumn(), BarColumn(), TextColumn("{task.description}"),
                                  TextColumn("({task.completed} cases)"), TimeElapsedColumn(),
                                  console=Console(file=sys.stderr), transient=True)
        self._task = self._rich.add_task("starting", total=None)
        self._count = 0
        self._rich.start()

    def step(self, label: str) -> None:
        self._rich.update(self._task, description=label, completed=self._count)
        self._count += 1

    def stop(self) -> None:
        self._rich.stop()


def start(verbose: bool) -> Progress | None:
    if not verbose or not sys.stderr.isatty():
        return None
    try:
        return Progress()
    except ImportError:
        return None
