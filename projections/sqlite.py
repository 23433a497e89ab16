"""The embedded read-model store: one SQLite file holding any number of projections.

Layout of the file:

* Each generation ``n`` of a declared table ``balances`` is a physical table
  ``balances__g<n>`` (``WITHOUT ROWID``, primary key = the declared key,
  ``STRICT`` where SQLite supports it).
* Readers query ``balances``: a **view** on the live generation's physical
  table. A rebuild fills ``balances__g<n+1>`` while the daemon keeps
  updating ``balances__g<n>``; the **switch** is one SQLite transaction that
  re-creates the views on the new tables and flips the live generation in
  ``_jetsourcing_projections``. SQLite DDL is transactional, so every reader
  sees either the old model or the new one, never a mix; a reader already
  inside a read transaction keeps its snapshot (WAL).
* ``_jetsourcing_generations`` holds each generation's checkpoint, version,
  definition and owner; ``_jetsourcing_projections`` the live generation and
  the daemon's state; ``_jetsourcing_dead_letters`` skipped commits.

Exactly once: a batch's rows, dead letters and checkpoint go into one
``BEGIN IMMEDIATE`` transaction whose first statement moves the checkpoint
only if it still holds the writer's last value and owner (compare-and-set);
otherwise nothing is written. The database runs in WAL mode; with the default
``synchronous=NORMAL`` a committed batch survives a crash of any process
(kill -9), and ``FULL`` also survives a power cut.

Handlers may use plain SQL on the transaction as an escape hatch
(:meth:`SqliteTransaction.execute`, SQLite only: Spark cannot run it).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any, Callable, Literal

from .errors import CheckpointConflictError, ProjectionDefinitionError, RebuildError
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
from .tables import COLUMN_TYPES, Key, Row, Table
from .transaction import RowCache

__all__ = ["SqliteStore", "SqliteTransaction", "SqliteWriter", "physical_name"]

_STRICT = sqlite3.sqlite_version_info >= (3, 37, 0)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS _jetsourcing_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS _jetsourcing_projections (
    name TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    last_generation INTEGER NOT NULL,
    state TEXT NOT NULL,
    owner TEXT,
    counters TEXT,
    error TEXT,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS _jetsourcing_generations (
    projection TEXT NOT NULL,
    generation INTEGER NOT NULL,
    version INTEGER NOT NULL,
    state TEXT NOT NULL,
    checkpoint INTEGER NOT NULL,
    definition TEXT NOT NULL,
    stream TEXT NOT NULL,
    owner TEXT,
    target INTEGER,
    created_at REAL NOT NULL,
    heartbeat_at REAL,
    PRIMARY KEY (projection, generation)
);
CREATE TABLE IF NOT EXISTS _jetsourcing_dead_letters (
    projection TEXT NOT NULL,
    generation INTEGER NOT NULL,
    position INTEGER NOT NULL,
    event_index INTEGER NOT NULL,
    stream_id TEXT NOT NULL,
    event_type TEXT NOT NULL,
    event_id TEXT NOT NULL,
    error TEXT NOT NULL,
    traceback TEXT NOT NULL,
    recorded_at TEXT NOT NULL,
    dead_at REAL NOT NULL,
    PRIMARY KEY (projection, generation, position)
);
"""

_GEN_COLUMNS = (
    "projection, generation, version, state, checkpoint, definition, stream, owner, target, created_at, heartbeat_at"
)

_CAS = (
    "UPDATE _jetsourcing_generations SET checkpoint = ?, heartbeat_at = ? "
    "WHERE projection = ? AND generation = ? AND checkpoint = ? AND owner = ? AND state IN ('live', 'building')"
)


def physical_name(table: str, generation: int) -> str:
    """The physical SQLite table holding generation ``generation`` of declared table ``table``."""
    return f"{table}__g{generation}"


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _create_sql(table: Table, physical: str) -> list[str]:
    cols = ", ".join(
        f"{_q(c.name)} {COLUMN_TYPES[c.type]}{'' if c.nullable else ' NOT NULL'}" for c in table.columns
    )
    pk = ", ".join(_q(k) for k in table.key)
    statements = [f"CREATE TABLE {_q(physical)} ({cols}, PRIMARY KEY ({pk})) WITHOUT ROWID{', STRICT' if _STRICT else ''}"]
    for i, index in enumerate(table.indexes):
        statements.append(
            f"CREATE INDEX {_q(f'{physical}__i{i}')} ON {_q(physical)} ({', '.join(_q(c) for c in index)})"
        )
    return statements


