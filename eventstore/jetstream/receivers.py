"""Where a bulk-read connection's messages go: the :class:`Receiver` of each subscription, and :class:`Replies`,
the one that routes the replies to requests (see :mod:`eventstore.jetstream.transport`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

__all__ = ["Raw", "Receiver", "Replies", "Run"]

Raw = tuple[bytes, "bytes | None", bytes, bytes]
"""A message off the wire: (subject, reply subject or None, header block, body)."""

Run = object
"""What a receiver's scanner returns for a run of messages it framed (the receiver's own type)."""


class Receiver(Protocol):
    """Where one subscription's messages go, in arrival order.

    ``scan``, when not None, frames a run of the subscription's messages at
    ``data[pos:]`` natively: it returns where the run ends and the run, or
    ``(pos, None)`` when the message there is not one it takes (the connection
    frames that one in Python).
    """

    scan: Callable[[bytes, int], tuple[int, Run | None]] | None

    def add(self, rows: list[Raw]) -> None:
        """Take messages framed in Python, in order."""

    def add_run(self, run: Run) -> None:
        """Take a run the scanner framed."""

    def wake(self) -> None:
        """Called once after each socket read that brought the subscription something."""

    def lost(self, error: Exception) -> None:
        """The connection is gone: nothing more will arrive."""


class Replies:
    """The receiver of :meth:`BulkConnection.request`'s replies: routes each to the future waiting for it."""

    def __init__(self, prefix: bytes) -> None:
        self.scan: Callable[[bytes, int], tuple[int, Run | None]] | None = None
        self.cut = len(prefix)
        self.waiting: dict[bytes, asyncio.Future[Raw]] = {}

    def add(self, rows: list[Raw]) -> None:
        for row in rows:
            future = self.waiting.pop(row[0][self.cut :], None)
            if future is not None and not future.done():
                future.set_result(row)

    def add_run(self, run: Run) -> None:  # pragma: no cover - no scanner
        raise AssertionError(run)

    def wake(self) -> None:
        pass

    def lost(self, error: Exception) -> None:
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(error)
        self.waiting.clear()
