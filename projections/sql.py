"""Read models in a SQL database: the layout, the generations and the exactly-once commit, once for every dialect.

:class:`SqlStore` implements :class:`~projections.store.ReadModelStore` on a
DB-API connection; :class:`~projections.sqlite.SqliteStore` and
:class:`~projections.postgres.PostgresStore` only supply what differs (how
to connect, begin a write, name column types, list existing relations).

Layout, the same in both:

* Each generation ``n`` of a declared table ``balances`` is a physical table
  ``balances__g<n>`` (primary key = the declared key).
* Readers query ``balances``: a **view** on the live generation's physical
  table. A rebuild fills ``balances__g<n+1>`` while the daemon keeps
  updating ``balances__g<n>``; the **switch** is one transaction that
  re-creates the views on the new tables and flips the live generation in
  ``_jetsourcing_projections``. DDL is transactional in both databases, so
  every reader sees either the old model or the new one, never a mix.
* ``_jetsourcing_generations`` holds each generation's checkpoint, version,
  definition and owner; ``_jetsourcing_projections`` the live generation and
  the daemon's state; ``_jetsourcing_dead_letters`` skipped commits.
* Names: a declared name never contains ``__`` nor a catalog's prefix
  (:func:`~projections.tables.check_table_name`), so it is never one of the
  stores' own; tables of two projections may not differ only in case (one
  name in SQLite, so neither store allows it); every generation's names fit
  PostgreSQL's 63 bytes; statements name relations through
  :meth:`SqlStore.relation` (schema-qualified in PostgreSQL).

Exactly once: a batch's rows, dead letters and checkpoint go into one
transaction whose first statement moves the checkpoint only if it still
holds the writer's last value and owner (compare-and-set, which also locks
the generation's row); otherwise nothing is written. Every change of the
generations (create, claim, switch, drop) runs in a *write* transaction
that the dialect serialises per database, and reads the rows it decides on
with a row lock, so a switch never retires a generation whose checkpoint
moved after it looked.

The switch protocol: a daemon's batch and a rebuild's switch may interleave
in any order, in one process or several, without an error, a lost event or
a double apply.

* The switch is one transaction: it locks the live generation's row (a
  commit in flight finishes first, and the switch sees its checkpoint),
  marks that generation ``retired`` without an owner, makes the shadow
  live and re-points the views. A batch committing after it fails its
  compare-and-set: nothing is written, the daemon reloads.
* A batch reads its rows before its transaction begins, so it may read
  tables a switch has just dropped. Every failed statement of a writer is
  followed by a fresh read of its generation: if the writer no longer owns
  it at its checkpoint, the failure is raised as
  :class:`CheckpointConflictError` (nothing was written; the daemon
  reloads), otherwise as itself. Correctness rests on the compare-and-set
  and this check only, never on when the old tables go.
* So the old tables go at once after the switch if nothing holds them, or
  else with the next claim (the daemon reloading, its old writer closed)
  or rebuild. Waiting until no writer can address them is not something a
  store can know: a writer in another process may be frozen or cut off,
  and looks the same as a dead one; what it can ensure is that a writer
  that does address them loses nothing (above). Dropping at once, not at
  the next claim, keeps one copy of the model when a rebuild runs while no
  daemon does.
* PostgreSQL queues every new reader of a view behind a waiting ACCESS
  EXCLUSIVE request, so the switch takes the views last and waits for them
  only briefly (:meth:`SqlStore.lock_briefly`); if readers hold them, the
  switch rolls back and is tried again with backoff, for at most the
  store's timeout, and readers wait at most that brief moment. A drop of
  old tables waits as briefly, then leaves them for later. SQLite's
  readers (WAL) never wait for a writer.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from operator import itemgetter
from typing import Any, NoReturn, Protocol

from eventstore import Backoff

from .errors import CheckpointConflictError, ProjectionDefinitionError, ReadModelNotFoundError, RebuildError, RowError
from .projection import Projection
from .store import (
    DeadLetter,
    Generation,
    GenerationState,
    ReadModelStore,
    RunState,
    StoredStatus,
    Writer,
    WriteTransaction,
)
from .tables import Key, Row, Table, plain_text
from .transaction import RowCache

__all__ = ["SqlStore", "SqlTransaction", "SqlWriter", "physical_name"]

log = logging.getLogger("projections")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS _jetsourcing_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS _jetsourcing_projections (
    name TEXT PRIMARY KEY,
    generation BIGINT NOT NULL,
    last_generation BIGINT NOT NULL,
    state TEXT NOT NULL,
    owner TEXT,
    counters TEXT,
    error TEXT,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS _jetsourcing_generations (
    projection TEXT NOT NULL,
    generation BIGINT NOT NULL,
    version BIGINT NOT NULL,
    state TEXT NOT NULL,
    checkpoint BIGINT NOT NULL,
    definition TEXT NOT NULL,
    stream TEXT NOT NULL,
    owner TEXT,
    target BIGINT,
    created_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION,
    PRIMARY KEY (projection, generation)
);
CREATE TABLE IF NOT EXISTS _jetsourcing_dead_letters (
    projection TEXT NOT NULL,
    generation BIGINT NOT NULL,
    position BIGINT NOT NULL,
    event_index BIGINT NOT NULL,
    stream_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    event_id TEXT NOT NULL,
    error TEXT NOT NULL,
    traceback TEXT NOT NULL,
    recorded_at TEXT NOT NULL,
    dead_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (projection, generation, position)
);
"""
"""The bookkeeping tables; the type names mean the same in SQLite (by affinity) and PostgreSQL."""

