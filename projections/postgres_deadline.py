"""A client-side deadline for every statement sent to PostgreSQL, where the server's own timeouts cannot help.

``statement_timeout`` and ``lock_timeout`` are enforced by the server. A server that stops answering
(its processes frozen, a paused VM, a path that drops every packet while a kernel still acknowledges
them) enforces neither; TCP keep-alives and ``tcp_user_timeout`` see nothing wrong while segments are
acknowledged (and do not apply to Unix sockets). psycopg 3 bounds connecting by itself
(``connect_timeout``), but a query waits on its socket with no deadline, and ``cancel_safe()`` only
asks the same silent server to cancel it.

So a :class:`Deadline` watches a store's statements from a thread of its own. A statement that has
waited longer than its limit is ended by shutting the connection's socket down (``shutdown`` on a
duplicate of its descriptor): libpq's wait returns at once, the statement fails with a
:class:`psycopg.OperationalError` that says so (transient: the caller retries), the connection is
closed, and the store opens a new one for the next attempt. A server that was only frozen gets the
connection's end when it resumes, and rolls its transaction back (or commits it, if the COMMIT had
reached it: callers that retry a batch check their checkpoint first).

The duplicate descriptor is made when the connection opens and lives as long as it, so the watchdog
never shuts down a descriptor number that libpq has closed and the system has given to another socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any, Self

import psycopg
from psycopg.abc import Params, Query, QueryNoTemplate

__all__ = ["Deadline", "WatchedConnection", "WatchedCursor"]


class Deadline:
    """Ends the statement in flight on one connection once it has waited ``limit_s`` seconds; thread-safe.

    :meth:`begin` and :meth:`end` bracket each statement (the store's thread); :meth:`interrupt` ends the
    statement in flight at once (any thread). Idle connections are never touched.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.fired = False
        """True when the deadline (or :meth:`interrupt`) ended the statement in flight."""
        self._lock = threading.Lock()
        self._since: float | None = None
        self._socket: socket.socket | None = None
        self._closed = threading.Event()
        # The thread holds the deadline weakly: a store dropped without close() does not keep it alive.
        threading.Thread(target=_watch, args=(weakref.ref(self), self._closed), name="jetsourcing-postgres-deadline",
                         daemon=True).start()

    def watch(self, conn: psycopg.Connection[Any]) -> None:
        """Watch ``conn``, just opened (the connection it replaces is no longer watched)."""
        duplicate = socket.socket(fileno=os.dup(conn.fileno()))
        with self._lock:
            old, self._socket = self._socket, duplicate
        if old is not None:
            old.close()

    def begin(self) -> None:
        """A statement starts waiting on the server."""
        with self._lock:
            self._since = time.monotonic()
            self.fired = False

    def end(self) -> None:
        """The statement has ended (answered or failed)."""
        with self._lock:
            self._since = None

    def interrupt(self) -> None:
        """End the statement in flight now, if there is one."""
        with self._lock:
            if self._since is not None:
                self._shut_down()

    def error(self) -> psycopg.OperationalError:
        """The error a statement ended by the deadline raises."""
        return psycopg.OperationalError(
            f"PostgreSQL did not answer within {self.limit_s:g} s (the server is frozen or unreachable), or the "
            "wait was interrupted: the connection was closed; it is opened again for the next attempt."
        )

    def close(self) -> None:
        """Stop watching (the store closes)."""
        self._closed.set()
        with self._lock:
            duplicate, self._socket = self._socket, None
        if duplicate is not None:
            duplicate.close()

    def _check(self) -> float:
        """Shut the socket down if the statement in flight is overdue; how long until the next check."""
        with self._lock:
            if self._since is None:
                # A statement that begins after this check is overdue no sooner than limit_s from now.
                return self.limit_s
            left = self._since + self.limit_s - time.monotonic()
            if left > 0:
                return left
            self._shut_down()
            return self.limit_s

    def _shut_down(self) -> None:
        if self._socket is not None and not self.fired:
            self.fired = True
            with contextlib.suppress(OSError):  # already closed by the peer: the statement fails anyway
                self._socket.shutdown(socket.SHUT_RDWR)


def _watch(ref: weakref.ref[Deadline], closed: threading.Event) -> None:
    delay = 0.0
    while not closed.wait(delay):
        deadline = ref()
        if deadline is None:
            return
        delay = deadline._check()
        del deadline


class WatchedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose statements (through :class:`WatchedCursor`) are under :attr:`deadline`."""

    deadline: Deadline


class WatchedCursor(psycopg.Cursor[Any]):
    """psycopg's cursor, each ``execute``/``executemany`` bracketed by its connection's :class:`Deadline`.

    Every statement of the store goes through a cursor (``conn.execute`` makes one), SQL run by handlers
    too, so every one of them is watched.
    """

    def execute(  # type: ignore[override]
        self, query: QueryNoTemplate, params: Params | None = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Self:
        deadline = self._deadline()
        deadline.begin()
        try:
            return super().execute(query, params, prepare=prepare, binary=binary)
        except psycopg.OperationalError as exc:
            if deadline.fired:
                raise deadline.error() from exc
            raise
        finally:
            deadline.end()

    def executemany(self, query: Query, params_seq: Iterable[Params], *, returning: bool = False) -> None:
        deadline = self._deadline()
        deadline.begin()
        try:
            super().executemany(query, params_seq, returning=returning)
        except psycopg.OperationalError as exc:
            if deadline.fired:
                raise deadline.error() from exc
            raise
        finally:
            deadline.end()

    def _deadline(self) -> Deadline:
        conn = self.connection
        assert isinstance(conn, WatchedConnection)
        return conn.deadline
