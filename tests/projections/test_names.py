"""Names of tables and schemas: system catalogs, case, length and odd characters are refused before anything is
created, the same way in SQLite and PostgreSQL; on PostgreSQL every statement names the store's schema."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import ValidationError

from projections import (
    Daemon,
    PostgresStore,
    Projection,
    ProjectionDefinitionError,
    ProjectionError,
    ProjectionSettings,
    SqliteStore,
    Table,
)
from projections.sql import SqlStore

from projection_examples import AccountBalances
from projection_helpers import ROOT, cli, cli_env, make_settings
from tests.support.postgres import unique_schema

StoreFactory = Callable[[], SqlStore]


@pytest.fixture(params=["sqlite", "postgres"])
def connect(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    """Connections to one fresh read-model database: a SQLite file, or a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        path = tmp_path / "names.sqlite3"
        return lambda: SqliteStore(path)
    url, schema = request.getfixturevalue("postgres_url"), unique_schema()
    return lambda: PostgresStore(url, schema=schema, timeout_s=10)


@pytest.fixture
def store(connect: StoreFactory) -> Iterator[SqlStore]:
    opened = connect()
    try:
        yield opened
    finally:
        opened.close()


def projection_with(name: str, *tables: Table) -> Projection:
    """An instance of a new projection class ``name`` declaring ``tables``."""
    cls = type(f"P_{name}", (Projection,), {"name": name, "version": 1, "tables": tables})
    return cls()  # type: ignore[no-any-return]


def table(name: str, **options: Any) -> Table:
    return Table(name, key="k", columns={"k": str, "v": int}, **options)


def relations(store: SqlStore) -> set[tuple[str, str]]:
    return set(store.relations())


# -- definition time --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["pg_settings", "pg_class", "PG_Class", "pg", "Pg", "sqlite_master", "sqlite_x", "SQLite", "sqlite",
     "information_schema", "Information_Schema", "_jetsourcing_meta", "_JetSourcing_x", "balances__g1",
     "balances__g1__i0", "a__b", "__x"],
)
def test_a_table_named_like_a_system_catalog_or_a_generation_is_refused_at_definition(name: str) -> None:
    with pytest.raises(ProjectionDefinitionError, match="reserved|'__'") as caught:
        table(name)
    assert repr(name) in str(caught.value) and "ename" in str(caught.value)  # says what to rename


@pytest.mark.parametrize(
    "name",
    ['a"b', "a'b", "a b", "a;drop", "bal-ances", "ä", "naïve", "ﬁle", "表", "a\x00", "a\n", "", "1abc", "x" * 41,
     "\u0430bc"],  # the last is a Cyrillic 'a'
)
def test_a_table_name_with_odd_characters_or_over_40_characters_is_refused(name: str) -> None:
    with pytest.raises(ProjectionDefinitionError, match="Invalid table name|at most 40"):
        table(name)


def test_a_projection_may_not_declare_tables_that_differ_only_in_case() -> None:
    with pytest.raises(ProjectionDefinitionError, match="differ only in case") as caught:
        projection_with("cased", table("Orders"), table("orders"))
    assert "'Orders'" in str(caught.value) and "'orders'" in str(caught.value)


def test_one_daemon_refuses_two_projections_whose_tables_differ_only_in_case(tmp_path: Path) -> None:
    first, second = projection_with("first", table("MiXeD")), projection_with("second", table("mixed"))
    settings = ProjectionSettings(database=tmp_path / "never.sqlite3")
    with pytest.raises(ProjectionDefinitionError, match="differ only in case"):
        Daemon([first, second], settings)
    assert not (tmp_path / "never.sqlite3").exists()