def _row(values: Sequence[Any], names: Sequence[str]) -> dict[str, Any]:
    return dict(zip(names, values))


class _TableOps:
    """Prepared SQL and row conversions for one physical table."""

    __slots__ = ("table", "physical", "select", "upsert", "delete", "values", "bools", "names", "order")

    def __init__(self, table: Table, physical: str) -> None:
        self.table = table
        self.physical = physical
        names = table.column_names
        self.names = names
        cols = ", ".join(_q(c) for c in names)
        where = " AND ".join(f"{_q(k)} = ?" for k in table.key)
        self.select = f"SELECT {cols} FROM {_q(physical)} WHERE {where}"
        self.upsert = f"INSERT OR REPLACE INTO {_q(physical)} ({cols}) VALUES ({', '.join('?' * len(names))})"
        self.delete = f"DELETE FROM {_q(physical)} WHERE {where}"
        self.order = ", ".join(_q(k) for k in table.key)
        getter = itemgetter(*names)
        self.values: Callable[[Row], tuple[Any, ...]] = getter if len(names) > 1 else (lambda row: (getter(row),))
        self.bools = tuple(c.name for c in table.columns if c.type is bool)

    def from_storage(self, values: Sequence[Any]) -> Row:
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


def _tables_of(definition: dict[str, Any]) -> list[Table]:
    return [Table.from_spec(spec) for spec in definition["tables"]]


