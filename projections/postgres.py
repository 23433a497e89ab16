"""Read models in PostgreSQL: the production store, selected by ``JETSOURCING_DATABASE=postgresql://...``.

The layout and the exactly-once commit are :mod:`projections.sql`'s, in one
schema (``public`` unless ``JETSOURCING_POSTGRES_SCHEMA`` says otherwise):
``balances__g<n>`` tables, ``balances`` views for readers, ``_jetsourcing_*``
bookkeeping. Here:

* Every statement names the schema (``"schema"."balances__g1"``), so no name
  resolves elsewhere (``pg_catalog`` is searched before any schema of the
  ``search_path``) whatever the session's ``search_path`` says.
* The schema and the bookkeeping tables are created only when missing, so a
  role that owns its schema needs no CREATE privilege on the database, and a
  store opened with ``create=False`` (``status``, dead-letter listing,
  readers) creates nothing at all.
* A write to the generations takes a transaction-level advisory lock of the
  schema (one at a time, across processes) and reads the generation rows it
  decides on ``FOR UPDATE``; a batch's commit locks its generation's row
  with the compare-and-set, so a switch and a commit are always ordered.
* Views are re-created inside the switch's transaction: PostgreSQL's DDL is
  transactional, so a reader sees the old model or the new one, never a mix.
* Every wait ends: connecting within ``timeout_s``, each statement and each
  lock wait within ``timeout_s`` (the server's timeouts), and, should the
  server stop answering altogether, within ``timeout_s`` + 1 s on the client's
  side (:mod:`projections.postgres_deadline`); TCP keep-alives and
  ``tcp_user_timeout`` notice a dead peer on the network.
* A connection that broke or was cut (a restarted, killed or frozen server) is
  opened again by the next call made outside a transaction; a failed attempt
  raises :class:`psycopg.OperationalError`, one of the store's
  ``transient_errors``, which long-running processes wait out.
* Committed batches are durable as PostgreSQL's ``synchronous_commit`` says
  (on, by default).

psycopg 3 (``pip install 'jetsourcing[postgres]'``) is used synchronously:
handlers are plain functions shared with SQLite and Spark, so the daemon
runs each batch, and every other store call, in the store's own thread
(:meth:`~projections.store.ReadModelStore.offload`), never on the event loop.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from .errors import ProjectionError, ReadModelNotFoundError
from .postgres_deadline import Deadline, WatchedConnection, WatchedCursor
from .settings import SCHEMA_PATTERN, reserved_schema
from .sql import SqlStore
from .sql_layout import BOOKKEEPING, quote

try:
    import psycopg
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ProjectionError(
        "PostgreSQL read models need psycopg 3: pip install 'jetsourcing[postgres]'."
    ) from exc

__all__ = ["PostgresStore"]

_DEADLINE_MARGIN_S = 1.0
"""The client's deadline comes this long after the server's own timeouts, so a live server's clearer error wins."""

_TYPES = {str: "TEXT", int: "BIGINT", float: "DOUBLE PRECISION", bool: "BOOLEAN", bytes: "BYTEA"}
_SCHEMA_NAME = re.compile(SCHEMA_PATTERN)


_BOOKKEEPING_NAME = re.compile(r'"?\b(' + "|".join(BOOKKEEPING) + r')\b"?')

# Every name pg_class holds, by kind (what a table of the same name would clash with).
_KINDS = {"r": "table", "p": "table", "v": "view", "m": "materialized view", "i": "index", "I": "index",
          "S": "sequence", "f": "foreign table", "c": "type"}


@lru_cache(maxsize=4096)
def _pyformat(statement: str) -> str:
    # The shared SQL has no literal '%' or '?' besides its placeholders.
    return statement.replace("?", "%s")


@lru_cache(maxsize=4096)
def _translate(statement: str, schema: str) -> str:
    """The shared SQL in psycopg's style, its bookkeeping tables qualified with the (quoted) ``schema``."""
    return _BOOKKEEPING_NAME.sub(lambda m: f"{schema}.{m.group(1)}", _pyformat(statement))


