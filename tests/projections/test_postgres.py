"""What only the PostgreSQL store has to show: selection by URL, schemas, deadlines, reconnection, and a switch
that waits for a commit in flight. The rest of its contract is the shared suite (test_projections_contract)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pydantic import ValidationError

from eventstore import RecordedEvent, StreamId, TypeRegistry
from projections import (
    ErrorPolicy,
    PostgresStore,
    Projection,
    ProjectionError,
    ProjectionSettings,
    SqliteStore,
    Table,
    open_store,
)
from projections.applier import Applier, Counters
from projections.store import Writer

from projection_examples import AccountBalances
from tests.support.postgres import unique_schema


def _balance(account: str, balance: int = 5) -> dict[str, Any]:
    return {"account_id": account, "owner": "x", "balance": balance, "deposits": 1, "withdrawals": 0,
            "last_position": 1, "overdrawn": False, "average_deposit": None}


def _live_writer(store: PostgresStore, owner: str = "me") -> Writer:
    """The writer of AccountBalances' live generation in ``store``, created on first use."""
    projection = AccountBalances()
    store.ensure_live(projection, "S")
    return store.writer(store.claim(projection.name, owner), owner)


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgresStore]:
    with PostgresStore(postgres_url, schema=unique_schema(), timeout_s=5) as opened:
        yield opened


def test_the_settings_select_the_store_by_url(postgres_url: str, tmp_path: Any) -> None:
    schema = unique_schema()
    pg = open_store(ProjectionSettings(database=postgres_url, postgres_schema=schema))
    assert isinstance(pg, PostgresStore) and pg.schema == schema
    pg.close()
    lite = open_store(ProjectionSettings(database=str(tmp_path / "rm.sqlite3")))
    assert isinstance(lite, SqliteStore)
    lite.close()
    assert ProjectionSettings(database="postgresql://u:secret@db:5432/x").database_name == "postgresql://u***@db:5432/x"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"database": "mysql://db/x"}, "not a read-model database"),
        ({"database": "  "}, "SQLite file or a postgresql:// URL"),
        ({"postgres_schema": "Bad-Name"}, "postgres_schema"),
        ({"postgres_schema": "x" * 64}, "postgres_schema"),
        ({"postgres_timeout_s": 0}, "postgres_timeout_s"),
    ],
)
def test_bad_database_settings_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ProjectionSettings(**overrides)


@pytest.mark.parametrize("schema", ["", "Public", "a b", "x;drop", "1abc", 7, "y" * 64, "abc\n"])
def test_a_bad_schema_is_refused_before_connecting(schema: Any) -> None:
    with pytest.raises(ProjectionError, match="Invalid PostgreSQL schema"):
        PostgresStore("postgresql://127.0.0.1:1/none", schema=schema)


def test_schemas_are_separate_read_model_databases(postgres_url: str) -> None:
    projection = AccountBalances()
    a, b = unique_schema(), unique_schema()
    with PostgresStore(postgres_url, schema=a) as first, PostgresStore(postgres_url, schema=b) as second:
        for store in (first, second):
            store.ensure_live(projection, "S")
        writer = first.writer(first.claim(projection.name, "me"), "me")
        tx = writer.transaction()
        tx.upsert("balances", "acc", _balance("acc"))
        tx.commit(1)
        assert first.get("balances", "acc") == _balance("acc")
        assert second.get("balances", "acc") is None
        assert first.store_id != second.store_id  # leases are per store: two schemas never share one


def test_an_unreachable_server_fails_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(ProjectionError, match="Cannot connect to the read-model database"):
        PostgresStore("postgresql://127.0.0.1:1/none", timeout_s=2)
    assert time.monotonic() - started < 5


