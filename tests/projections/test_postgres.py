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

from projections import PostgresStore, ProjectionError, ProjectionSettings, SqliteStore, open_store
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


@pytest.mark.parametrize("schema", ["", "Public", "a b", "x;drop", "1abc", 7, "y" * 64])
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