class PostgresStore(SqlStore):
    """Read models in one schema of a PostgreSQL database, over one connection; use one store per task.

    ``url`` is a libpq URL (``postgresql://user:password@host:5432/db``;
    its ``options`` parameter is replaced by the store's own settings);
    ``schema`` and the bookkeeping tables are created if missing, and only
    then (the role needs CREATE on the database only for a missing schema).
    With ``create=False`` nothing is created: a missing schema or
    bookkeeping raises :class:`~projections.errors.ReadModelNotFoundError`.
    ``timeout_s`` bounds connecting, every statement and every lock wait; a
    server that does not answer at all fails a statement ``timeout_s`` + 1 s
    after it was sent, with a :class:`psycopg.OperationalError`, and the next
    call reconnects.
    """

    transient_errors = (psycopg.OperationalError,)
    conn: "psycopg.Connection[Any]"

    def __init__(self, url: str, *, schema: str = "public", timeout_s: float = 30.0, cache_rows: int = 100_000,
                 create: bool = True) -> None:
        if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
            raise ProjectionError(
                f"Invalid PostgreSQL schema {schema!r}: use lower-case letters, digits and '_' (at most 63 characters), "
                "starting with a letter or '_'."
            )
        reason = reserved_schema(schema)
        if reason is not None:
            raise ProjectionError(
                f"The PostgreSQL schema {schema!r} is reserved ({reason}): set JETSOURCING_POSTGRES_SCHEMA to another."
            )
        self.schema = schema
        self._qualifier = quote(schema)
        self.cache_rows = cache_rows
        self._url = url
        self._timeout_s = timeout_s
        self.lock_patience_s = timeout_s
        self._closed = False
        self._in_transaction = False
        self._deadline = Deadline(timeout_s + _DEADLINE_MARGIN_S)
        self.conn = self._connect()
        info = self.conn.info
        self.location = f"PostgreSQL database {info.dbname!r} on {info.host}, schema {schema!r}"
        try:
            if not self._schema_exists():
                self._create_schema(create)
            self._install(create=create)
        except BaseException:
            self.close()
            raise

    def _schema_exists(self) -> bool:
        # Looked up first: CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema exists.
        found = self.conn.execute("SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s", (self.schema,))
        return found.fetchone() is not None

    def _create_schema(self, create: bool) -> None:
        info = self.conn.info
        if not create:
            raise ReadModelNotFoundError(
                f"There is no schema {self.schema!r} in PostgreSQL database {info.dbname!r} on {info.host}: no read "
                "models there yet (nothing was created). Check JETSOURCING_POSTGRES_SCHEMA and --db "
                "(JETSOURCING_DATABASE), or run a projection first."
            )
        try:
            with self.conn.transaction():
                self._lock()
                self.conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self._qualifier}")
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ProjectionError(
                f"Cannot create the schema {self.schema!r} in PostgreSQL database {info.dbname!r}: role {info.user!r} "
                f"may not create schemas there ({' '.join(str(exc).split())}). Create it once as a privileged role "
                f"(CREATE SCHEMA {self.schema} AUTHORIZATION {info.user}), or grant the role CREATE on the database."
            ) from exc

    def _connect(self) -> "psycopg.Connection[Any]":
        try:
            return self._open()
        except psycopg.Error as exc:
            self._deadline.close()
            raise ProjectionError(
                f"Cannot connect to the read-model database ({' '.join(str(exc).split())}). Check JETSOURCING_DATABASE."
            ) from exc

    def _open(self) -> "psycopg.Connection[Any]":
        """A new connection, watched by the store's deadline; raises psycopg.OperationalError when it fails."""
        ms = max(1, int(self._timeout_s * 1000))
        conn = WatchedConnection.connect(
            self._url,
            autocommit=True,
            # psycopg enforces it on the client's side (at least 2 s).
            connect_timeout=max(1, round(self._timeout_s)),
            # The schema is a checked identifier; search_path makes every name of projections.sql resolve in it.
            options=f"-c statement_timeout={ms} -c lock_timeout={ms} -c idle_in_transaction_session_timeout="
            f"{ms * 4} -c search_path={self.schema}",
            # On TCP: a dead peer is noticed while idle (keep-alives) and while data waits for its ACK.
            keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3, tcp_user_timeout=ms,
            application_name="jetsourcing",
            cursor_factory=WatchedCursor,
        )
        conn.deadline = self._deadline
        try:
            self._deadline.watch(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _alive(self) -> "psycopg.Connection[Any]":
        """The connection, opened again if the last one broke (a restarted server) between transactions: a
        retried batch goes on. Inside a transaction a lost connection is an error (what it did is gone). A
        failed reconnection raises psycopg.OperationalError: transient, like the break itself."""
        if self.conn.closed:
            if self._closed:
                raise ProjectionError("This PostgreSQL store is closed.")
            if self._in_transaction:
                raise psycopg.OperationalError("The connection to PostgreSQL was lost inside a transaction.")
            self.conn = self._open()
        return self.conn

    def interrupt(self) -> None:
        """End the statement in flight (from any thread): it fails, and the next call reconnects."""
        self._deadline.interrupt()

    def execute(self, statement: str, params: Sequence[Any] = ()) -> Any:
        return self._alive().execute(_translate(statement, self._qualifier), params)

    def _lock(self) -> None:
        self.conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"jetsourcing:{self.schema}",))

    for_update = " FOR UPDATE"

    brief_lock_ms = 200
    """How long a switch waits for the views (and a drop for the old tables) before giving way to readers."""

    def lock_briefly(self) -> None:
        # Every reader of a view queues behind a waiting ACCESS EXCLUSIVE request: never wait long for one.
        self.conn.execute(f"SET LOCAL lock_timeout = {int(self.brief_lock_ms)}")

    def lock_busy(self, exc: BaseException) -> bool:
        return isinstance(exc, psycopg.errors.LockNotAvailable)

    def can_ask_after(self, exc: BaseException) -> bool:
        return not self.conn.closed and not isinstance(exc, psycopg.errors.QueryCanceled)

    def sql(self, statement: str) -> str:
        return _translate(statement, self._qualifier)

    def relation(self, name: str) -> str:
        return f"{self._qualifier}.{quote(name)}"

    def begin_write(self) -> None:
        self.begin_batch()
        try:
            self._lock()
        except BaseException:
            self.rollback_quietly()  # a lock wait that timed out must not leave an aborted transaction open
            raise

    def begin_batch(self) -> None:
        self._alive().execute("BEGIN")
        self._in_transaction = True

    def commit(self) -> None:
        # PostgreSQL answers COMMIT of a failed transaction with a silent ROLLBACK: refuse it instead.
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
            raise psycopg.OperationalError("The transaction failed before its COMMIT; nothing was written.")
        self.conn.execute("COMMIT")
        self._in_transaction = False

    def column_type(self, python_type: type) -> str:
        return _TYPES[python_type]

    def table_options(self) -> str:
        return ""

    def relations(self) -> Iterable[tuple[str, str]]:
        # The catalogs, not information_schema, which hides what the role has no privilege on. Array types
        # are left out: PostgreSQL moves an automatic one aside when a table needs its name.
        rows = self.execute(
            "SELECT c.relname, c.relkind::text FROM pg_catalog.pg_class c "
            "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            "UNION ALL SELECT t.typname, 'c' FROM pg_catalog.pg_type t "
            "JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = %s AND t.typrelid = 0 "
            "AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_type e WHERE e.typarray = t.oid)",
            (self.schema, self.schema),
        ).fetchall()
        return [(name, _KINDS.get(kind, "relation")) for name, kind in rows]

    def executemany(self, statement: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._alive().cursor() as cursor:
            cursor.executemany(statement, rows)

    def rollback_quietly(self) -> None:
        self._in_transaction = False
        if self.conn.closed:
            return
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            try:
                self.conn.execute("ROLLBACK")
            except psycopg.Error:
                pass  # the connection is gone: the server rolled back

    def close(self) -> None:
        self._closed = True
        try:
            self.conn.close()
        finally:
            self._deadline.close()
