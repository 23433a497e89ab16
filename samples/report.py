"""Console output of the demo: numbered steps, check marks, tables and a replay progress bar (rich).

Everything goes to stdout so the demo's story reads top to bottom; on a
terminal the progress bar animates, elsewhere (CI, a test's pipe) it prints
its final state once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

__all__ = ["Check", "Report"]


@dataclass
class Check:
    """One verified claim of the demo."""

    claim: str
    ok: bool
    detail: str = ""


@dataclass
class Report:
    """The demo's narrator: prints steps and results, and remembers checks and step times for the summary."""

    steps: int
    console: Console = field(default_factory=lambda: _console())
    checks: list[Check] = field(default_factory=list)
    timings: list[tuple[str, float]] = field(default_factory=list)
    _step: int = 0
    _title: str = ""
    _started: float = 0.0

    def step(self, title: str) -> None:
        """Start the next numbered step (closing the previous one's timer)."""
        self.end_step()
        self._step += 1
        self._title = title
        self._started = time.monotonic()
        self.console.print()
        self.console.rule(f"[bold cyan]{self._step}/{self.steps}  {title}", align="left")

    def end_step(self) -> None:
        """Record how long the current step took."""
        if self._title:
            self.timings.append((self._title, time.monotonic() - self._started))
            self._title = ""

    def say(self, text: str) -> None:
        """A line of narration."""
        self.console.print(f"  {text}")

    def done(self, text: str) -> None:
        """Something that happened."""
        self.console.print(f"  [green]✓[/] {text}")

    def check(self, claim: str, ok: bool, detail: str = "") -> bool:
        """Verify a claim: printed with ✓ or ✗, and counted in the summary (a ✗ fails the demo)."""
        self.checks.append(Check(claim, ok, detail))
        mark = "[green]✓[/]" if ok else "[bold red]✗[/]"
        suffix = f" [dim]({detail})[/]" if detail else ""
        self.console.print(f"  {mark} {claim}{suffix}")
        return ok

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        """A small table, indented under the step."""
        table = Table(title=title, title_justify="left", title_style="bold", show_edge=False, pad_edge=False)
        for column in columns:
            table.add_column(column, justify="left" if column in columns[:1] else "right")
        for row in rows:
            table.add_row(*(_cell(v) for v in row))
        self.console.print(table)

    def block(self, text: str) -> None:
        """Preformatted text (e.g. ``jetsourcing status`` output), indented."""
        for line in text.splitlines():
            self.console.print(f"    {line}", markup=False)

    @property
    def current_step(self) -> str:
        """The title of the step running now ("" between steps)."""
        return self._title

    @property
    def failed(self) -> list[Check]:
        """The checks that did not hold."""
        return [c for c in self.checks if not c.ok]


def _console() -> Console:
    # Off a terminal (CI logs, a test's pipe) rich assumes 80 columns, which squeezes the tables.
    width = None if sys.stdout.isatty() else 120
    return Console(highlight=False, soft_wrap=True, width=width)


def _cell(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)