def test_a_server_that_never_answers_fails_within_the_timeout() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts the connection, never says a word
    port = silent.getsockname()[1]
    try:
        started = time.monotonic()
        with pytest.raises(ProjectionError, match="Cannot connect"):
            PostgresStore(f"postgresql://u@127.0.0.1:{port}/none?sslmode=disable", timeout_s=2)
        assert time.monotonic() - started < 6
    finally:
        silent.close()


def test_a_statement_that_runs_too_long_is_cancelled_at_the_timeout(postgres_url: str) -> None:
    with PostgresStore(postgres_url, schema=unique_schema(), timeout_s=1) as store:
        writer = _live_writer(store)
        tx = writer.transaction()
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            tx.execute("SELECT pg_sleep(10)")  # type: ignore[attr-defined]
        assert time.monotonic() - started < 4
        tx.rollback()
        tx = writer.transaction()
        tx.upsert("balances", "a", _balance("a"))
        tx.commit(1)  # the store goes on
        assert store.get("balances", "a") is not None


def _terminate(postgres_url: str, store: PostgresStore) -> None:
    pid = store.conn.info.backend_pid
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_a_lost_connection_fails_one_attempt_and_the_retried_batch_commits_once(postgres_url: str) -> None:
    with PostgresStore(postgres_url, schema=unique_schema(), timeout_s=5) as store:
        writer = _live_writer(store)
        tx = writer.transaction()
        tx.upsert("balances", "a", _balance("a", 1))
        tx.commit(1)
        _terminate(postgres_url, store)  # a restarted server, a failover, an idle connection cut

        tx = writer.transaction()
        tx.upsert("balances", "a", _balance("a", 2))
        with pytest.raises(store.transient_errors):
            tx.commit(2)
        tx = writer.transaction()  # what the daemon does: the same batch again
        tx.upsert("balances", "a", _balance("a", 2))
        tx.commit(2)
        assert writer.checkpoint == 2 and store.get("balances", "a") == _balance("a", 2)
        assert store.live_generation(AccountBalances.name).checkpoint == 2  # type: ignore[union-attr]


def test_a_switch_waits_for_a_commit_in_flight_and_then_refuses_a_shadow_left_behind(postgres_url: str) -> None:
    projection = AccountBalances()
    schema = unique_schema()
    with PostgresStore(postgres_url, schema=schema) as store:
        store.ensure_live(projection, "S")
        store.claim(projection.name, "daemon")
        shadow = store.create_shadow(projection, "S", "rebuild", 10)
        builder = store.writer(shadow, "rebuild")
        builder.transaction().commit(10)
        # The daemon's commit to position 12, in flight: its compare-and-set holds the live generation's row.
        daemon = psycopg.connect(postgres_url, autocommit=True, options=f"-c search_path={schema}")
        daemon.execute("BEGIN")
        daemon.execute(
            "UPDATE _jetsourcing_generations SET checkpoint = 12 WHERE projection = %s AND generation = 1",
            (projection.name,),
        )
        switched: list[bool] = []
        with PostgresStore(postgres_url, schema=schema) as rebuilder:
            switching = threading.Thread(target=lambda: switched.append(rebuilder.switch(shadow)))
            switching.start()
            time.sleep(0.5)
            assert switching.is_alive()  # waiting for the row, not deciding on the checkpoint it read before
            daemon.execute("COMMIT")
            switching.join(10)
        daemon.close()
        assert switched == [False]  # the live model moved past the shadow: catch up first
        assert store.live_generation(projection.name).generation == 1  # type: ignore[union-attr]


def test_readers_query_views_in_the_schema(postgres_url: str) -> None:
    schema = unique_schema()
    with PostgresStore(postgres_url, schema=schema) as store:
        tx = _live_writer(store).transaction()
        tx.upsert("balances", "acc", _balance("acc", 42))
        tx.commit(1)
    with contextlib.closing(psycopg.connect(postgres_url)) as reader:
        [(balance,)] = reader.execute(f"SELECT balance FROM {schema}.balances WHERE account_id = 'acc'").fetchall()
    assert balance == 42