@pytest.mark.parametrize("schema", ["pg_x", "pg_catalog", "pg_toast", "pg_temp_1", "information_schema"])
def test_a_reserved_schema_is_refused_clearly_in_settings_and_store(schema: str) -> None:
    with pytest.raises(ValidationError, match="reserved"):
        ProjectionSettings(postgres_schema=schema)
    with pytest.raises(ProjectionError, match="reserved") as caught:
        PostgresStore("postgresql://127.0.0.1:1/none", schema=schema)  # refused before connecting
    assert "JETSOURCING_POSTGRES_SCHEMA" in str(caught.value)


# -- in the database --------------------------------------------------------------------------------------------


def test_tables_of_two_projections_that_differ_only_in_case_are_refused_before_anything_is_created(
    store: SqlStore,
) -> None:
    store.ensure_live(projection_with("first", table("MiXeD")), "S")
    before = relations(store)
    with pytest.raises(ProjectionDefinitionError, match="differ only in case") as caught:
        store.ensure_live(projection_with("second", table("mixed"), table("other")), "S")
    text = str(caught.value)
    assert "'mixed'" in text and "'MiXeD'" in text and "'first'" in text and "ename" in text
    assert relations(store) == before  # nothing of 'second' was created, and 'first' lost nothing
    assert store.live_generation("second") is None
    # The refusal holds for a rebuild too, and the first projection's model is intact.
    with pytest.raises(ProjectionDefinitionError, match="differ only in case"):
        store.create_shadow(projection_with("second", table("mixed")), "S", "me", 0)
    assert relations(store) == before
    assert store.rows("MiXeD") == []


def test_a_projection_may_change_the_case_of_its_own_table(store: SqlStore) -> None:
    store.ensure_live(projection_with("own", table("Orders")), "S")
    renamed = projection_with("own", table("orders"))
    shadow = store.create_shadow(renamed, "S", "me", 0)
    assert store.switch(shadow)
    assert store.rows("orders") == []


def test_a_foreign_relation_that_differs_only_in_case_is_refused(store: SqlStore) -> None:
    store.execute('CREATE TABLE "Users" (id INTEGER)')
    before = relations(store)
    with pytest.raises(ProjectionDefinitionError, match="already exists") as caught:
        store.ensure_live(projection_with("users", table("users")), "S")
    assert "'Users'" in str(caught.value)
    assert relations(store) == before


def test_a_foreign_index_or_type_with_the_tables_name_is_refused(connect: StoreFactory) -> None:
    store = connect()
    try:
        store.execute('CREATE TABLE "foreign_rows" (id INTEGER)')
        store.execute('CREATE INDEX "accounts" ON "foreign_rows" (id)')
        before = relations(store)
        with pytest.raises(ProjectionDefinitionError, match="already exists") as caught:
            store.ensure_live(projection_with("accounts", table("accounts")), "S")
        assert "index" in str(caught.value).lower()
        assert relations(store) == before
        if isinstance(store, PostgresStore):
            store.execute("CREATE TYPE mood AS ENUM ('ok')")
            with pytest.raises(ProjectionDefinitionError, match="already exists"):
                store.ensure_live(projection_with("moods", table("mood")), "S")
    finally:
        store.close()


def test_the_longest_names_stay_distinct_and_a_generation_too_long_to_name_is_refused(store: SqlStore) -> None:
    longest = "t" * 40
    projection = projection_with("long", Table(longest, key="k" * 63, columns={"k" * 63: str, "v": int},
                                              indexes=["v"]))
    store.ensure_live(projection, "S")
    writer = store.writer(store.claim("long", "me"), "me")
    tx = writer.transaction()
    tx.upsert(longest, "a", {"v": 1})
    tx.commit(1)
    assert store.rows(longest) == [{"k" * 63: "a", "v": 1}]
    # Far generation numbers: the physical table still fits PostgreSQL's 63 bytes, its index would not.
    store.execute("UPDATE _jetsourcing_projections SET last_generation = ? WHERE name = 'long'", (10**15,))
    shadow = store.create_shadow(projection, "S", "me", 1)
    assert shadow.generation == 10**15 + 1
    assert (f"{longest}__g{10**15 + 1}", "table") in relations(store)
    store.discard("long", shadow.generation)
    store.execute("UPDATE _jetsourcing_projections SET last_generation = ? WHERE name = 'long'", (10**18,))
    before = relations(store)
    with pytest.raises(ProjectionDefinitionError, match="63 bytes") as caught:
        store.create_shadow(projection, "S", "me", 1)
    assert "__i0" in str(caught.value)
    assert relations(store) == before
    assert store.rows(longest) == [{"k" * 63: "a", "v": 1}]


