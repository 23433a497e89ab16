"""What handlers write through: a small, backend-neutral transaction over declared tables.

Handlers see only :class:`Transaction`: ``get``, ``upsert`` and ``delete`` of
whole rows by key. That is all a read model needs to be built the same way by
the SQLite daemon, by a future PostgreSQL store, and by Spark (which folds
each entity's events through the same handlers into a :class:`MemoryStore`).

:class:`BufferedTransaction` implements the semantics once for every backend:
reads see the transaction's own writes; writes are kept in memory and handed
to the backend in one go when the transaction commits; a rollback forgets
them. A backend only supplies "fetch one committed row" and "store these
changes". An optional :class:`RowCache` keeps committed rows between
transactions of the single writer of a read model, so replays rarely read
back what they just wrote.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from .errors import RowError
from .tables import Key, Row, Table

if TYPE_CHECKING:
    from eventstore import RecordedEvent

    from .projection import Projection

__all__ = ["BufferedTransaction", "MemoryStore", "MemoryTransaction", "RowCache", "Transaction", "fold"]


class _Missing:
    __slots__ = ()


_MISSING: Final = _Missing()


class Transaction(ABC):
    """The read-model API handlers use: whole rows of declared tables, by key.

    Guarantees, in every backend:

    * ``get`` returns a fresh copy of the row (mutating it changes nothing
      until you ``upsert`` it), or None; it sees this transaction's writes.
    * ``upsert`` stores the whole row (see :meth:`Table.row`); ``delete`` of a
      missing row is a no-op.
    * Nothing is visible to readers until the daemon commits the batch,
      together with the checkpoint; a failed batch leaves no trace.
    """

    @abstractmethod
    def get(self, table: str, key: Key) -> Row | None:
        """The row of ``table`` with ``key``, or None."""

    @abstractmethod
    def upsert(self, table: str, key: Key, row: Mapping[str, Any]) -> None:
        """Insert the row, or replace the existing row with that key (every column; missing nullable ones are None)."""

    @abstractmethod
    def delete(self, table: str, key: Key) -> None:
        """Delete the row with ``key`` if there is one."""


class RowCache:
    """Committed rows of one writer's tables (None = known absent), kept between transactions, bounded.

    Only valid while its owner is the only writer of the tables: the owner
    must :meth:`clear` it whenever that may not hold (a lost checkpoint race,
    raw SQL). A table marked *complete* (it was empty when the cache started)
    answers a miss with "absent" without asking the backend; overflowing the
    bound clears everything, including that mark.
    """

    def __init__(self, tables: Iterable[str], max_rows: int = 100_000) -> None:
        self.rows: dict[str, dict[Key, Row | None]] = {t: {} for t in tables}
        self.complete: set[str] = set()
        self.max_rows = max_rows

    def clear(self) -> None:
        """Forget everything."""
        for rows in self.rows.values():
            rows.clear()
        self.complete.clear()

    def merge(self, changes: Mapping[str, Mapping[Key, Row | None]]) -> None:
        """Record rows known to be committed."""
        for table, rows in changes.items():
            if rows:
                self.rows[table].update(rows)
        if sum(len(r) for r in self.rows.values()) > self.max_rows:
            self.clear()


class BufferedTransaction(Transaction):
    """:class:`Transaction` semantics on top of a backend's ``_fetch``; writes wait in memory for the commit.

    Subclasses implement :meth:`_fetch` (one committed row) and their own
    commit, which stores :attr:`writes` (per table: key -> full row, or None
    for a delete) and then calls :meth:`_committed`.
    """

    def __init__(self, tables: Mapping[str, Table], cache: RowCache | None = None) -> None:
        self.tables = dict(tables)
        self.cache = cache
        self.reads: dict[str, dict[Key, Row | None]] = {t: {} for t in tables}
        self.writes: dict[str, dict[Key, Row | None]] = {t: {} for t in tables}

    @abstractmethod
    def _fetch(self, table: Table, key: Key) -> Row | None:
        """The committed (or, inside a backend transaction, current) row; None if absent."""

    def _unknown(self, table: str) -> RowError:
        return RowError(f"Unknown table {table!r}; this projection declares: {', '.join(self.tables) or 'none'}.")

    def get(self, table: str, key: Key) -> Row | None:
        writes = self.writes.get(table)
        if writes is None:
            raise self._unknown(table)
        row = writes.get(key, _MISSING)
        if row is _MISSING:
            reads = self.reads[table]
            row = reads.get(key, _MISSING)
            if row is _MISSING:
                cache = self.cache
                if cache is not None:
                    row = cache.rows[table].get(key, _MISSING)
                    if row is _MISSING and table in cache.complete:
                        row = None
                if row is _MISSING:
                    declared = self.tables[table]
                    declared.key_values(key)
                    row = self._fetch(declared, key)
                    reads[key] = row
        return None if row is None else dict(row)  # type: ignore[arg-type]

    def upsert(self, table: str, key: Key, row: Mapping[str, Any]) -> None:
        declared = self.tables.get(table)
        if declared is None:
            raise self._unknown(table)
        self.writes[table][key] = declared.row(key, row)

    def delete(self, table: str, key: Key) -> None:
        declared = self.tables.get(table)
        if declared is None:
            raise self._unknown(table)
        declared.key_values(key)
        self.writes[table][key] = None

    @property
    def changed(self) -> bool:
        """True when the transaction holds writes."""
        return any(self.writes.values())

    def _committed(self) -> None:
        """Call after the backend stored :attr:`writes`: remember what is now committed."""
        if self.cache is not None:
            self.cache.merge(self.reads)
            self.cache.merge(self.writes)
        self._reset()

    def _reset(self) -> None:
        for rows in self.reads.values():
            rows.clear()
        for rows in self.writes.values():
            rows.clear()


class MemoryStore:
    """A read model held in dicts: the reference backend, used by tests and by Spark's per-entity folds.

    ``data[table][key]`` is the committed row. Build it with :func:`fold` or
    write through :meth:`transaction`.
    """

    def __init__(self, tables: Iterable[Table]) -> None:
        self.tables = {t.name: t for t in tables}
        self.data: dict[str, dict[Key, Row]] = {name: {} for name in self.tables}

    @classmethod
    def for_projection(cls, projection: "Projection") -> "MemoryStore":
        """An empty store with the projection's tables."""
        return cls(projection.tables)

    def transaction(self) -> "MemoryTransaction":
        """A new transaction; as a context manager it commits on success and rolls back on an exception."""
        return MemoryTransaction(self)

    def get(self, table: str, key: Key) -> Row | None:
        """A copy of the committed row, or None."""
        row = self.data[table].get(key)
        return None if row is None else dict(row)

    def rows(self, table: str) -> list[Row]:
        """Copies of every committed row of ``table``, sorted by key."""
        declared = self.tables[table]
        return [dict(row) for _, row in sorted(self.data[table].items(), key=lambda kv: declared.key_values(kv[0]))]

    def dump(self) -> dict[str, list[Row]]:
        """Every table's rows, sorted by key: compare two read models with ``==``."""
        return {name: self.rows(name) for name in self.tables}


class MemoryTransaction(BufferedTransaction):
    """A transaction on a :class:`MemoryStore`."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store.tables)
        self.store = store

    def _fetch(self, table: Table, key: Key) -> Row | None:
        return self.store.data[table.name].get(key)

    def commit(self) -> None:
        """Make the writes visible in the store."""
        for table, rows in self.writes.items():
            data = self.store.data[table]
            for key, row in rows.items():
                if row is None:
                    data.pop(key, None)
                else:
                    data[key] = row
        self._committed()

    def rollback(self) -> None:
        """Forget the writes."""
        self._reset()

    def __enter__(self) -> "MemoryTransaction":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.rollback()


def fold(projection: "Projection", events: Iterable["RecordedEvent"], store: MemoryStore | None = None) -> MemoryStore:
    """Apply ``events`` (in ``(position, index)`` order) to ``store`` (default: a new one) through the handlers.

    This is the whole projection logic without a daemon: the same handlers the
    SQLite daemon runs, on the same :class:`Transaction` API. Spark calls it
    once per entity group. A handler error propagates (nothing is committed).
    """
    store = store if store is not None else MemoryStore.for_projection(projection)
    with store.transaction() as tx:
        apply = projection.apply
        for event in events:
            apply(event, tx)
    return store