BOOKKEEPING = ("_jetsourcing_meta", "_jetsourcing_projections", "_jetsourcing_generations", "_jetsourcing_dead_letters")
"""The bookkeeping tables' names: the statements below name them unqualified (a dialect may qualify them)."""

MAX_IDENTIFIER_BYTES = 63
"""The longest name of a table or index, in both stores: PostgreSQL silently cuts longer ones, so two
generations' names could become one."""

_GEN_COLUMNS = (
    "projection, generation, version, state, checkpoint, definition, stream, owner, target, created_at, heartbeat_at"
)

_CAS = (
    "UPDATE _jetsourcing_generations SET checkpoint = ?, heartbeat_at = ? "
    "WHERE projection = ? AND generation = ? AND checkpoint = ? AND owner = ? AND state IN ('live', 'building')"
)

_DEAD_LETTER_TABLE = Table(
    "dead_letters", key=("projection", "generation", "position"),
    columns={"projection": str, "generation": int, "position": int, "event_index": int, "stream_id": str,
             "event_type": str, "event_id": str, "error": str, "traceback": str, "recorded_at": str, "dead_at": float},
)


class Cursor(Protocol):
    """What the store uses of a DB-API cursor (sqlite3's and psycopg's agree on it)."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


def _text(value: str) -> str:
    """Error text as every database stores it: NUL and lone surrogates escaped (PostgreSQL refuses them)."""
    if plain_text(value):
        return value
    return value.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def physical_name(table: str, generation: int) -> str:
    """The physical table holding generation ``generation`` of declared table ``table``."""
    return f"{table}__g{generation}"


def quote(name: str) -> str:
    """``name`` as a quoted SQL identifier (the same in SQLite and PostgreSQL)."""
    return '"' + name.replace('"', '""') + '"'


def upsert_sql(physical: str, table: Table, relation: str | None = None) -> str:
    """Insert a whole row, or replace every non-key column of the row with its key (both dialects' syntax);
    ``relation`` is how the statement names the table (default: ``physical`` quoted)."""
    names = table.column_names
    cols = ", ".join(quote(c) for c in names)
    keys = ", ".join(quote(k) for k in table.key)
    values = [c for c in names if c not in table.key]
    action = ("DO UPDATE SET " + ", ".join(f"{quote(c)} = excluded.{quote(c)}" for c in values)) if values else "DO NOTHING"
    placeholders = ", ".join("?" * len(names))
    return f"INSERT INTO {relation or quote(physical)} ({cols}) VALUES ({placeholders}) ON CONFLICT ({keys}) {action}"


def generation_names(table: Table, physical: str) -> list[str]:
    """The names one generation of ``table`` takes: its physical table ``physical``, then one per index.

    Raises :class:`ProjectionDefinitionError` when one is longer than :data:`MAX_IDENTIFIER_BYTES`, in every
    store alike (names are ASCII, so bytes are characters).
    """
    names = [physical, *(f"{physical}__i{i}" for i in range(len(table.indexes)))]
    for name in names:
        if len(name.encode()) > MAX_IDENTIFIER_BYTES:
            raise ProjectionDefinitionError(
                f"Table {table.name!r} cannot get the name {name!r} for a generation: it is {len(name.encode())} "
                f"bytes long, and PostgreSQL keeps {MAX_IDENTIFIER_BYTES} bytes of a name (it would cut it, so two "
                "names could become one). Rename the table to a shorter name, or declare fewer indexes."
            )
    return names


class TableOps:
    """Prepared SQL and row conversions for one physical table, named in statements as ``relation`` (the
    store's :meth:`SqlStore.relation` of it)."""

    __slots__ = ("table", "physical", "relation", "select", "upsert", "delete", "values", "bools", "names", "order")

    def __init__(self, table: Table, physical: str, relation: str) -> None:
        self.table = table
        self.physical = physical
        self.relation = relation
        names = table.column_names
        self.names = names
        cols = ", ".join(quote(c) for c in names)
        where = " AND ".join(f"{quote(k)} = ?" for k in table.key)
        self.select = f"SELECT {cols} FROM {relation} WHERE {where}"
        self.upsert = upsert_sql(physical, table, relation)
        self.delete = f"DELETE FROM {relation} WHERE {where}"
        self.order = ", ".join(quote(k) for k in table.key)
        getter = itemgetter(*names)
        self.values: Callable[[Row], tuple[Any, ...]] = getter if len(names) > 1 else (lambda row: (getter(row),))
        self.bools = tuple(c.name for c in table.columns if c.type is bool)

    def from_storage(self, values: Sequence[Any]) -> Row:
        """A stored row as handlers see it (SQLite keeps booleans as 0/1)."""
        row = dict(zip(self.names, values))
        for name in self.bools:
            if row[name] is not None:
                row[name] = bool(row[name])
        return row


def _generation(row: Sequence[Any]) -> Generation:
    return Generation(
        projection=row[0],
        generation=row[1],
        version=row[2],
        state=GenerationState(row[3]),
        checkpoint=row[4],
        definition=json.loads(row[5]),
        stream=row[6],
        owner=row[7],
        target=row[8],
        created_at=row[9],
        heartbeat_at=row[10],
    )


def tables_of(definition: Mapping[str, Any]) -> list[Table]:
    """The tables of a stored projection definition."""
    return [Table.from_spec(spec) for spec in definition["tables"]]


class SqlStore(ReadModelStore):
    """Read models in one SQL database over one connection (see the module docs); use one store per task.

    Subclasses connect in ``__init__`` (setting :attr:`conn`) and call
    :meth:`_install`; they supply the dialect's hooks below.
    """

    conn: Any
    cache_rows: int
    location: str
    """Where the read models are, for messages (a file, or a database and schema)."""
    for_update: str = ""
    """Appended to the reads a write transaction decides on, to lock their rows (PostgreSQL)."""

    # -- the dialect ----------------------------------------------------------

    @abstractmethod
    def sql(self, statement: str) -> str:
        """``statement`` (written with ``?`` placeholders) in the driver's parameter style."""

    @abstractmethod
    def begin_write(self) -> None:
        """Begin a transaction that changes generations: at most one at a time per database."""

    @abstractmethod
    def begin_batch(self) -> None:
        """Begin a batch's transaction (its compare-and-set serialises it with the generation changes)."""

    @abstractmethod
    def column_type(self, python_type: type) -> str:
        """The SQL type of a column of ``python_type``."""

    @abstractmethod
    def table_options(self) -> str:
        """Text after a physical table's column list."""

    @abstractmethod
    def relations(self) -> Iterable[tuple[str, str]]:
        """Every name taken in the store's namespace, as (name, kind): kind 'table', 'view', 'index', or what
        else the database keeps there under a name a table would clash with ('sequence', 'type', ...)."""

    def relation(self, name: str) -> str:
        """``name`` as statements write it: quoted, and qualified with the store's schema where it has one
        (so a name never resolves in another schema, such as PostgreSQL's ``pg_catalog``)."""
        return quote(name)

    def table_ops(self, table: Table, physical: str) -> TableOps:
        """The prepared statements of ``table`` stored as ``physical`` (a generation's table, or the view)."""
        return TableOps(table, physical, self.relation(physical))

    @abstractmethod
    def executemany(self, statement: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run ``statement`` (in the driver's style) once per row, inside the current transaction."""

    @abstractmethod
    def rollback_quietly(self) -> None:
        """Roll back the current transaction, if the connection still has one."""

    def commit(self) -> None:
        """Commit the current transaction."""
        self.execute("COMMIT")

    lock_patience_s: float = 30.0
    """How long a switch goes on trying to take the views (see :meth:`lock_briefly`)."""

    def lock_briefly(self) -> None:
        """Make the rest of the current transaction wait only briefly for a lock (where readers queue behind a
        waiting lock request, as PostgreSQL's do); :meth:`lock_busy` then says the wait ran out."""

    def lock_busy(self, exc: BaseException) -> bool:
        """True when ``exc`` says a brief lock wait (:meth:`lock_briefly`) ran out."""
        return False

    def can_ask_after(self, exc: BaseException) -> bool:
        """False when, after ``exc``, another query would only wait again (a lost connection, a timeout)."""
        return True

    # -- plumbing -----------------------------------------------------------

    def execute(self, statement: str, params: Sequence[Any] = ()) -> Cursor:
        """Run one statement written with ``?`` placeholders."""
        cursor: Cursor = self.conn.execute(self.sql(statement), params)
        return cursor

    def _install(self, *, create: bool = True) -> None:
        """Create the bookkeeping tables and the store's id if missing (and only then: a role that may read and
        write them need not be allowed to create tables); with ``create`` False, raise
        :class:`ReadModelNotFoundError` instead."""
        found = None
        if {name for name, kind in self.relations() if kind == "table"}.issuperset(BOOKKEEPING):
            found = self.execute("SELECT value FROM _jetsourcing_meta WHERE key = 'store_id'").fetchone()
        if found is None:
            if not create:
                raise ReadModelNotFoundError(
                    f"No read models in {self.location} yet: no projection has run against it (nothing was "
                    "created). Check the database setting (--db, JETSOURCING_DATABASE), or run a projection first."
                )
            with self._write():
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        self.execute(statement)
                self.execute(
                    "INSERT INTO _jetsourcing_meta (key, value) VALUES ('store_id', ?) ON CONFLICT (key) DO NOTHING",
                    (uuid.uuid4().hex,),
                )
            found = self.execute("SELECT value FROM _jetsourcing_meta WHERE key = 'store_id'").fetchone()
        self.store_id: str = found[0]

    def _write(self) -> AbstractContextManager[None]:
        return _WriteTx(self)

    def _gen(self, name: str, generation: int, *, lock: bool = False) -> Generation | None:
        row = self.execute(
            f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND generation = ?"
            + (self.for_update if lock else ""),
            (name, generation),
        ).fetchone()
        return _generation(row) if row else None

    def _live_number(self, name: str) -> int | None:
        row = self.execute("SELECT generation FROM _jetsourcing_projections WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])

    def _create_sql(self, table: Table, physical: str) -> list[str]:
        cols = ", ".join(
            f"{quote(c.name)} {self.column_type(c.type)}{'' if c.nullable else ' NOT NULL'}" for c in table.columns
        )
        pk = ", ".join(quote(k) for k in table.key)
        relation = self.relation(physical)
        statements = [f"CREATE TABLE {relation} ({cols}, PRIMARY KEY ({pk})){self.table_options()}"]
        for name, index in zip(generation_names(table, physical)[1:], table.indexes):
            # An index lives in its table's schema: its own name is never qualified.
            statements.append(f"CREATE INDEX {quote(name)} ON {relation} ({', '.join(quote(c) for c in index)})")
        return statements

    def _create_generation_tables(self, tables: Sequence[Table], generation: int) -> None:
        created = [(table, physical_name(table.name, generation)) for table in tables]
        for table, physical in created:
            generation_names(table, physical)  # every name is checked before the first statement
        for table, physical in created:
            self.execute(f"DROP TABLE IF EXISTS {self.relation(physical)}")
            for statement in self._create_sql(table, physical):
                self.execute(statement)

    def _drop_generation_tables(self, name: str, generation: Generation) -> None:
        for table in tables_of(generation.definition):
            self.execute(f"DROP TABLE IF EXISTS {self.relation(physical_name(table.name, generation.generation))}")
        self.execute(
            "DELETE FROM _jetsourcing_dead_letters WHERE projection = ? AND generation = ?", (name, generation.generation)
        )
        self.execute(
            "DELETE FROM _jetsourcing_generations WHERE projection = ? AND generation = ?", (name, generation.generation)
        )

    def _check_table_names(self, projection: Projection) -> None:
        """Refuse tables whose names, in any letter case, another projection's tables or a relation not made by
        jetsourcing already use: SQLite ignores case in names, so both stores refuse what SQLite would merge."""
        mine = {t.name.lower(): t.name for t in projection.tables}
        for other, definition in self.execute(
            "SELECT projection, definition FROM _jetsourcing_generations WHERE projection != ? AND state != 'retired'",
            (projection.name,),
        ):
            for theirs in (t["name"] for t in json.loads(definition)["tables"]):
                name = mine.get(theirs.lower())
                if name == theirs:
                    raise ProjectionDefinitionError(
                        f"Projection {projection.name!r} declares table {name!r}, already used by projection "
                        f"{other!r} in {self.location}. Rename the table, or use another database."
                    )
                if name is not None:
                    raise ProjectionDefinitionError(
                        f"Projection {projection.name!r} declares table {name!r}, and projection {other!r} in "
                        f"{self.location} has table {theirs!r}: names that differ only in case are one table in "
                        "SQLite, so neither store allows them. Rename the table, or use another database."
                    )
        live = self.live_generation(projection.name)
        own_views = {t.name.lower() for t in tables_of(live.definition)} if live else set()
        for name, kind in self.relations():
            folded = name.lower()
            if folded in mine and not (kind == "view" and folded in own_views):
                same = "" if name == mine[folded] else (
                    f", which differs only in case from table {mine[folded]!r} (one name in SQLite, so neither "
                    "store allows it)")
                raise ProjectionDefinitionError(
                    f"{kind.capitalize()} {name!r} already exists in {self.location}{same}, and was not made for "
                    f"projection {projection.name!r}. Rename the projection's table, or use another database."
                )

    def _point_views(self, old: Generation | None, new: Generation) -> None:
        if old is not None:
            for table in tables_of(old.definition):
                self.execute(f"DROP VIEW IF EXISTS {self.relation(table.name)}")
        for table in tables_of(new.definition):
            self.execute(f"DROP VIEW IF EXISTS {self.relation(table.name)}")
            self.execute(
                f"CREATE VIEW {self.relation(table.name)} AS SELECT * FROM "
                f"{self.relation(physical_name(table.name, new.generation))}"
            )

    def _insert_generation(self, projection: Projection, generation: int, state: str, stream: str, owner: str | None,
                           target: int | None, now: float) -> None:
        self.execute(
            f"INSERT INTO _jetsourcing_generations ({_GEN_COLUMNS}) VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
            (projection.name, generation, projection.version, state, json.dumps(projection.describe()), stream, owner,
             target, now, now if owner else None),
        )

    # -- generations --------------------------------------------------------

    def live_generation(self, name: str) -> Generation | None:
        number = self._live_number(name)
        return None if number is None else self._gen(name, number)

    def ensure_live(self, projection: Projection, stream: str) -> Generation:
        live = self.live_generation(projection.name)
        if live is not None:
            return live
        with self._write():
            live = self.live_generation(projection.name)
            if live is not None:
                return live
            self._check_table_names(projection)
            now = time.time()
            self._create_generation_tables(projection.tables, 1)
            self._insert_generation(projection, 1, "live", stream, None, None, now)
            self.execute(
                "INSERT INTO _jetsourcing_projections (name, generation, last_generation, state, updated_at) "
                "VALUES (?, 1, 1, ?, ?)",
                (projection.name, RunState.NEW.value, now),
            )
            created = self._gen(projection.name, 1)
            assert created is not None
            self._point_views(None, created)
        return created

    def claim(self, name: str, owner: str) -> Generation:
        with self._write():
            number = self._live_number(name)
            if number is None:
                raise KeyError(f"Projection {name!r} has no read model in {self.location} yet.")
            now = time.time()
            self.execute(
                "UPDATE _jetsourcing_generations SET owner = ?, heartbeat_at = ? WHERE projection = ? AND generation = ?",
                (owner, now, name, number),
            )
            self.execute(
                "UPDATE _jetsourcing_projections SET state = ?, owner = ?, error = NULL, updated_at = ? WHERE name = ?",
                (RunState.RUNNING.value, owner, now, name),
            )
            claimed = self._gen(name, number)
        assert claimed is not None
        # The claimer's writer of a generation switched away is closed by now: drop what the switch left.
        self._drop_retired(name)
        return claimed

    def create_shadow(self, projection: Projection, stream: str, owner: str, target: int) -> Generation:
        self._drop_retired(projection.name)
        with self._write():
            # Generation numbers only grow, even past abandoned ones (dropped here), so each names one build.
            top = self.execute(
                "SELECT max(generation) FROM _jetsourcing_generations WHERE projection = ?", (projection.name,)
            ).fetchone()[0]
            allocated = self.execute(
                "SELECT last_generation FROM _jetsourcing_projections WHERE name = ?", (projection.name,)
            ).fetchone()
            generation = max(top or 0, allocated[0] if allocated else 0) + 1
            self.execute(
                "UPDATE _jetsourcing_projections SET last_generation = ? WHERE name = ?", (generation, projection.name)
            )
            for row in self.execute(
                f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building'"
                + self.for_update,
                (projection.name,),
            ).fetchall():
                self._drop_generation_tables(projection.name, _generation(row))
            self._check_table_names(projection)
            self._create_generation_tables(projection.tables, generation)
            self._insert_generation(projection, generation, "building", stream, owner, target, time.time())
            shadow = self._gen(projection.name, generation)
        assert shadow is not None
        return shadow

    def resume_shadow(self, projection: Projection, stream: str, owner: str, target: int) -> Generation | None:
        with self._write():
            row = self.execute(
                f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building' "
                "ORDER BY generation DESC LIMIT 1" + self.for_update,
                (projection.name,),
            ).fetchone()
            found = _generation(row) if row else None
            # The stored definition went through JSON: compare it in that form.
            wanted = (projection.version, json.loads(json.dumps(projection.describe())), stream)
            if found is None or (found.version, found.definition, found.stream) != wanted:
                return None
            self.execute(
                "UPDATE _jetsourcing_generations SET owner = ?, target = ?, heartbeat_at = ? "
                "WHERE projection = ? AND generation = ?",
                (owner, target, time.time(), projection.name, found.generation),
            )
            return self._gen(projection.name, found.generation)

    def release_shadow(self, shadow: Generation, owner: str) -> None:
        with self._write():
            self.execute(
                "UPDATE _jetsourcing_generations SET owner = NULL, heartbeat_at = NULL "
                "WHERE projection = ? AND generation = ? AND owner = ? AND state = 'building'",
                (shadow.projection, shadow.generation, owner),
            )

    def switch(self, shadow: Generation) -> bool:
        """See :meth:`ReadModelStore.switch`. The old generation's tables go at once if nothing holds them, else
        with the next claim or rebuild (see the module docs). A switch whose brief wait for the views ran out
        (readers hold them) is tried again with backoff, for at most :attr:`lock_patience_s` in all."""
        backoff = Backoff(f"{shadow.projection}: the switch to generation {shadow.generation}", log,
                          first_s=0.05, cap_s=1.0)
        deadline = time.monotonic() + self.lock_patience_s
        while True:
            try:
                switched = self._switch_once(shadow)
            except Exception as exc:
                if not self.lock_busy(exc):
                    raise
                delay = backoff.failed(f"readers hold its views: {' '.join(str(exc).split())}")
                if time.monotonic() + delay > deadline:
                    log.error("%s: readers held the views for %.0f s (a long transaction?): the switch to generation "
                              "%d gave up; the old model stays live.", shadow.projection, self.lock_patience_s,
                              shadow.generation)
                    raise
                time.sleep(delay)  # the store's own thread, never the event loop
                continue
            backoff.succeeded()
            if switched:
                self._drop_retired(shadow.projection)
            return switched

    def _switch_once(self, shadow: Generation) -> bool:
        name = shadow.projection
        with self._write():
            number = self._live_number(name)
            current = self._gen(name, shadow.generation, lock=True)
            if current is None or current.state != GenerationState.BUILDING or current.owner != shadow.owner:
                raise RebuildError(
                    f"Generation {shadow.generation} of {name!r} is no longer being built by this rebuild "
                    "(another rebuild replaced it?). The live model is unchanged."
                )
            # Locked: the daemon's next commit waits for this switch, then finds its generation retired.
            live = None if number is None else self._gen(name, number, lock=True)
            if live is not None and live.checkpoint > current.checkpoint:
                return False
            if live is not None:
                self.execute(
                    "UPDATE _jetsourcing_generations SET state = 'retired', owner = NULL "
                    "WHERE projection = ? AND generation = ?",
                    (name, live.generation),
                )
            self.execute(
                "UPDATE _jetsourcing_generations SET state = 'live', owner = NULL, target = NULL "
                "WHERE projection = ? AND generation = ?",
                (name, current.generation),
            )
            if live is None:
                self.execute(
                    "INSERT INTO _jetsourcing_projections (name, generation, last_generation, state, updated_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (name, current.generation, current.generation, RunState.NEW.value, time.time()),
                )
            else:
                self.execute(
                    "UPDATE _jetsourcing_projections SET generation = ?, updated_at = ? WHERE name = ?",
                    (current.generation, time.time(), name),
                )
            # Last, and waiting only briefly: every new reader of a view queues behind a lock request on it.
            self.lock_briefly()
            self._point_views(live, current)
        return True

    def _drop_retired(self, name: str) -> None:
        """Drop the tables of ``name``'s retired generations, each only if nothing holds them now (a brief lock
        wait); what is still held is left for the next switch, claim or rebuild."""
        retired = self.execute(
            "SELECT generation FROM _jetsourcing_generations WHERE projection = ? AND state = 'retired'", (name,)
        ).fetchall()
        for number, in retired:
            try:
                with self._write():
                    gen = self._gen(name, number, lock=True)
                    if gen is not None and gen.state == GenerationState.RETIRED:
                        self.lock_briefly()
                        self._drop_generation_tables(name, gen)
            except Exception as exc:  # noqa: BLE001 - nothing depends on it; the next claim or rebuild tries again
                log.info("%s: the retired generation %d is still in use (%s); it is dropped later.", name, number,
                         " ".join(str(exc).split()))

    def discard(self, name: str, generation: int, owner: str | None = None) -> None:
        with self._write():
            gen = self._gen(name, generation, lock=True)
            if gen is not None and gen.state != GenerationState.LIVE and (owner is None or gen.owner in (owner, None)):
                self._drop_generation_tables(name, gen)

    def writer(self, generation: Generation, owner: str) -> "SqlWriter":
        return SqlWriter(self, generation, owner)

    # -- run state ----------------------------------------------------------

    def set_state(
        self,
        name: str,
        state: RunState,
        *,
        owner: str | None,
        counters: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        self.execute(
            "UPDATE _jetsourcing_projections SET state = ?, counters = coalesce(?, counters), error = ?, "
            "updated_at = ? WHERE name = ? AND (owner IS NULL OR owner = ?)",
            (state.value, json.dumps(counters) if counters is not None else None,
             json.dumps(error) if error is not None else None, time.time(), name, owner),
        )

    def statuses(self) -> list[StoredStatus]:
        out = []
        rows = self.execute(
            "SELECT name, generation, state, owner, counters, error, updated_at FROM _jetsourcing_projections ORDER BY name"
        ).fetchall()
        for name, generation, state, owner, counters, error, updated_at in rows:
            building_row = self.execute(
                f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building' "
                "ORDER BY generation DESC LIMIT 1",
                (name,),
            ).fetchone()
            dead = self.execute(
                "SELECT count(*) FROM _jetsourcing_dead_letters WHERE projection = ? AND generation = ?",
                (name, generation),
            ).fetchone()[0]
            out.append(
                StoredStatus(
                    projection=name,
                    state=RunState(state),
                    owner=owner,
                    updated_at=updated_at,
                    live=self._gen(name, generation),
                    building=_generation(building_row) if building_row else None,
                    counters=json.loads(counters) if counters else {},
                    error=json.loads(error) if error else None,
                    dead_letters=int(dead),
                )
            )
        return out

    def dead_letters(self, name: str) -> list[DeadLetter]:
        number = self._live_number(name)
        if number is None:
            return []
        rows = self.execute(
            "SELECT projection, generation, position, event_index, stream_id, event_type, event_id, error, traceback, "
            "recorded_at, dead_at FROM _jetsourcing_dead_letters WHERE projection = ? AND generation = ? ORDER BY position",
            (name, number),
        ).fetchall()
        return [DeadLetter(*row) for row in rows]

    def drop_dead_letters(self, name: str, position: int | None) -> int:
        number = self._live_number(name)
        if number is None:
            return 0
        where, params = "projection = ? AND generation = ?", [name, number]
        if position is not None:
            where, params = where + " AND position = ?", [*params, position]
        with self._write():
            return self.execute(f"DELETE FROM _jetsourcing_dead_letters WHERE {where}", params).rowcount

    # -- the query side ---------------------------------------------------------

    def _live_table(self, table: str) -> Table:
        for definition, in self.execute(
            "SELECT g.definition FROM _jetsourcing_generations g JOIN _jetsourcing_projections p "
            "ON g.projection = p.name AND g.generation = p.generation"
        ):
            for spec in json.loads(definition)["tables"]:
                if spec["name"] == table:
                    return Table.from_spec(spec)
        raise RowError(f"No projection in {self.location} has a table {table!r}; see `jetsourcing status`.")

    def get(self, table: str, key: Key) -> Row | None:
        declared = self._live_table(table)
        ops = self.table_ops(declared, table)
        row = self.execute(ops.select, declared.key_values(key)).fetchone()
        return None if row is None else ops.from_storage(row)

    def rows(self, table: str, where: Mapping[str, Any] | None = None) -> list[Row]:
        declared = self._live_table(table)
        ops = self.table_ops(declared, table)
        equal = dict(where or {})
        for column in equal:
            declared.column(column)
        condition = " AND ".join(f"{quote(c)} = ?" if v is not None else f"{quote(c)} IS NULL" for c, v in equal.items())
        params = [v for v in equal.values() if v is not None]
        cursor = self.execute(
            f"SELECT {', '.join(quote(c) for c in ops.names)} FROM {ops.relation}"
            + (f" WHERE {condition}" if condition else ""),
            params,
        )
        return sorted((ops.from_storage(r) for r in cursor), key=lambda row: declared.key_values(declared.key_of(row)))

    def dump(self, name: str) -> dict[str, list[Row]]:
        live = self.live_generation(name)
        if live is None:
            return {}
        return {table.name: self.rows(table.name) for table in tables_of(live.definition)}

    def close(self) -> None:
        self.conn.close()


class _WriteTx:
    """``with store._write():`` -- one serialised write transaction, rolled back on any exception."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store

    def __enter__(self) -> None:
        self.store.begin_write()

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.store.commit()
        else:
            self.store.rollback_quietly()


class SqlWriter(Writer):
    """Writes one generation for one owner; keeps committed rows cached between batches."""

    def __init__(self, store: SqlStore, generation: Generation, owner: str) -> None:
        self.store = store
        self.generation = generation
        self.owner = owner
        self.checkpoint = generation.checkpoint
        self.transient_errors = store.transient_errors
        tables = tables_of(generation.definition)
        self.tables = {t.name: t for t in tables}
        self.ops = {t.name: store.table_ops(t, physical_name(t.name, generation.generation)) for t in tables}
        self.physical_names = {t.name: op.relation for t, op in zip(tables, self.ops.values())}
        self.cache = RowCache(self.tables, store.cache_rows)
        for name, ops in self.ops.items():
            try:
                empty = store.execute(f"SELECT 1 FROM {ops.relation} LIMIT 1").fetchone() is None
            except Exception as exc:
                if self.conflict(exc) is None:
                    raise
                break  # switched away since the claim (its tables may be gone): the first batch reloads
            if empty:
                self.cache.complete.add(name)

    def transaction(self) -> "SqlTransaction":
        return SqlTransaction(self)

    def touch(self, counters: dict[str, Any] | None = None) -> bool:
        gen = self.generation
        store = self.store
        now = time.time()
        owned = store.execute(
            "UPDATE _jetsourcing_generations SET heartbeat_at = ? WHERE projection = ? AND generation = ? AND owner = ? "
            "AND checkpoint = ? AND state IN ('live', 'building')",
            (now, gen.projection, gen.generation, self.owner, self.checkpoint),
        ).rowcount == 1
        if owned and counters is not None and gen.state == GenerationState.LIVE:
            store.execute(
                "UPDATE _jetsourcing_projections SET counters = ?, updated_at = ? WHERE name = ? AND owner = ?",
                (json.dumps(counters), now, gen.projection, self.owner),
            )
        return owned

    def owns(self) -> bool:
        """True while this writer's generation is live or building, owned by it, at its checkpoint (read now)."""
        gen = self.generation
        return self.store.execute(
            "SELECT 1 FROM _jetsourcing_generations WHERE projection = ? AND generation = ? AND owner = ? "
            "AND checkpoint = ? AND state IN ('live', 'building')",
            (gen.projection, gen.generation, self.owner, self.checkpoint),
        ).fetchone() is not None

    def failed(self, exc: Exception) -> NoReturn:
        """Raise for ``exc``, which failed one of this writer's statements: :class:`CheckpointConflictError` (from
        ``exc``) when the writer no longer owns its generation, else ``exc``."""
        conflict = self.conflict(exc)
        if conflict is not None:
            raise conflict from exc
        raise exc

    def conflict(self, exc: BaseException) -> CheckpointConflictError | None:
        """After ``exc`` failed one of this writer's statements: the conflict to raise instead when the writer no
        longer owns its generation (a switch retired it, its tables may be gone), else None (``exc`` stands; also
        when that cannot be told now: a lost connection, a timeout, a failed transaction)."""
        if isinstance(exc, CheckpointConflictError) or not self.store.can_ask_after(exc):
            return None
        try:
            if self.owns():
                return None
        except Exception:  # noqa: BLE001 - cannot tell: the original error is the one to report
            return None
        self.cache.clear()
        gen = self.generation
        log.debug("%s: generation %d was switched away under a batch (%s: %s).", gen.projection, gen.generation,
                  type(exc).__name__, exc)
        return CheckpointConflictError(
            f"{gen.projection!r} generation {gen.generation} is no longer owned by {self.owner} at checkpoint "
            f"{self.checkpoint} (a rebuild switched it away?): nothing was written ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())})."
        )

    def close(self) -> None:
        self.cache.clear()


class SqlTransaction(WriteTransaction):
    """A batch's transaction: rows, dead letters and checkpoint commit together.

    Handlers may also run plain SQL with :meth:`execute`; write ``{table}``
    for the physical table of the generation being written (double literal
    braces), and the driver's placeholders (``?`` for SQLite, ``%s`` for
    PostgreSQL). SQL ties the handler to that database: Spark cannot run it.
    """

    def __init__(self, writer: SqlWriter) -> None:
        super().__init__(writer.tables, writer.cache)
        self._writer = writer
        self._store = writer.store
        self._begun = False
        self._raw = False
        self._letters: list[DeadLetter] = []

    def _fetch(self, table: Table, key: Key) -> Row | None:
        ops = self._writer.ops[table.name]
        try:
            row = self._store.execute(ops.select, table.key_values(key)).fetchone()
        except Exception as exc:
            self._writer.failed(exc)
        return None if row is None else ops.from_storage(row)

    def table_name(self, table: str) -> str:
        """The quoted physical name of declared ``table`` in the generation this transaction writes (with its
        schema, in PostgreSQL)."""
        return self._writer.physical_names[table]

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        """Run plain SQL inside the batch's transaction (after this transaction's pending writes); return its rows."""
        try:
            self._begin()
            self._flush()
            self._reset()
            self._raw = True
            if self.cache is not None:
                self.cache.clear()
            conn = self._store.conn
            statement = sql.format_map(self._writer.physical_names)
            cursor = conn.execute(statement, params) if params else conn.execute(statement)
            return list(cursor.fetchall()) if cursor.description is not None else []
        except Exception as exc:
            self._writer.failed(exc)

    def dead_letter(self, letter: DeadLetter) -> None:
        self._letters.append(letter)

    def _begin(self) -> None:
        if not self._begun:
            self._store.begin_batch()
            self._begun = True

    def _flush(self) -> None:
        store = self._store
        for name, rows in self.writes.items():
            if not rows:
                continue
            ops = self._writer.ops[name]
            table = ops.table
            deletes = [table.key_values(k) for k, r in rows.items() if r is None]
            if deletes:
                store.executemany(store.sql(ops.delete), deletes)
            values = ops.values
            upserts = [values(r) for r in rows.values() if r is not None]
            if upserts:
                store.executemany(store.sql(ops.upsert), upserts)

    def commit(self, checkpoint: int) -> None:
        writer = self._writer
        gen = writer.generation
        store = self._store
        if checkpoint < writer.checkpoint or (checkpoint == writer.checkpoint and (self.changed or self._letters)):
            # Writes at the stored checkpoint would apply its events a second time.
            raise ValueError(f"Checkpoint {checkpoint} is not past the stored {writer.checkpoint}.")
        try:
            self._begin()
            moved = store.execute(
                _CAS, (checkpoint, time.time(), gen.projection, gen.generation, writer.checkpoint, writer.owner)
            ).rowcount
            if moved != 1:
                writer.cache.clear()
                raise CheckpointConflictError(
                    f"The checkpoint of {gen.projection!r} generation {gen.generation} is no longer {writer.checkpoint} "
                    f"owned by {writer.owner}: another writer or a rebuild switch moved it. Nothing was written."
                )
            self._flush()
            if self._letters:
                store.executemany(
                    store.sql(upsert_sql("_jetsourcing_dead_letters", _DEAD_LETTER_TABLE)),
                    [
                        (gen.projection, gen.generation, d.position, d.index, _text(d.stream_id), _text(d.event_type),
                         _text(d.event_id), _text(d.error), _text(d.traceback), d.recorded_at, d.dead_at)
                        for d in self._letters
                    ],
                )
            store.commit()
        except BaseException as exc:
            self._abort()
            if isinstance(exc, Exception):
                writer.failed(exc)  # after the rollback: its check reads outside the failed transaction
            raise
        self._begun = False
        self._letters.clear()
        writer.checkpoint = checkpoint
        if self._raw:
            self._raw = False
            writer.cache.clear()
            self._reset()
        else:
            self._committed()

    def rollback(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if self._begun:
            self._begun = False
            self._store.rollback_quietly()  # a failed COMMIT may already have rolled back
        self._reset()
        self._letters.clear()
        if self._raw:
            self._raw = False
            self._writer.cache.clear()
