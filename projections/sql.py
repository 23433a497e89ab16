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

How a batch commits exactly once and how the switch interleaves with it: :mod:`projections.sql_writer`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from eventstore import Backoff

from .errors import ProjectionDefinitionError, ReadModelNotFoundError, RebuildError, RowError
from .projection import Projection
from .sql_layout import (
    BOOKKEEPING,
    GEN_COLUMNS,
    SCHEMA,
    Cursor,
    TableOps,
    generation_from_row,
    generation_names,
    physical_name,
    quote,
    tables_of,
)
from .sql_writer import SqlTransaction, SqlWriter
from .store import DeadLetter, Generation, GenerationState, ReadModelStore, RunState, StoredStatus
from .tables import Key, Row, Table

__all__ = ["SqlStore", "SqlTransaction", "SqlWriter"]

log = logging.getLogger("projections")


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
                for statement in SCHEMA.split(";"):
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
            f"SELECT {GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND generation = ?"
            + (self.for_update if lock else ""),
            (name, generation),
        ).fetchone()
        return generation_from_row(row) if row else None

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
            f"INSERT INTO _jetsourcing_generations ({GEN_COLUMNS}) VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
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
                f"SELECT {GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building'"
                + self.for_update,
                (projection.name,),
            ).fetchall():
                self._drop_generation_tables(projection.name, generation_from_row(row))
            self._check_table_names(projection)
            self._create_generation_tables(projection.tables, generation)
            self._insert_generation(projection, generation, "building", stream, owner, target, time.time())
            shadow = self._gen(projection.name, generation)
        assert shadow is not None
        return shadow

    def resume_shadow(self, projection: Projection, stream: str, owner: str, target: int) -> Generation | None:
        with self._write():
            row = self.execute(
                f"SELECT {GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building' "
                "ORDER BY generation DESC LIMIT 1" + self.for_update,
                (projection.name,),
            ).fetchone()
            found = generation_from_row(row) if row else None
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

    def writer(self, generation: Generation, owner: str) -> SqlWriter:
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
                f"SELECT {GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building' "
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
                    building=generation_from_row(building_row) if building_row else None,
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
