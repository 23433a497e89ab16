"""Plain-text tables for the command line (``status``, ``dead-letters``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["aligned"]


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """The rows (a header first) as lines of left-aligned columns two spaces apart, without trailing spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