# -- PostgreSQL: every statement names the schema ------------------------------------------------------------------


def test_every_statement_names_the_schema_whatever_the_search_path(postgres_url: str) -> None:
    schema = unique_schema()
    projection = AccountBalances()
    with PostgresStore(postgres_url, schema=schema, timeout_s=10) as store:
        # A session whose search_path finds nothing of ours: unqualified names would fail or hit other tables.
        store.conn.execute("SET search_path TO pg_catalog")
        store.ensure_live(projection, "S")
        writer = store.writer(store.claim(projection.name, "me"), "me")
        tx = writer.transaction()
        tx.upsert("balances", "a", {"owner": "o", "balance": 1, "deposits": 1, "withdrawals": 0, "last_position": 1,
                                    "overdrawn": False})
        assert tx.table_name("balances") == f'"{schema}"."balances__g1"'
        tx.commit(1)
        assert writer.touch({"n": 1})
        shadow = store.create_shadow(projection, "S", "rebuild", 1)
        store.writer(shadow, "rebuild").transaction().commit(1)  # the rebuild caught up (with no rows)
        assert store.switch(shadow)
        assert [s.projection for s in store.statuses()] == [projection.name]
        assert store.get("balances", "a") is None  # the new generation is empty: the switch really happened
        assert store.dead_letters(projection.name) == []
        assert {name for name, kind in store.relations() if kind == "view"} == {"balances", "closures"}
        found = store.conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname LIKE '\\_jetsourcing\\_%%'", (schema,)
        ).fetchone()
        assert found is not None and found[0] >= 4


@pytest.mark.parametrize("catalog", ["pg_settings", "pg_class"])
def test_a_projection_table_never_touches_pg_catalog(postgres_url: str, nats_url: str, catalog: str) -> None:
    """``jetsourcing run`` of a projection with a table named like a catalog: one line, exit 1, nothing dropped
    (it used to drop pg_catalog.pg_settings, and print a 22-line traceback for pg_class)."""
    settings = make_settings(nats_url, postgres_url, postgres_schema=unique_schema())
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "catalog_names.py").write_text(
            "from projections import Projection, Table\n"
            "class Catalog(Projection):\n"
            "    name = 'catalog'\n"
            f"    tables = (Table({catalog!r}, key='name', columns={{'name': str}}),)\n"
        )
        env = cli_env(settings)
        env["PYTHONPATH"] = os.pathsep.join([folder, env["PYTHONPATH"]])
        proc = subprocess.run(cli("run", "catalog_names:Catalog", "--until-caught-up"), env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{catalog!r}" in lines[0] and "reserved" in lines[0], proc.stderr
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        found = conn.execute("SELECT count(*) FROM pg_catalog.pg_settings").fetchone()
        assert found is not None and found[0] > 100
        schemas = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (settings.postgres_schema,))
        assert schemas.fetchone() == (0,)  # refused before anything was created


def test_sqlite_keeps_case_variants_apart_from_the_reserved_prefix(tmp_path: Path) -> None:
    """SQLite reserves every ``sqlite_*`` name, whatever its case: the store never gets to ask."""
    conn = sqlite3.connect(tmp_path / "x.sqlite3")
    with pytest.raises(sqlite3.OperationalError, match="reserved"):
        conn.execute('CREATE TABLE "SQLite_x__g1" (a)')
    conn.close()
    with pytest.raises(ProjectionDefinitionError, match="reserved"):
        table("SQLite_x")
