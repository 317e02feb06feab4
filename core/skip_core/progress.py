"""Progress of long work, the same in every command: a rich bar on a terminal; elsewhere (CI,
``nohup``, a cluster's log) a plain line every ``EVERY_S`` seconds and one at the end, so that a
pipe is never silent for long. The plain lines also go to ``log`` when one is given, and
``SKIP_QUIET=1`` turns both off."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from skip_core.console import console

EVERY_S = 10.0


@contextmanager
def progress(total: int, label: str, unit: str = "steps", log: Path | None = None) -> Iterator[Callable[..., None]]:
    """``advance(count=1, note="")`` moves the bar ``count`` of ``total`` ``unit``; ``note`` (a
    loss, a rate) is shown beside it."""
    if os.environ.get("SKIP_QUIET") == "1":
        yield lambda count=1, note="": None
        return
    lines = _Lines(total, label, unit, log, echo=not console.is_terminal)
    if not console.is_terminal:
        yield lines.advance
        lines.emit()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(label, total=total, note="")

        def advance(count: int = 1, note: str = "") -> None:
            bar.update(task, advance=count, note=note)
            lines.advance(count, note)

        yield advance
    lines.emit()


class _Lines:
    """``warm-up 120/350 steps, loss 1.234, 24 s elapsed, about 46 s left``, every few seconds."""

    def __init__(self, total: int, label: str, unit: str, log: Path | None, echo: bool) -> None:
        self.total, self.label, self.unit, self.log, self.echo = total, label, unit, log, echo
        self.done, self.note = 0, ""
        self.start = self.last = time.monotonic()

    def advance(self, count: int = 1, note: str = "") -> None:
        self.done, self.note = self.done + count, note
        if time.monotonic() - self.last >= EVERY_S:
            self.emit()

    def emit(self) -> None:
        if not (self.echo or self.log):
            return
        self.last = time.monotonic()
        elapsed = self.last - self.start
        line = f"{self.label} {self.done}/{self.total} {self.unit}{', ' + self.note if self.note else ''}"
        line += f", {elapsed:.0f} s elapsed"
        if 0 < self.done < self.total:
            line += f", about {elapsed / self.done * (self.total - self.done):.0f} s left"
        if self.echo:
            console.print(line, markup=False, highlight=False)
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as file:
                file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
