"""The bulk-read connection of one event store's replays: opened on first use, again after a loss.

:class:`SharedConnection` hands every replay of a store the same
:class:`~eventstore.jetstream.transport.BulkConnection`. It remembers the
servers the cluster advertised (:mod:`~eventstore.jetstream.pool`), so a new
connection after a loss may go to any of them; it never hands out a connection
that is closed, nor one that went silent (checked with a PING after a request
went unanswered); and once closed, with the store, it ends every replay and
refuses every later one with :class:`~eventstore.EventStoreClosedError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..errors import EventStoreClosedError, ServerUnavailableError
from ..security import ConnectionSecurity
from .pool import ServerPool
from .transport import BulkConnection

__all__ = ["SharedConnection"]

_CHECK_S = 1.0  # how long a suspect connection has to answer a PING (a healthy one answers in milliseconds)


class SharedConnection:
    """One :class:`BulkConnection` for the replays of one event store: opened on first use, again after a loss.

    Its connections PING as ``ping_interval_s`` and ``max_outstanding_pings``
    say (None: never) and take replies under ``inbox_prefix``.
    """

    def __init__(
        self,
        servers: Callable[[], list[str]],
        security: ConnectionSecurity,
        deadline_s: float,
        name: str,
        *,
        ping_interval_s: float | None = 5.0,  # EventStoreSettings' defaults: a silent server noticed within 15 s
        max_outstanding_pings: int = 2,
        inbox_prefix: str = "_INBOX",
    ) -> None:
        self._servers = servers
        self._pool = ServerPool()
        self._ping_interval_s = ping_interval_s
        self._max_outstanding_pings = max_outstanding_pings
        self._inbox_prefix = inbox_prefix
        self._security = security
        self._deadline_s = deadline_s
        self._name = name
        self._conn: BulkConnection | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def get(self) -> BulkConnection:
        """The open connection (opening one within ``deadline_s``, or raising as :meth:`BulkConnection.open`)."""
        async with self._lock:
            if self._closed:
                raise _closed()
            if self._conn is not None and not self._conn.closed and self._conn.suspect:
                await self._check(self._conn)
            if self._conn is None or self._conn.closed:
                conn = await BulkConnection.open(
                    self._servers(), self._security, deadline_s=self._deadline_s, name=self._name,
                    ping_interval_s=self._ping_interval_s, max_outstanding_pings=self._max_outstanding_pings,
                    pool=self._pool, inbox_prefix=self._inbox_prefix,
                )
                if self._closed:  # close() ran while it opened
                    conn.close()
                    raise _closed()
                self._conn = conn
            return self._conn

    def is_closed(self) -> bool:
        """Whether :meth:`close` ran (the event store was closed)."""
        return self._closed

    async def _check(self, conn: BulkConnection) -> None:
        """Keep ``conn`` if it answers a PING promptly; else close it, failing what waits on it (they go on on a new
        connection), so a half-open connection is never handed out again."""
        timeout_s = min(self._deadline_s, _CHECK_S)
        try:
            await conn.flush(timeout_s)
            conn.suspect = False
        except (TimeoutError, ServerUnavailableError):
            conn.close(ServerUnavailableError(
                f"The replay connection to NATS at {conn.url} is dead: a request and a PING went unanswered for "
                f"{timeout_s}s (a lost host or a partition). Replays go on on a new connection."
            ))

    def close(self) -> None:
        """Close the connection; replays and requests still running end at once, and every later :meth:`get`,
        with :class:`~eventstore.EventStoreClosedError`."""
        self._closed = True
        if self._conn is not None:
            self._conn.close(_closed())


def _closed() -> EventStoreClosedError:
    return EventStoreClosedError(
        "The event store was closed: its replays ended. Connect a new EventStore to read again."
    )
