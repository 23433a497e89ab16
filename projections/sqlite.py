"""The embedded read-model store: one SQLite file holding any number of projections.

The layout and the exactly-once commit are :mod:`projections.sql`'s. Here:
physical tables are ``WITHOUT ROWID`` (and ``STRICT`` where SQLite supports
it); a write to the generations is ``BEGIN IMMEDIATE``, which takes the
file's write lock, so two processes (a rebuild and the daemon) take turns.
The database runs in WAL mode, so readers never wait for a writer and a
reader inside a read transaction keeps its snapshot across a switch; with
the default ``synchronous=NORMAL`` a committed batch survives a crash of any
process (kill -9), and ``FULL`` also survives a power cut.

Handlers may use plain SQL on the transaction as an escape hatch
(:meth:`~projections.sql.SqlTransaction.execute`, ``?`` placeholders).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from .errors import ReadModelNotFoundError
from .sql import SqlStore
from .tables import COLUMN_TYPES

__all__ = ["SqliteStore"]

_STRICT = sqlite3.sqlite_version_info >= (3, 37, 0)
_OPENING = threading.Lock()

class SqliteStore(SqlStore):
    """Read models in one SQLite file (created if missing). One connection; use one store per task.

    ``synchronous`` is SQLite's: ``NORMAL`` (default) survives process crashes,
    ``FULL`` also power loss. ``busy_timeout_s`` bounds how long a write waits
    for another process's write (a rebuild and the daemon take turns). With
    ``create=False`` nothing is created (no file, folder or table): a missing
    file or bookkeeping raises :class:`~projections.errors.ReadModelNotFoundError`.
    """

    transient_errors = (sqlite3.OperationalError,)

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout_s: float = 30.0,
        cache_rows: int = 100_000,
        create: bool = True,
    ) -> None:
        self.path = Path(path)
        self.location = str(self.path)
        self.cache_rows = cache_rows
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            target: str | Path = self.path
        elif not self.path.is_file():
            raise ReadModelNotFoundError(
                f"No read-model database at {self.path}: no projection has run against it yet (nothing was "
                "created). Check --db (JETSOURCING_DATABASE), or run a projection first."
            )
        else:
            target = self.path.absolute().as_uri() + "?mode=rw"  # opened as it is, never created
        # Used from one thread at a time, but not always the one that opened it (ReadModelStore.offload).
        self.conn = sqlite3.connect(target, isolation_level=None, timeout=busy_timeout_s, check_same_thread=False,
                                    uri=not create)
        try:
            # Switching a new file to WAL does not wait for the busy timeout: the daemon's runners open their
            # stores at once, in threads, so they take turns here.
            with _OPENING:
                if create:  # a file of ours is in WAL mode already: the mode is kept in the file
                    self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'FULL' else 'NORMAL'}")
                self.conn.execute("PRAGMA cache_size=-65536")
                self.conn.execute("PRAGMA temp_store=MEMORY")
                self._install(create=create)
        except BaseException:
            self.conn.close()
            raise

    def sql(self, statement: str) -> str:
        return statement

    def begin_write(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def begin_batch(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def column_type(self, python_type: type) -> str:
        return COLUMN_TYPES[python_type]

    def table_options(self) -> str:
        return " WITHOUT ROWID, STRICT" if _STRICT else " WITHOUT ROWID"

    def relations(self) -> Iterable[tuple[str, str]]:
        rows: list[tuple[str, str]] = self.conn.execute(
            "SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view', 'index')"
        ).fetchall()
        return rows

    def executemany(self, statement: str, rows: Sequence[Sequence[Any]]) -> None:
        self.conn.executemany(statement, rows)

    def interrupt(self) -> None:
        """Abort the statement in flight, if any (sqlite3 allows it from any thread)."""
        self.conn.interrupt()

    def rollback_quietly(self) -> None:
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # a failed COMMIT may already have rolled back
