"""One contract suite for the handler API (:class:`Transaction`) and the stores' exactly-once rules, run
against every backend: the in-memory store, SQLite and a real PostgreSQL server."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from eventstore import RecordedEvent, StreamId, TypeRegistry
from projections import (
    ErrorPolicy,
    MemoryStore,
    PostgresStore,
    ProjectionDefinitionError,
    ReadModelStore,
    RowError,
    SqliteStore,
    Table,
)
from projections.applier import Applier, Counters
from projections.errors import CheckpointConflictError
from projections.projection import Projection
from projections.store import Writer
from projections.transaction import BufferedTransaction

from projection_examples import AccountBalances
from tests.support.postgres import unique_schema

StoreFactory = Callable[[], ReadModelStore]
"""Opens another connection to the same read-model database."""


class Example(Projection):
    name = "contract"
    tables = (
        Table("people", key="id", columns={"id": str, "name": str, "age": int | None, "score": float | None,
                                           "active": bool | None, "photo": bytes | None}),
        Table("pairs", key=("a", "b"), columns={"a": str, "b": int, "weight": float}),
    )


class Backend(Protocol):
    def begin(self) -> BufferedTransaction: ...
    def commit(self, tx: BufferedTransaction) -> None: ...
    def rollback(self, tx: BufferedTransaction) -> None: ...
    def committed(self, table: str, key: Any) -> dict[str, Any] | None: ...
    def restart(self) -> None: ...


class MemoryBackend:
    def __init__(self) -> None:
        self.store = MemoryStore.for_projection(Example())

    def begin(self) -> BufferedTransaction:
        return self.store.transaction()

    def commit(self, tx: BufferedTransaction) -> None:
        tx.commit()  # type: ignore[attr-defined]

    def rollback(self, tx: BufferedTransaction) -> None:
        tx.rollback()  # type: ignore[attr-defined]

    def committed(self, table: str, key: Any) -> dict[str, Any] | None:
        return self.store.get(table, key)

    def restart(self) -> None:
        pass


class StoreBackend:
    def __init__(self, connect: StoreFactory) -> None:
        self.connect = connect
        self.store = connect()
        self.store.ensure_live(Example(), "S")
        self.writer: Writer = self.store.writer(self.store.claim("contract", "me"), "me")
        self.position = 0

    def begin(self) -> BufferedTransaction:
        return self.writer.transaction()

    def commit(self, tx: BufferedTransaction) -> None:
        self.position += 1
        tx.commit(self.position)  # type: ignore[call-arg]

    def rollback(self, tx: BufferedTransaction) -> None:
        tx.rollback()  # type: ignore[attr-defined]

    def committed(self, table: str, key: Any) -> dict[str, Any] | None:
        reader = self.connect()  # another connection: what readers see
        try:
            return reader.get(table, key)
        finally:
            reader.close()

    def restart(self) -> None:
        """Forget every cached row: reads must come from the database."""
        self.store.close()
        self.store = self.connect()
        self.writer = self.store.writer(self.store.claim("contract", "me"), "me")


def _factory(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Connections to one fresh read-model database: a SQLite file, or a PostgreSQL schema of its own."""
    if kind == "sqlite":
        path = tmp_path / "contract.sqlite3"
        return lambda: SqliteStore(path)
    url, schema = request.getfixturevalue("postgres_url"), unique_schema()
    return lambda: PostgresStore(url, schema=schema, timeout_s=10)


