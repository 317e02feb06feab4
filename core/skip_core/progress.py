"""Progress of long work, the same in every command: a rich bar (or, for a wait of unknown length,
a spinner) on a terminal; elsewhere (CI, ``nohup``, a cluster's log) a plain line every
``EVERY_S`` seconds and one at the end, so that a pipe is never silent for long, and work done
within ``EVERY_S`` (a tiny model's checkpoint) adds no line at all. The plain lines also go to
``log`` when one is given, and ``SKIP_QUIET=1`` turns both off."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from skip_core import writing
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
        lines.close()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(label, total=total, note="")

        def advance(count: int = 1, note: str = "") -> None:
            bar.update(task, advance=count, note=note)
            lines.advance(count, note)

        yield advance
    lines.close()


@contextmanager
def waiting(label: str, log: Path | None = None) -> Iterator[None]:
    """A wait of unknown length that blocks the caller (an engine loading its model): a spinner
    with the time elapsed on a terminal, ``label, 20 s elapsed`` every ``EVERY_S`` seconds in a
    pipe, from a thread of its own since the caller cannot speak while it waits."""
    if os.environ.get("SKIP_QUIET") == "1":
        yield
        return
    lines, stop = _Lines(None, label, "", log, echo=not console.is_terminal), threading.Event()

    def tick() -> None:
        while not stop.wait(EVERY_S):
            lines.emit()

    ticker = threading.Thread(target=tick, name="skip-progress", daemon=True)
    ticker.start()
    try:
        if console.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            columns = (SpinnerColumn(), TextColumn(label), TimeElapsedColumn())
            with Progress(*columns, console=console, transient=True) as bar:
                bar.add_task(label, total=None)
                yield
        else:
            yield
    finally:
        stop.set()
        ticker.join()
    lines.close()


class _Lines:
    """``warm-up 120/350 steps, loss 1.234, 24 s elapsed, about 46 s left``, every few seconds;
    without a ``total``, ``starting the vllm engine, 24 s elapsed``."""

    def __init__(self, total: int | None, label: str, unit: str, log: Path | None, echo: bool) -> None:
        self.total, self.label, self.unit, self.log, self.echo = total, label, unit, log, echo
        self.done, self.note, self.emitted = 0, "", 0
        self.start = self.last = time.monotonic()

    def advance(self, count: int = 1, note: str = "") -> None:
        self.done, self.note = self.done + count, note
        if time.monotonic() - self.last >= EVERY_S:
            self.emit()

    def close(self) -> None:
        """The closing line, unless the work was too short to have shown any."""
        if self.emitted or time.monotonic() - self.start >= EVERY_S:
            self.emit()

    def emit(self) -> None:
        if not (self.echo or self.log):
            return
        self.last, self.emitted = time.monotonic(), self.emitted + 1
        elapsed = self.last - self.start
        line = self.label if self.total is None else f"{self.label} {self.done}/{self.total} {self.unit}"
        line += f"{', ' + self.note if self.note else ''}, {elapsed:.0f} s elapsed"
        if self.total is not None and 0 < self.done < self.total:
            line += f", about {elapsed / self.done * (self.total - self.done):.0f} s left"
        if self.echo:
            console.print(line, markup=False, highlight=False)
        if self.log is not None:
            try:  # never through a link, as every log of the project
                with writing.appending(self.log.parent, self.log.name) as file:
                    file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n".encode())
            except OSError as exc:  # a progress log is no reason to stop the work it follows
                warnings.warn(f"cannot append to the progress log {self.log}: {exc}", RuntimeWarning, stacklevel=2)
                self.log = None
