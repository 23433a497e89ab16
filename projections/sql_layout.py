"""The SQL read-model layout shared by every dialect: the bookkeeping tables, generation tables' names and the
statements that address them. :mod:`projections.sql` (the store) and :mod:`projections.sql_writer` (its batches)
build on it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Protocol

from .errors import ProjectionDefinitionError
from .store import Generation, GenerationState
from .tables import Row, Table, plain_text

SCHEMA = """
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

GEN_COLUMNS = (
    "projection, generation, version, state, checkpoint, definition, stream, owner, target, created_at, heartbeat_at"
)

CAS = (
    "UPDATE _jetsourcing_generations SET checkpoint = ?, heartbeat_at = ? "
    "WHERE projection = ? AND generation = ? AND checkpoint = ? AND owner = ? AND state IN ('live', 'building')"
)

DEAD_LETTER_TABLE = Table(
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


def sql_text(value: str) -> str:
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


def generation_from_row(row: Sequence[Any]) -> Generation:
    """A ``_jetsourcing_generations`` row (columns in :data:`GEN_COLUMNS`' order) as a :class:`Generation`."""
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