@pytest.fixture(params=["sqlite", "postgres"])
def connect(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    return _factory(request.param, request, tmp_path)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "memory":
        yield MemoryBackend()
        return
    b = StoreBackend(_factory(request.param, request, tmp_path))
    yield b
    b.store.close()


ALICE = {"name": "Alice", "age": 30, "score": 1.5, "active": True, "photo": b"\x00\x01"}


def test_upsert_then_get_sees_own_writes_and_commit_publishes(backend: Backend) -> None:
    tx = backend.begin()
    assert tx.get("people", "a") is None
    tx.upsert("people", "a", ALICE)
    assert tx.get("people", "a") == {"id": "a", **ALICE}
    assert backend.committed("people", "a") is None
    backend.commit(tx)
    assert backend.committed("people", "a") == {"id": "a", **ALICE}
    backend.restart()
    assert backend.begin().get("people", "a") == {"id": "a", **ALICE}


def test_get_returns_a_copy(backend: Backend) -> None:
    tx = backend.begin()
    tx.upsert("people", "a", ALICE)
    row = tx.get("people", "a")
    assert row is not None
    row["name"] = "changed"
    assert tx.get("people", "a")["name"] == "Alice"  # type: ignore[index]
    backend.commit(tx)
    tx = backend.begin()
    row = tx.get("people", "a")
    row["name"] = "changed again"  # type: ignore[index]
    backend.commit(tx)
    assert backend.committed("people", "a")["name"] == "Alice"  # type: ignore[index]


def test_upsert_replaces_the_whole_row_and_missing_nullable_columns_are_none(backend: Backend) -> None:
    tx = backend.begin()
    tx.upsert("people", "a", ALICE)
    backend.commit(tx)
    tx = backend.begin()
    tx.upsert("people", "a", {"name": "Alice B."})
    backend.commit(tx)
    assert backend.committed("people", "a") == {
        "id": "a", "name": "Alice B.", "age": None, "score": None, "active": None, "photo": None,
    }


def test_delete_and_delete_of_missing_row(backend: Backend) -> None:
    tx = backend.begin()
    tx.upsert("people", "a", ALICE)
    tx.delete("people", "zzz")
    backend.commit(tx)
    tx = backend.begin()
    tx.delete("people", "a")
    assert tx.get("people", "a") is None
    tx.upsert("people", "b", {"name": "Bob"})
    backend.commit(tx)
    assert backend.committed("people", "a") is None
    assert backend.committed("people", "b") is not None
    backend.restart()
    tx = backend.begin()
    assert tx.get("people", "a") is None
    tx.upsert("people", "a", {"name": "Alice again"})
    backend.commit(tx)
    assert backend.committed("people", "a")["name"] == "Alice again"  # type: ignore[index]


def test_rollback_leaves_no_trace(backend: Backend) -> None:
    tx = backend.begin()
    tx.upsert("people", "a", ALICE)
    backend.commit(tx)
    tx = backend.begin()
    tx.upsert("people", "a", {"name": "Mallory"})
    tx.upsert("people", "m", {"name": "Mallory"})
    tx.delete("people", "a")
    backend.rollback(tx)
    assert backend.committed("people", "m") is None
    assert backend.committed("people", "a") == {"id": "a", **ALICE}
    tx = backend.begin()
    assert tx.get("people", "a") == {"id": "a", **ALICE}
    assert tx.get("people", "m") is None


def test_composite_keys(backend: Backend) -> None:
    tx = backend.begin()
    tx.upsert("pairs", ("x", 1), {"weight": 2})
    tx.upsert("pairs", ("x", 2), {"a": "x", "b": 2, "weight": 3.5})
    backend.commit(tx)
    assert backend.committed("pairs", ("x", 1)) == {"a": "x", "b": 1, "weight": 2.0}
    assert isinstance(backend.committed("pairs", ("x", 1))["weight"], float)  # type: ignore[index]
    backend.restart()
    tx = backend.begin()
    assert tx.get("pairs", ("x", 2)) == {"a": "x", "b": 2, "weight": 3.5}
    tx.delete("pairs", ("x", 1))
    backend.commit(tx)
    assert backend.committed("pairs", ("x", 1)) is None


@pytest.mark.parametrize(
    ("table", "key", "row", "message"),
    [
        ("nope", "a", {"name": "x"}, "Unknown table"),
        ("people", "a", {"name": "x", "nick": "y"}, "no column 'nick'"),
        ("people", "a", {"age": 3}, "not nullable"),
        ("people", "a", {"name": 5}, "is str"),
        ("people", "a", {"name": "x", "age": True}, "is int"),
        ("people", "a", {"name": "x", "age": 1.5}, "is int"),
        ("people", "a", {"name": "x", "age": 2**63}, "64 bits"),
        ("people", "a", {"name": "x", "active": 1}, "is bool"),
        ("people", "a", {"id": "b", "name": "x"}, "key says"),
        ("people", 7, {"name": "x"}, "must be str"),
        ("people", ("a",), {"name": "x"}, "must be str"),
        ("pairs", "x", {"weight": 1.0}, "tuple"),
        ("pairs", ("x", "1"), {"weight": 1.0}, "must be int"),
        ("people", "a", {"name": "nul\x00inside"}, "NUL character"),
        ("people", "a\x00", {"name": "x"}, "NUL character"),
        ("people", "a", {"name": "lone \ud800"}, "no UTF-8 form"),
        ("pairs", ("\udfff", 1), {"weight": 1.0}, "no UTF-8 form"),
    ],
)
def test_rows_that_do_not_fit_the_declaration_are_refused_the_same_way(
    backend: Backend, table: str, key: Any, row: dict[str, Any], message: str
) -> None:
    tx = backend.begin()
    with pytest.raises(RowError, match=message):
        tx.upsert(table, key, row)


def test_the_checkpoint_is_a_compare_and_set(connect: StoreFactory) -> None:
    b = StoreBackend(connect)
    tx = b.begin()
    tx.upsert("people", "a", ALICE)
    b.commit(tx)
    # Another owner claims the projection (e.g. after our lease expired): our next commit must change nothing.
    other = connect()
    other.claim("contract", "someone-else")
    other.close()
    tx = b.begin()
    tx.upsert("people", "b", {"name": "Bob"})
    with pytest.raises(CheckpointConflictError):
        tx.commit(2)  # type: ignore[call-arg]
    assert b.committed("people", "b") is None
    b.store.close()


def _balance(account: str) -> dict[str, Any]:
    return {"account_id": account, "owner": "x", "balance": 5, "deposits": 1, "withdrawals": 0, "last_position": 1,
            "overdrawn": False}


def test_a_resumed_shadow_belongs_to_its_new_builder_alone(connect: StoreFactory) -> None:
    projection = AccountBalances()
    with contextlib.closing(connect()) as store:
        store.ensure_live(projection, "S")
        shadow = store.create_shadow(projection, "S", "first", 10)
        first = store.writer(shadow, "first")
        tx = first.transaction()
        tx.upsert("balances", "a", _balance("a"))
        tx.commit(4)
        store.release_shadow(first.generation, "first")
        assert store.resume_shadow(projection, "OTHER-STREAM", "second", 20) is None

        resumed = store.resume_shadow(projection, "S", "second", 20)
        assert resumed is not None
        assert (resumed.generation, resumed.checkpoint, resumed.owner, resumed.target) == (shadow.generation, 4,
                                                                                          "second", 20)
        late = first.transaction()  # the interrupted builder, still holding a writer: refused
        late.upsert("balances", "b", _balance("b"))
        with pytest.raises(CheckpointConflictError):
            late.commit(6)
        second = store.writer(resumed, "second")
        assert second.checkpoint == 4 and second.transaction().get("balances", "a") is not None
        store.discard(projection.name, shadow.generation, "first")  # the first builder giving up late: no effect
        assert second.transaction().get("balances", "a") is not None

        class Bumped(AccountBalances):
            version = 2

        assert store.resume_shadow(Bumped(), "S", "third", 20) is None


def test_the_raw_sql_escape_hatch_runs_in_the_batch_transaction(connect: StoreFactory) -> None:
    b = StoreBackend(connect)
    placeholder = "?" if isinstance(b.store, SqliteStore) else "%s"
    tx = b.begin()
    tx.upsert("people", "a", ALICE)
    rows = tx.execute("SELECT count(*) FROM {people}")  # type: ignore[attr-defined]
    assert rows == [(1,)]  # pending writes are flushed first
    tx.execute(f"UPDATE {{people}} SET age = age + 1 WHERE id = {placeholder}", ("a",))  # type: ignore[attr-defined]
    assert tx.get("people", "a")["age"] == 31  # type: ignore[index]
    b.rollback(tx)
    assert b.committed("people", "a") is None
    tx = b.begin()
    tx.upsert("people", "a", ALICE)
    tx.execute("UPDATE {people} SET age = 99")  # type: ignore[attr-defined]
    b.commit(tx)
    assert b.committed("people", "a")["age"] == 99  # type: ignore[index]
    assert b.begin().get("people", "a")["age"] == 99  # type: ignore[index]
    b.store.close()


def test_a_handler_failing_because_its_generation_was_switched_away_is_a_conflict_not_a_poison_event(
    connect: StoreFactory,
) -> None:
    projection = AccountBalances()
    projection.bind(TypeRegistry())
    live_store = connect()
    live_store.ensure_live(projection, "S")
    writer = live_store.writer(live_store.claim(projection.name, "daemon"), "daemon")
    applier = Applier(projection, writer, ErrorPolicy.DEAD_LETTER, Counters())

    def deposit(position: int) -> RecordedEvent:
        return RecordedEvent(position, 0, StreamId("Account", f"a{position}"), 1, "Deposited", 1, "id", b'{"amount":1}',
                             "2025-01-01T00:00:00+00:00", registry=None)

    with contextlib.closing(connect()) as rebuild_store:  # another process rebuilds and switches; gen 1 is dropped
        shadow = rebuild_store.create_shadow(projection, "S", "rebuild", 0)
        assert rebuild_store.switch(shadow)
    # The handler's get() now fails on the dropped table (or .data without a registry): not the event's fault.
    with pytest.raises(CheckpointConflictError):
        applier.apply([deposit(1)])
    assert live_store.dead_letters(projection.name) == []
    live_store.close()


def test_the_query_helpers_read_the_live_model_as_readers_see_it(connect: StoreFactory) -> None:
    b = StoreBackend(connect)
    tx = b.begin()
    tx.upsert("people", "b", {"name": "Bob", "age": 40})
    tx.upsert("people", "a", ALICE)
    tx.upsert("people", "c", {"name": "Carol", "age": 40})
    tx.upsert("pairs", ("x", 1), {"weight": 1.0})
    b.commit(tx)
    reader = connect()
    try:
        assert [r["id"] for r in reader.rows("people")] == ["a", "b", "c"]  # sorted by key
        assert [r["id"] for r in reader.rows("people", {"age": 40})] == ["b", "c"]
        assert [r["id"] for r in reader.rows("people", {"score": None})] == ["b", "c"]
        assert reader.rows("people", {"name": "Nobody"}) == []
        assert reader.get("people", "a") == {"id": "a", **ALICE}
        assert reader.get("pairs", ("x", 1)) == {"a": "x", "b": 1, "weight": 1.0}
        assert reader.get("people", "zzz") is None
        with pytest.raises(RowError, match="has a table 'nope'"):
            reader.get("nope", "a")
        with pytest.raises(RowError, match="no column 'nick'"):
            reader.rows("people", {"nick": "x"})
        with pytest.raises(RowError, match="must be str"):
            reader.get("people", 5)
    finally:
        reader.close()
        b.store.close()


def test_a_table_not_made_by_jetsourcing_is_never_taken_over(connect: StoreFactory) -> None:
    store = connect()
    try:
        store.conn.execute("CREATE TABLE people (id TEXT)")  # type: ignore[attr-defined]
        with pytest.raises(ProjectionDefinitionError, match="already exists"):
            store.ensure_live(Example(), "S")
        assert store.live_generation("contract") is None  # nothing half-made
    finally:
        store.close()


def _events(registry: TypeRegistry, *specs: tuple[int, str, bytes]) -> list[RecordedEvent]:
    return [RecordedEvent(position, 0, StreamId("Account", "a"), position, type_name, 1, f"id{position}", data,
                          "2025-01-01T00:00:00+00:00", registry=registry)
            for position, type_name, data in specs]


def test_a_batch_retried_after_part_of_it_committed_applies_each_commit_once(connect: StoreFactory) -> None:
    projection = AccountBalances()
    registry = TypeRegistry()
    projection.bind(registry)
    store = connect()
    try:
        store.ensure_live(projection, "S")
        writer = store.writer(store.claim(projection.name, "daemon"), "daemon")
        applier = Applier(projection, writer, ErrorPolicy.DEAD_LETTER, Counters())
        batch = _events(registry, (1, "AccountOpened", b'{"owner":"o"}'), (2, "Deposited", b'{"amount":5}'),
                        (3, "Deposited", b'{"amount":7}'))
        applier.apply(batch[:2])  # what went in before the store failed part-way
        applier.apply(batch)  # the daemon's retry of the whole batch
        [row] = store.rows("balances")
        assert (row["balance"], row["deposits"], writer.checkpoint) == (12, 2, 3)
        tx = writer.transaction()
        tx.upsert("balances", "b", _balance("b"))
        with pytest.raises(ValueError, match="not past the stored 3"):
            tx.commit(3)  # writes at the stored checkpoint would be a second application
    finally:
        store.close()