class SqliteStore(ReadModelStore):
    """Read models in one SQLite file (created if missing). One connection; use one store per task.

    ``synchronous`` is SQLite's: ``NORMAL`` (default) survives process crashes,
    ``FULL`` also power loss. ``busy_timeout_s`` bounds how long a write waits
    for another process's write (a rebuild and the daemon take turns).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout_s: float = 30.0,
        cache_rows: int = 100_000,
    ) -> None:
        self.path = Path(path)
        self.cache_rows = cache_rows
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=busy_timeout_s, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={'FULL' if synchronous == 'FULL' else 'NORMAL'}")
        self.conn.execute("PRAGMA cache_size=-65536")
        self.conn.execute("PRAGMA temp_store=MEMORY")
        with self._write():
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self.conn.execute(statement)
            self.conn.execute(
                "INSERT OR IGNORE INTO _jetsourcing_meta (key, value) VALUES ('store_id', ?)", (uuid.uuid4().hex,)
            )
        self.store_id: str = self.conn.execute("SELECT value FROM _jetsourcing_meta WHERE key = 'store_id'").fetchone()[0]

    # -- plumbing -----------------------------------------------------------

    def _write(self) -> "_WriteTx":
        return _WriteTx(self.conn)

    def _gen(self, name: str, generation: int) -> Generation | None:
        row = self.conn.execute(
            f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND generation = ?",
            (name, generation),
        ).fetchone()
        return _generation(row) if row else None

    def _create_generation_tables(self, tables: Sequence[Table], generation: int) -> None:
        for table in tables:
            physical = physical_name(table.name, generation)
            self.conn.execute(f"DROP TABLE IF EXISTS {_q(physical)}")
            for statement in _create_sql(table, physical):
                self.conn.execute(statement)

    def _drop_generation_tables(self, name: str, generation: Generation) -> None:
        for table in _tables_of(generation.definition):
            self.conn.execute(f"DROP TABLE IF EXISTS {_q(physical_name(table.name, generation.generation))}")
        self.conn.execute(
            "DELETE FROM _jetsourcing_dead_letters WHERE projection = ? AND generation = ?", (name, generation.generation)
        )
        self.conn.execute(
            "DELETE FROM _jetsourcing_generations WHERE projection = ? AND generation = ?", (name, generation.generation)
        )

    def _check_table_names(self, projection: Projection) -> None:
        """Refuse tables whose names another projection, or a table not made by jetsourcing, already uses."""
        mine = {t.name for t in projection.tables}
        for other, definition in self.conn.execute(
            "SELECT projection, definition FROM _jetsourcing_generations WHERE projection != ? AND state != 'retired'",
            (projection.name,),
        ):
            clash = mine & {t["name"] for t in json.loads(definition)["tables"]}
            if clash:
                raise ProjectionDefinitionError(
                    f"Projection {projection.name!r} declares table(s) {sorted(clash)} already used by projection "
                    f"{other!r} in {self.path}. Rename the tables, or use another database file."
                )
        live = self.live_generation(projection.name)
        own_views = {t.name for t in _tables_of(live.definition)} if live else set()
        for name, kind in self.conn.execute("SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view')"):
            if name in mine and name not in own_views:
                raise ProjectionDefinitionError(
                    f"{kind.capitalize()} {name!r} already exists in {self.path} and was not made for projection "
                    f"{projection.name!r}. Rename the projection's table, or use another database file."
                )

    def _point_views(self, old: Generation | None, new: Generation) -> None:
        if old is not None:
            for table in _tables_of(old.definition):
                self.conn.execute(f"DROP VIEW IF EXISTS {_q(table.name)}")
        for table in _tables_of(new.definition):
            self.conn.execute(f"DROP VIEW IF EXISTS {_q(table.name)}")
            self.conn.execute(
                f"CREATE VIEW {_q(table.name)} AS SELECT * FROM {_q(physical_name(table.name, new.generation))}"
            )

    # -- generations --------------------------------------------------------

    def live_generation(self, name: str) -> Generation | None:
        row = self.conn.execute("SELECT generation FROM _jetsourcing_projections WHERE name = ?", (name,)).fetchone()
        return self._gen(name, row[0]) if row else None

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
            self.conn.execute(
                f"INSERT INTO _jetsourcing_generations ({_GEN_COLUMNS}) VALUES (?, 1, ?, 'live', 0, ?, ?, NULL, NULL, ?, NULL)",
                (projection.name, projection.version, json.dumps(projection.describe()), stream, now),
            )
            self.conn.execute(
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
            live = self.live_generation(name)
            if live is None:
                raise KeyError(f"Projection {name!r} has no read model in {self.path} yet.")
            self.conn.execute(
                "UPDATE _jetsourcing_generations SET owner = ?, heartbeat_at = ? WHERE projection = ? AND generation = ?",
                (owner, time.time(), name, live.generation),
            )
            self.conn.execute(
                "UPDATE _jetsourcing_projections SET state = ?, owner = ?, error = NULL, updated_at = ? WHERE name = ?",
                (RunState.RUNNING.value, owner, time.time(), name),
            )
            claimed = self._gen(name, live.generation)
        assert claimed is not None
        return claimed

    def create_shadow(self, projection: Projection, stream: str, owner: str, target: int) -> Generation:
        with self._write():
            # Generation numbers only grow, even past abandoned ones (dropped here), so each names one build.
            top = self.conn.execute(
                "SELECT max(generation) FROM _jetsourcing_generations WHERE projection = ?", (projection.name,)
            ).fetchone()[0]
            allocated = self.conn.execute(
                "SELECT last_generation FROM _jetsourcing_projections WHERE name = ?", (projection.name,)
            ).fetchone()
            generation = max(top or 0, allocated[0] if allocated else 0) + 1
            self.conn.execute(
                "UPDATE _jetsourcing_projections SET last_generation = ? WHERE name = ?", (generation, projection.name)
            )
            for row in self.conn.execute(
                f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state != 'live'",
                (projection.name,),
            ).fetchall():
                self._drop_generation_tables(projection.name, _generation(row))
            self._check_table_names(projection)
            now = time.time()
            self._create_generation_tables(projection.tables, generation)
            self.conn.execute(
                f"INSERT INTO _jetsourcing_generations ({_GEN_COLUMNS}) VALUES (?, ?, ?, 'building', 0, ?, ?, ?, ?, ?, ?)",
                (projection.name, generation, projection.version, json.dumps(projection.describe()), stream, owner,
                 target, now, now),
            )
            shadow = self._gen(projection.name, generation)
        assert shadow is not None
        return shadow

    def resume_shadow(self, projection: Projection, stream: str, owner: str, target: int) -> Generation | None:
        with self._write():
            row = self.conn.execute(
                f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building' "
                "ORDER BY generation DESC LIMIT 1",
                (projection.name,),
            ).fetchone()
            found = _generation(row) if row else None
            # The stored definition went through JSON: compare it in that form.
            wanted = (projection.version, json.loads(json.dumps(projection.describe())), stream)
            if found is None or (found.version, found.definition, found.stream) != wanted:
                return None
            self.conn.execute(
                "UPDATE _jetsourcing_generations SET owner = ?, target = ?, heartbeat_at = ? "
                "WHERE projection = ? AND generation = ?",
                (owner, target, time.time(), projection.name, found.generation),
            )
            return self._gen(projection.name, found.generation)

    def release_shadow(self, shadow: Generation, owner: str) -> None:
        with self._write():
            self.conn.execute(
                "UPDATE _jetsourcing_generations SET owner = NULL, heartbeat_at = NULL "
                "WHERE projection = ? AND generation = ? AND owner = ? AND state = 'building'",
                (shadow.projection, shadow.generation, owner),
            )

    def switch(self, shadow: Generation) -> bool:
        name = shadow.projection
        with self._write():
            current = self._gen(name, shadow.generation)
            if current is None or current.state != GenerationState.BUILDING or current.owner != shadow.owner:
                raise RebuildError(
                    f"Generation {shadow.generation} of {name!r} is no longer being built by this rebuild "
                    "(another rebuild replaced it?). The live model is unchanged."
                )
            live = self.live_generation(name)
            if live is not None and live.checkpoint > current.checkpoint:
                return False
            self._point_views(live, current)
            if live is not None:
                self.conn.execute(
                    "UPDATE _jetsourcing_generations SET state = 'retired', owner = NULL "
                    "WHERE projection = ? AND generation = ?",
                    (name, live.generation),
                )
            self.conn.execute(
                "UPDATE _jetsourcing_generations SET state = 'live', owner = NULL, target = NULL "
                "WHERE projection = ? AND generation = ?",
                (name, current.generation),
            )
            if live is None:
                self.conn.execute(
                    "INSERT INTO _jetsourcing_projections (name, generation, last_generation, state, updated_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (name, current.generation, current.generation, RunState.NEW.value, time.time()),
                )
            else:
                self.conn.execute(
                    "UPDATE _jetsourcing_projections SET generation = ?, updated_at = ? WHERE name = ?",
                    (current.generation, time.time(), name),
                )
        if live is not None:
            with self._write():
                self._drop_generation_tables(name, live)
        return True

    def discard(self, name: str, generation: int) -> None:
        with self._write():
            gen = self._gen(name, generation)
            if gen is not None and gen.state != GenerationState.LIVE:
                self._drop_generation_tables(name, gen)

    def writer(self, generation: Generation, owner: str) -> "SqliteWriter":
        return SqliteWriter(self, generation, owner)

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
        self.conn.execute(
            "UPDATE _jetsourcing_projections SET state = ?, counters = coalesce(?, counters), error = ?, "
            "updated_at = ? WHERE name = ? AND (owner IS NULL OR owner = ?)",
            (state.value, json.dumps(counters) if counters is not None else None,
             json.dumps(error) if error is not None else None, time.time(), name, owner),
        )

    def statuses(self) -> list[StoredStatus]:
        out = []
        rows = self.conn.execute(
            "SELECT name, generation, state, owner, counters, error, updated_at FROM _jetsourcing_projections ORDER BY name"
        ).fetchall()
        for name, generation, state, owner, counters, error, updated_at in rows:
            building_row = self.conn.execute(
                f"SELECT {_GEN_COLUMNS} FROM _jetsourcing_generations WHERE projection = ? AND state = 'building' "
                "ORDER BY generation DESC LIMIT 1",
                (name,),
            ).fetchone()
            dead = self.conn.execute(
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
                    dead_letters=dead,
                )
            )
        return out

    def dead_letters(self, name: str) -> list[DeadLetter]:
        live = self.live_generation(name)
        if live is None:
            return []
        rows = self.conn.execute(
            "SELECT projection, generation, position, event_index, stream_id, event_type, event_id, error, traceback, "
            "recorded_at, dead_at FROM _jetsourcing_dead_letters WHERE projection = ? AND generation = ? ORDER BY position",
            (name, live.generation),
        ).fetchall()
        return [DeadLetter(*row) for row in rows]

    def drop_dead_letters(self, name: str, position: int | None) -> int:
        live = self.live_generation(name)
        if live is None:
            return 0
        where, params = "projection = ? AND generation = ?", [name, live.generation]
        if position is not None:
            where, params = where + " AND position = ?", [*params, position]
        with self._write():
            return self.conn.execute(f"DELETE FROM _jetsourcing_dead_letters WHERE {where}", params).rowcount

    def dump(self, name: str) -> dict[str, list[Row]]:
        live = self.live_generation(name)
        if live is None:
            return {}
        out = {}
        for table in _tables_of(live.definition):
            ops = _TableOps(table, table.name)
            rows = self.conn.execute(f"SELECT * FROM {_q(table.name)} ORDER BY {ops.order}").fetchall()
            out[table.name] = [ops.from_storage(r) for r in rows]
        return out

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "SqliteStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WriteTx:
    """``with store._write():`` -- one BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")


