"""Least privilege: a role that owns its schema (and may not create schemas) runs, rebuilds and reads; a role
that may only read reads; and reading never creates anything, in PostgreSQL or SQLite."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from eventstore import EventStore
from projections import (
    ProjectionError,
    ProjectionSettings,
    ReadModelNotFoundError,
    open_store,
    read_status,
    read_statuses,
    rebuild,
)

from projection_examples import AccountBalances, AccountBalancesV2, append_workload, register_all, workload
from projection_helpers import ROOT, burst, cli, cli_env, dump, make_settings, memory_fold
from tests.support.postgres import unique_schema


def as_role(url: str, role: str) -> str:
    """``url`` logging in as ``role`` (the test server trusts local connections)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}"))


@contextlib.contextmanager
def superuser(url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(url, autocommit=True) as conn:
        yield conn


def schema_exists(url: str, schema: str) -> bool:
    with superuser(url) as conn:
        return conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is not None


def tables_of_schema(url: str, schema: str) -> set[str]:
    with superuser(url) as conn:
        rows = conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s",
            (schema,),
        ).fetchall()
        return {str(name) for name, in rows}


@pytest.fixture
def owner(postgres_url: str) -> Iterator[tuple[str, str]]:
    """(role, schema): a LOGIN role without CREATE on the database, owning a schema created for it."""
    role, schema = f"owner_{uuid.uuid4().hex[:10]}", unique_schema()
    with superuser(postgres_url) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
        conn.execute(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{role}"')
        allowed = conn.execute("SELECT has_database_privilege(%s, current_database(), 'CREATE')", (role,)).fetchone()
        assert allowed == (False,)  # the point of the test: it may not create schemas
    try:
        yield role, schema
    finally:
        with superuser(postgres_url) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


@pytest.fixture
async def owner_settings(owner: tuple[str, str], postgres_url: str, nats_url: str) -> ProjectionSettings:
    role, schema = owner
    return make_settings(nats_url, as_role(postgres_url, role), postgres_schema=schema)


@pytest.fixture
async def es(owner_settings: ProjectionSettings) -> AsyncIterator[EventStore]:
    store = await EventStore.connect(owner_settings.eventstore)
    register_all(store)
    try:
        yield store
    finally:
        await store.close()


def run_cli(settings: ProjectionSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), env=cli_env(settings), cwd=ROOT, capture_output=True, text=True, timeout=60)


async def test_a_role_owning_its_schema_runs_rebuilds_and_reads_without_create_on_the_database(
    owner_settings: ProjectionSettings, es: EventStore
) -> None:
    await append_workload(es, workload(300, accounts=20))
    await burst([AccountBalances()], owner_settings, es)
    assert dump(owner_settings, "account_balances") == await memory_fold(AccountBalances(), es)
    result = await rebuild(AccountBalancesV2(), owner_settings, event_store=es)
    assert result.generation == 2 and result.checkpoint == await es.last_position()
    [status] = await read_status(owner_settings, event_store=es)
    assert (status.projection, status.version, status.lag_commits) == ("account_balances", 2, 0)
    proc = await asyncio.to_thread(run_cli, owner_settings, "status")
    assert proc.returncode == 0, proc.stderr
    assert "account_balances" in proc.stdout


async def test_a_role_that_may_only_read_reads_status_and_rows(
    owner_settings: ProjectionSettings, es: EventStore, postgres_url: str
) -> None:
    await append_workload(es, workload(100, accounts=10))
    await burst([AccountBalances()], owner_settings, es)
    reader = f"reader_{uuid.uuid4().hex[:10]}"
    schema = owner_settings.postgres_schema
    with superuser(postgres_url) as conn:
        conn.execute(f'CREATE ROLE "{reader}" LOGIN')
        conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{reader}"')
        conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{reader}"')
    try:
        settings = owner_settings.model_copy(update={"database": as_role(postgres_url, reader)})
        [status] = await read_status(settings, event_store=es)
        assert status.checkpoint == await es.last_position()
        with contextlib.closing(open_store(settings, create=False)) as store:
            rows = store.rows("balances")
            assert len(rows) == 10 and store.get("balances", rows[0]["account_id"]) == rows[0]
    finally:
        with superuser(postgres_url) as conn:
            conn.execute(f'DROP OWNED BY "{reader}"')
            conn.execute(f'DROP ROLE "{reader}"')


def test_a_missing_schema_that_the_role_may_not_create_is_reported_clearly(
    owner: tuple[str, str], postgres_url: str
) -> None:
    role, _ = owner
    missing = unique_schema()
    settings = ProjectionSettings(database=as_role(postgres_url, role), postgres_schema=missing)
    with pytest.raises(ProjectionError, match="Cannot create the schema") as caught:
        open_store(settings)
    assert f"CREATE SCHEMA {missing} AUTHORIZATION {role}" in str(caught.value)
    assert not schema_exists(postgres_url, missing)


def test_status_on_an_empty_schema_creates_no_table(
    owner: tuple[str, str], owner_settings: ProjectionSettings, postgres_url: str
) -> None:
    proc = run_cli(owner_settings, "status")
    assert proc.returncode == 1
    assert proc.stderr.startswith("jetsourcing: No read models in PostgreSQL database") and "nothing was created" in (
        proc.stderr), proc.stderr
    assert tables_of_schema(postgres_url, owner[1]) == set()


async def test_status_and_dead_letters_on_a_mistyped_schema_create_nothing(postgres_url: str, nats_url: str) -> None:
    # As the superuser, who could create it: reading must not.
    settings = make_settings(nats_url, postgres_url, postgres_schema=unique_schema())
    with pytest.raises(ReadModelNotFoundError, match="There is no schema"):
        await read_statuses(settings)
    for args in (("status",), ("dead-letters", "drop", "--projection", "x", "--all")):
        proc = await asyncio.to_thread(run_cli, settings, *args)
        assert proc.returncode == 1, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and f"There is no schema {settings.postgres_schema!r}" in lines[0], proc.stderr
        assert "nothing was created" in lines[0] and "JETSOURCING_POSTGRES_SCHEMA" in lines[0]
    proc = await asyncio.to_thread(run_cli, settings, "dead-letters", "list")
    assert proc.returncode == 0 and "There is no schema" in proc.stdout, proc.stdout + proc.stderr
    assert not schema_exists(postgres_url, settings.postgres_schema)


async def test_reading_a_missing_or_empty_sqlite_file_creates_nothing(tmp_path: Path, nats_url: str) -> None:
    missing = make_settings(nats_url, tmp_path / "sub" / "typo.sqlite3")
    with pytest.raises(ReadModelNotFoundError, match="No read-model database at"):
        await read_status(missing)
    with pytest.raises(ReadModelNotFoundError):
        open_store(missing, create=False)
    proc = await asyncio.to_thread(run_cli, missing, "status")
    assert proc.returncode == 1 and "No read-model database at" in proc.stderr, proc.stderr
    assert not (tmp_path / "sub").exists()

    empty = tmp_path / "empty.sqlite3"
    sqlite3.connect(empty).close()  # a file with no table: not one of ours yet
    settings = make_settings(nats_url, empty)
    with pytest.raises(ReadModelNotFoundError, match="No read models in"):
        await read_status(settings)
    proc = await asyncio.to_thread(run_cli, settings, "status")
    assert proc.returncode == 1 and "No read models in" in proc.stderr, proc.stderr
    with contextlib.closing(sqlite3.connect(empty)) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
