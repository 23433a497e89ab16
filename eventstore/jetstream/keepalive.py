"""Client PINGs on the bulk-read connection, so that a silent peer is noticed (nats-py's ``_ping_interval``).

A lost host or a partition resets nothing: the socket stays open and simply
stops delivering, and the kernel gives up on it only after about 15 minutes.
As nats-py does, :class:`Keepalive` sends a PING every ``interval_s`` and
declares the connection dead when more than ``max_outstanding`` of them are
unanswered; anything received since the last tick also shows the peer alive
(a PONG queues behind the data a busy replay is receiving). A silent peer is
so noticed within ``(max_outstanding + 1) * interval_s`` (see
:func:`detection_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

__all__ = ["Keepalive", "detection_s"]


def detection_s(interval_s: float, max_outstanding: int) -> float:
    """The longest a silent peer goes unnoticed: the tick that finds ``max_outstanding`` PINGs unanswered."""
    return (max_outstanding + 1) * interval_s


class Keepalive:
    """PINGs a connection every ``interval_s``; calls ``dead(why)`` once more than ``max_outstanding`` go unanswered.

    ``ping()`` sends one PING; ``reads()`` counts the connection's socket
    reads so far; the connection calls :meth:`answered` for each PONG and
    :meth:`stop` when it closes.
    """

    def __init__(
        self,
        *,
        interval_s: float,
        max_outstanding: int,
        ping: Callable[[], None],
        reads: Callable[[], int],
        dead: Callable[[str], None],
    ) -> None:
        self.interval_s = interval_s
        self.max_outstanding = max_outstanding
        self.outstanding = 0
        self._ping = ping
        self._reads = reads
        self._dead = dead
        self._task = asyncio.get_running_loop().create_task(self._run())

    def answered(self) -> None:
        """A PONG arrived: the peer is alive."""
        self.outstanding = 0

    def stop(self) -> None:
        """Stop pinging (the connection is closed)."""
        self._task.cancel()

    async def _run(self) -> None:
        seen = self._reads()
        while True:
            await asyncio.sleep(self.interval_s)
            if (reads := self._reads()) != seen:
                seen, self.outstanding = reads, 0
            self.outstanding += 1
            if self.outstanding > self.max_outstanding:
                self._dead(
                    f"no answer to {self.max_outstanding} PINGs in {detection_s(self.interval_s, self.max_outstanding):g}s "
                    "(a lost host or a partition: ping_interval_s, max_outstanding_pings)"
                )
                return
            with contextlib.suppress(Exception):  # closing: stop() follows
                self._ping()