class SqliteWriter(Writer):
    """Writes one generation for one owner; keeps committed rows cached between batches."""

    def __init__(self, store: SqliteStore, generation: Generation, owner: str) -> None:
        self.store = store
        self.generation = generation
        self.owner = owner
        self.checkpoint = generation.checkpoint
        tables = _tables_of(generation.definition)
        self.tables = {t.name: t for t in tables}
        self.ops = {t.name: _TableOps(t, physical_name(t.name, generation.generation)) for t in tables}
        self.physical_names = {t.name: _q(op.physical) for t, op in zip(tables, self.ops.values())}
        self.cache = RowCache(self.tables, store.cache_rows)
        for name, ops in self.ops.items():
            if store.conn.execute(f"SELECT 1 FROM {_q(ops.physical)} LIMIT 1").fetchone() is None:
                self.cache.complete.add(name)

    def transaction(self) -> "SqliteTransaction":
        return SqliteTransaction(self)

    def touch(self, counters: dict[str, Any] | None = None) -> bool:
        gen = self.generation
        conn = self.store.conn
        now = time.time()
        owned = conn.execute(
            "UPDATE _jetsourcing_generations SET heartbeat_at = ? WHERE projection = ? AND generation = ? AND owner = ? "
            "AND checkpoint = ? AND state IN ('live', 'building')",
            (now, gen.projection, gen.generation, self.owner, self.checkpoint),
        ).rowcount == 1
        if owned and counters is not None and gen.state == GenerationState.LIVE:
            conn.execute(
                "UPDATE _jetsourcing_projections SET counters = ?, updated_at = ? WHERE name = ? AND owner = ?",
                (json.dumps(counters), now, gen.projection, self.owner),
            )
        return owned

    def close(self) -> None:
        self.cache.clear()