class LongNames(Projection):
    name = "p" * 63
    tables = (Table("t" * 40, key="k" * 63, columns={"k" * 63: str, "c" * 63: int}, indexes=["c" * 63]),)


def test_the_longest_names_stay_distinct_in_postgresql_for_many_generations(store: PostgresStore) -> None:
    projection = LongNames()
    store.ensure_live(projection, "S")
    for generation in range(2, 13):
        shadow = store.create_shadow(projection, "S", "rebuild", 0)
        tx = store.writer(shadow, "rebuild").transaction()
        tx.upsert("t" * 40, "key", {"c" * 63: generation})
        tx.commit(1)
        assert store.switch(shadow)
    assert store.live_generation(projection.name).generation == 12  # type: ignore[union-attr]
    assert store.rows("t" * 40) == [{"k" * 63: "key", "c" * 63: 12}]
    assert {name for name, _ in store.relations()} >= {"t" * 40, "t" * 40 + "__g12"}


def test_a_lock_wait_that_times_out_leaves_no_failed_transaction_behind(postgres_url: str) -> None:
    schema = unique_schema()
    with PostgresStore(postgres_url, schema=schema, timeout_s=1) as store:
        _live_writer(store)
        with psycopg.connect(postgres_url, autocommit=True) as other:  # another process changing generations
            other.execute("SELECT pg_advisory_lock(hashtext(%s))", (f"jetsourcing:{schema}",))
            with pytest.raises(psycopg.errors.QueryCanceled):
                store.claim(AccountBalances.name, "late")
        assert store.claim(AccountBalances.name, "late").owner == "late"  # the connection goes on


def test_a_lost_connection_inside_a_handler_is_the_databases_fault_not_the_events(postgres_url: str) -> None:
    projection = AccountBalances()
    registry = TypeRegistry()
    projection.bind(registry)
    with PostgresStore(postgres_url, schema=unique_schema(), timeout_s=5) as store:
        writer = _live_writer(store)
        applier = Applier(projection, writer, ErrorPolicy.DEAD_LETTER, Counters())
        opened = RecordedEvent(1, 0, StreamId("Account", "a"), 1, "AccountOpened", 1, "id1", b'{"owner":"o"}',
                               "2025-01-01T00:00:00+00:00", registry=registry)
        deposit = RecordedEvent(2, 0, StreamId("Account", "a"), 2, "Deposited", 1, "id2", b'{"amount":5}',
                                "2025-01-01T00:00:00+00:00", registry=registry)
        applier.apply([opened])
        writer.cache.clear()  # type: ignore[attr-defined]  # the handler's get() must ask the database
        _terminate(postgres_url, store)
        with pytest.raises(store.transient_errors):
            applier.apply([deposit])
        assert store.dead_letters(projection.name) == []  # not dead-lettered: the daemon retries the batch
        applier.apply([deposit])
        assert store.get("balances", "a")["balance"] == 5  # type: ignore[index]


def test_a_batch_whose_transaction_failed_is_never_reported_committed(store: PostgresStore) -> None:
    writer = _live_writer(store)
    tx = writer.transaction()
    tx.upsert("balances", "a", _balance("a"))
    with contextlib.suppress(psycopg.errors.DivisionByZero):
        tx.execute("SELECT 1 / 0")  # type: ignore[attr-defined]  # a handler that swallows a failed statement
    tx.upsert("balances", "b", _balance("b"))
    with pytest.raises(psycopg.errors.InFailedSqlTransaction):
        tx.commit(1)  # refused, never a COMMIT that PostgreSQL turns into a silent ROLLBACK
    assert writer.checkpoint == 0 and store.rows("balances") == []
    tx = writer.transaction()
    tx.upsert("balances", "b", _balance("b"))
    tx.commit(1)
    assert [r["account_id"] for r in store.rows("balances")] == ["b"]
