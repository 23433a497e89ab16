"""How a batch reaches a SQL read model exactly once, and how it interleaves with a blue/green switch.

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
  only briefly (:meth:`~projections.sql.SqlStore.lock_briefly`); if readers hold them, the
  switch rolls back and is tried again with backoff, for at most the
  store's timeout, and readers wait at most that brief moment. A drop of
  old tables waits as briefly, then leaves them for later. SQLite's
  readers (WAL) never wait for a writer.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, NoReturn

from .errors import CheckpointConflictError
from .sql_layout import CAS, DEAD_LETTER_TABLE, physical_name, sql_text, tables_of, upsert_sql
from .store import DeadLetter, Generation, GenerationState, Writer, WriteTransaction
from .tables import Key, Row, Table
from .transaction import RowCache

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .sql import SqlStore

__all__ = ["SqlTransaction", "SqlWriter"]

log = logging.getLogger("projections")


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
                CAS, (checkpoint, time.time(), gen.projection, gen.generation, writer.checkpoint, writer.owner)
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
                    store.sql(upsert_sql("_jetsourcing_dead_letters", DEAD_LETTER_TABLE)),
                    [
                        (gen.projection, gen.generation, d.position, d.index, sql_text(d.stream_id), sql_text(d.event_type),
                         sql_text(d.event_id), sql_text(d.error), sql_text(d.traceback), d.recorded_at, d.dead_at)
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