class SqliteTransaction(WriteTransaction):
    """A batch's transaction on SQLite: rows, dead letters and checkpoint commit together.

    Handlers may also run plain SQL with :meth:`execute`; write ``{table}``
    for the physical table of the generation being written (double literal
    braces). SQL makes the handler SQLite-only.
    """

    def __init__(self, writer: SqliteWriter) -> None:
        super().__init__(writer.tables, writer.cache)
        self._writer = writer
        self._conn = writer.store.conn
        self._begun = False
        self._raw = False
        self._letters: list[DeadLetter] = []

    def _fetch(self, table: Table, key: Key) -> Row | None:
        ops = self._writer.ops[table.name]
        row = self._conn.execute(ops.select, table.key_values(key)).fetchone()
        return None if row is None else ops.from_storage(row)

    def table_name(self, table: str) -> str:
        """The quoted physical name of declared ``table`` in the generation this transaction writes."""
        return self._writer.physical_names[table]

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        """Run plain SQL inside the batch's transaction (after this transaction's pending writes); return its rows."""
        self._begin()
        self._flush()
        self._reset()
        self._raw = True
        if self.cache is not None:
            self.cache.clear()
        return self._conn.execute(sql.format_map(self._writer.physical_names), params).fetchall()

    def dead_letter(self, letter: DeadLetter) -> None:
        self._letters.append(letter)

    def _begin(self) -> None:
        if not self._begun:
            self._conn.execute("BEGIN IMMEDIATE")
            self._begun = True

    def _flush(self) -> None:
        conn = self._conn
        for name, rows in self.writes.items():
            if not rows:
                continue
            ops = self._writer.ops[name]
            table = ops.table
            deletes = [table.key_values(k) for k, r in rows.items() if r is None]
            if deletes:
                conn.executemany(ops.delete, deletes)
            values = ops.values
            upserts = [values(r) for r in rows.values() if r is not None]
            if upserts:
                conn.executemany(ops.upsert, upserts)

    def commit(self, checkpoint: int) -> None:
        writer = self._writer
        gen = writer.generation
        conn = self._conn
        if checkpoint < writer.checkpoint:
            raise ValueError(f"Checkpoint {checkpoint} is behind the stored {writer.checkpoint}.")
        try:
            self._begin()
            moved = conn.execute(
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
                conn.executemany(
                    "INSERT OR REPLACE INTO _jetsourcing_dead_letters VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (gen.projection, gen.generation, d.position, d.index, d.stream_id, d.event_type, d.event_id,
                         d.error, d.traceback, d.recorded_at, d.dead_at)
                        for d in self._letters
                    ],
                )
            conn.execute("COMMIT")
        except BaseException:
            self._abort()
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
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # a failed COMMIT may already have rolled back
        self._reset()
        self._letters.clear()
        if self._raw:
            self._raw = False
            self._writer.cache.clear()
