"""``jetsourcing status --watch``: a live table of every projection and reactor, refreshed until Ctrl-C."""

from __future__ import annotations

import asyncio
import time

from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .reactors.status import ReactorStatus
from .settings import ProjectionSettings
from .status import ProjectionStatus, read_statuses

__all__ = ["render_status", "watch_status"]


def render_status(statuses: list[ProjectionStatus], reactors: list[ReactorStatus] | None, every_s: float) -> Group:
    """The live view: projections (position: checkpoint/last position, with a bar; lag in commits and
    seconds), then reactors."""
    projections = Table(title="projections", title_justify="left", expand=False)
    for column in ("projection", "state", "position", "lag", "lag (s)", "dead", ""):
        # Names fold rather than lose their end in a narrow terminal.
        projections.add_column(column, justify="left" if column in ("projection", "state") else "right",
                               overflow="fold")
    for s in statuses:
        last = s.last_position
        bar = ProgressBar(total=max(last or 0, 1), completed=min(s.checkpoint, last or 0), width=12)
        projections.add_row(
            s.projection, s.state, f"{s.checkpoint:,}/{'?' if last is None else f'{last:,}'}",
            "?" if s.lag_commits is None else f"{s.lag_commits:,}", "?" if s.lag_s is None else f"{s.lag_s:.1f}",
            str(s.dead_letters), bar,
        )
    parts: list[Table | Text] = [projections]
    if reactors:
        table = Table(title="reactors", title_justify="left", expand=False)
        for column in ("reactor", "pending", "in flight", "redelivered", "dead letters"):
            table.add_column(column, justify="left" if column == "reactor" else "right")
        for r in reactors:
            table.add_row(r.reactor, f"{r.pending:,}", f"{r.ack_pending:,}", f"{r.redelivered:,}", f"{r.dead_letters:,}")
        parts.append(table)
    elif reactors is None:
        parts.append(Text("reactors: the server could not be asked", style="dim"))
    parts.append(Text(f"{time.strftime('%H:%M:%S')}, every {every_s:g}s; Ctrl-C ends", style="dim"))
    return Group(*parts)


async def watch_status(settings: ProjectionSettings, every_s: float) -> int:
    """Refresh the live view every ``every_s`` seconds until Ctrl-C (exit code 130)."""
    every_s = max(every_s, 0.1)
    with Live(refresh_per_second=4, transient=False) as live:
        try:
            while True:
                live.update(render_status(*await read_statuses(settings), every_s))
                await asyncio.sleep(every_s)
        except (KeyboardInterrupt, asyncio.CancelledError):
            return 130
