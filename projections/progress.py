"""Progress of long replays: a rich progress bar on a terminal, periodic log lines otherwise.

Progress is counted in stream positions (one position = one commit, which is
one event unless an append stored several): done = the checkpoint reached,
total = the position the replay runs to.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

__all__ = ["LogProgress", "NoProgress", "ProgressReporter", "RichProgress", "progress_for"]

log = logging.getLogger("projections")


class ProgressReporter(Protocol):
    """Receives a replay's progress."""

    def start(self, total: int, done: int = 0) -> None:
        """The replay begins at ``done`` and runs to ``total``."""

    def update(self, done: int, total: int | None = None) -> None:
        """The replay reached ``done`` (and now runs to ``total``, if given)."""

    def finish(self) -> None:
        """The replay ended (successfully or not)."""


class NoProgress:
    """Reports nothing."""

    def start(self, total: int, done: int = 0) -> None:
        pass

    def update(self, done: int, total: int | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


class LogProgress:
    """Logs ``done/total``, events/s and ETA every ``interval_s`` seconds, and once at the end."""

    def __init__(self, title: str, interval_s: float = 5.0, logger: logging.Logger | None = None) -> None:
        self.title = title
        self.interval_s = interval_s
        self.log = logger or log
        self.total = 0
        self.done = self.first = 0
        self.started = self.last_log = time.monotonic()

    def start(self, total: int, done: int = 0) -> None:
        self.total, self.done, self.first = total, done, done
        self.started = self.last_log = time.monotonic()
        self.log.info("%s: replaying positions %d..%d", self.title, done + 1, total)

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = time.monotonic()
        if now - self.last_log >= self.interval_s:
            self.last_log = now
            self.log.info("%s", self.line())

    def line(self) -> str:
        """The current progress as one line."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = (self.done - self.first) / elapsed
        left = max(self.total - self.done, 0)
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.title}: {self.done:,}/{self.total:,} ({percent:.1f}%), {rate:,.0f} events/s, ETA {eta}"

    def finish(self) -> None:
        self.log.info("%s (finished)", self.line())


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} events/s" if speed else "- events/s", style="progress.data.speed")


class RichProgress:
    """A progress bar on ``stream`` (a terminal), or in a rich ``console`` you already draw to: done/total, events/s, ETA."""

    def __init__(self, title: str, stream: IO[str] | None = None, *, console: Console | None = None) -> None:
        self.title = title
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _RateColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console or Console(file=stream or sys.stderr),
            transient=False,
        )
        self._task = self._progress.add_task(title, total=None, start=False)

    def start(self, total: int, done: int = 0) -> None:
        self._progress.start()
        self._progress.update(self._task, total=total, completed=done)
        self._progress.start_task(self._task)

    def update(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self._progress.update(self._task, total=total, completed=done)
        else:
            self._progress.update(self._task, completed=done)

    def finish(self) -> None:
        self._progress.stop()


def progress_for(title: str, stream: IO[str] | None = None) -> ProgressReporter:
    """A :class:`RichProgress` when ``stream`` (default stderr) is a terminal, else a :class:`LogProgress`."""
    stream = stream or sys.stderr
    if stream.isatty():
        return RichProgress(title, stream)
    return LogProgress(title)
