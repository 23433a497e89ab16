"""Rebuild progress: log lines when not on a terminal, a rich bar on one."""

from __future__ import annotations

import io
import logging

import pytest

from projections.progress import LogProgress, RichProgress, progress_for


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_progress_reports_done_total_rate_and_eta(caplog: pytest.LogCaptureFixture) -> None:
    progress = LogProgress("rebuild x", interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="projections"):
        progress.start(1000)
        progress.update(250)
        progress.update(500, total=2000)
        progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "rebuild x: replaying positions 1..1000"
    assert lines[1].startswith("rebuild x: 250/1,000 (25.0%), ") and "events/s, ETA" in lines[1]
    assert lines[2].startswith("rebuild x: 500/2,000 (25.0%)")
    assert lines[-1].endswith("(finished)")


def test_progress_for_picks_rich_on_a_terminal_and_logs_otherwise() -> None:
    assert isinstance(progress_for("t", io.StringIO()), LogProgress)
    tty = FakeTTY()
    progress = progress_for("rebuild y", tty)
    assert isinstance(progress, RichProgress)
    progress.start(100)
    progress.update(40)
    progress.update(100, total=100)
    progress.finish()
    out = tty.getvalue()
    assert "rebuild y" in out and "100/100" in out and "events/s" in out
