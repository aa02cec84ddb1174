"""A terminal progress bar for bench runs (rich, which ships with textual), on stderr so stdout
stays the table. It is a ProgressCallback: pass it as `on_progress`."""

from __future__ import annotations

import sys
from types import TracebackType

from homelab_llm.bench.sweep import ProgressEvent


class TerminalProgress:
    def __init__(self, title: str, enabled: bool = True) -> None:
        # A bar only on a terminal: redirected runs (CI, `> file`) get no control characters.
        self.enabled = enabled and sys.stderr.isatty()
        self.title = title
        self._progress = None
        self._task = None

    def __enter__(self) -> "TerminalProgress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            self._progress = Progress(
                TextColumn("[bold]{task.fields[title]}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("{task.description}"),
                console=Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("starting", total=None, title=self.title)
        return self

    def __call__(self, event: ProgressEvent) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=event.done, total=event.total,
                                  description=event.label)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
