"""Projections in Spark: the daemon's definitions folded per entity, DataFrame projections, Delta writes.

The reference for a fold projection is the daemon itself: it runs in burst mode into
SQLite on the same history, and the Delta tables must hold exactly its rows. deltalake
(delta-rs) reads the tables' history back as an independent Delta implementation.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

import deltalake
import pytest
from pydantic import BaseModel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from eventstore import EventStore, RecordedEvent, StreamId, TypeRegistry
from projections import Daemon, Projection, ProjectionSettings, SqliteStore, Table, Transaction, handles
from spark_projections.projection import (
    GROUP_COLUMN,
    DataFrameProjection,
    FoldConstraintError,
    fold_tables,
    rebuild,
    update,
)
from spark_projections.cli import main
from spark_projections.source import read_events
from spark_projections.typed import typed_events

EXAMPLES = Path(__file__).resolve().parents[1] / "projections"
sys.path.insert(0, str(EXAMPLES))

from projection_examples import (  # noqa: E402
    AccountBalances,
    Deposited,
    Movements,
    Withdrawn,
    append_workload,
    register_all,
    workload,
)


@pytest.fixture(scope="module", autouse=True)
def shipped(spark: SparkSession) -> None:
    """Executors import the example projections and this module (in production: an installed package)."""
    spark.sparkContext.addPyFile(str(EXAMPLES / "projection_examples.py"))
    spark.sparkContext.addPyFile(str(Path(__file__)))


class ItemBought(BaseModel):
    account: str
    price: int


async def history(store: EventStore, appends: list[tuple[str, list[BaseModel]]]) -> int:
    """Append account commits with cart events of another category interleaved; returns the last position."""
    register_all(store)
    store.registry.register(ItemBought)
    await append_workload(store, appends)
    for i, (account, _) in enumerate(appends[::15]):
        await store.append(StreamId("Cart", f"cart-{i % 4}"), [ItemBought(account=account, price=10 + i)])
    return await store.last_position()


async def daemon_read_model(
    store: EventStore, projection: Projection, tmp: Path, error_policy: str | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The daemon's SQLite read model, built in burst mode (its production code path)."""
    settings = ProjectionSettings(
        eventstore=store.settings, database=tmp / f"{uuid.uuid4().hex[:6]}.sqlite3",
        lease_bucket=f"L{uuid.uuid4().hex[:10]}", lease_ttl_s=2.0, heartbeat_s=0.5, error_policy=error_policy,
    )
    outcomes = await Daemon([projection], settings, event_store=store).run(until_caught_up=True)
    assert {o.value for o in outcomes.values()} == {"caught_up"}
    with SqliteStore(settings.database) as sqlite:
        return sqlite.dump(projection.name)


def delta_rows(spark: SparkSession, root: Path, projection: Projection) -> dict[str, list[dict[str, Any]]]:
    """Each table's rows as the daemon dumps them: declared columns, sorted by key."""
    out = {}
    for table in projection.tables:
        rows = [r.asDict() for r in spark.read.format("delta").load(str(root / table.name)).collect()]
        for row in rows:
            assert row.pop(GROUP_COLUMN) is not None
        out[table.name] = sorted(rows, key=lambda r: tuple(r[k] for k in table.key))
    return out


def history_positions(path: Path) -> list[tuple[str, int]]:
    """(mode, position) of each commit, oldest first, read with delta-rs."""
    commits = sorted(deltalake.DeltaTable(str(path)).history(), key=lambda c: c["version"])
    return [(meta["jetsourcing.mode"], meta["jetsourcing.position"])
            for meta in (json.loads(c["userMetadata"]) for c in commits)]


async def test_rebuild_equals_the_daemons_sqlite_read_model(spark: SparkSession, store: EventStore, tmp_path: Path) -> None:
    last = await history(store, workload(700, 40))
    for projection in (AccountBalances(), Movements()):
        expected = await daemon_read_model(store, projection, tmp_path)
        assert any(expected.values())
        run = rebuild(spark, projection, store.settings, tmp_path / projection.name, partitions=3)
        assert (run.mode, run.position, run.app_id) == ("rebuild", last, f"{projection.name}.v1")
        assert all(result.applied for result in run.tables.values())
        assert delta_rows(spark, tmp_path / projection.name, projection) == expected, projection.name
    # closed accounts were deleted from balances (and recorded in closures) the same way
    assert (tmp_path / "account_balances" / "closures").exists()


async def test_incremental_update_equals_rebuild_and_repeats_change_nothing(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    appends = workload(900, 30, seed=11)
    first = await history(store, appends[:400])
    projection = AccountBalances()
    root = tmp_path / "incremental"
    assert rebuild(spark, projection, store.settings, root).position == first
    second = await history(store, appends[400:])

    run = update(spark, projection, store.settings, root, partitions=2)
    assert (run.mode, run.from_position, run.position) == ("merge", first + 1, second)
    assert all(result.applied for result in run.tables.values())
    full = tmp_path / "full"
    rebuild(spark, projection, store.settings, full)
    assert delta_rows(spark, root, projection) == delta_rows(spark, full, projection)

    versions = {t: deltalake.DeltaTable(str(root / t)).version() for t in ("balances", "closures")}
    again = update(spark, projection, store.settings, root)
    assert (again.mode, again.position, again.tables) == ("noop", second, {})
    assert {t: deltalake.DeltaTable(str(root / t)).version() for t in versions} == versions == {
        "balances": 1, "closures": 1}
    for table in ("balances", "closures"):  # one commit per run, each with the position it reflects
        assert history_positions(root / table) == [("rebuild", first), ("merge", second)]
    # A rebuild of the same position is recognised as done and writes nothing.
    assert rebuild(spark, projection, store.settings, full).mode == "noop"
    assert deltalake.DeltaTable(str(full / "balances")).version() == 0


async def test_update_without_a_recorded_position_rebuilds(spark: SparkSession, store: EventStore, tmp_path: Path) -> None:
    last = await history(store, workload(60, 5, seed=3))
    run = update(spark, Movements(), store.settings, tmp_path / "m")
    assert (run.mode, run.position) == ("rebuild", last)


class GlobalCounter(Projection):
    """Counts every deposit in ONE row: not foldable per entity."""

    name = "global_counter"
    tables = (Table("totals", key="name", columns={"name": str, "deposits": int}),)

    @handles("Deposited")
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        row = tx.get("totals", "all") or {"deposits": 0}
        tx.upsert("totals", "all", {"deposits": row["deposits"] + 1})


async def test_handlers_touching_other_groups_rows_are_refused(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    await history(store, workload(60, 5, seed=5))
    with pytest.raises(FoldConstraintError, match="totals") as caught:
        rebuild(spark, GlobalCounter(), store.settings, tmp_path / "g")
    assert caught.value.examples[0][0] == "all"
    assert not (tmp_path / "g" / "totals").exists()
    # Folding by a coarser group (here: the category) makes it valid.
    tables = fold_tables(GlobalCounter(), read_events(spark, store.settings), group_by="category")
    assert [tuple(r)[:2] for r in tables["totals"].collect()] == [
        ("all", sum(1 for _, events in workload(60, 5, seed=5) for e in events if isinstance(e, Deposited)))]


def balances(registry_events: Any) -> Any:
    """A DataFrame projection: balance per account plus what its carts spent (a join across categories)."""

    def build(events: DataFrame) -> DataFrame:
        registry = TypeRegistry()
        for model in registry_events:
            registry.register(model)
        amounts = (
            typed_events(events, registry, Deposited).select("entity_id", "position", F.col("amount"))
            .unionByName(typed_events(events, registry, Withdrawn)
                         .select("entity_id", "position", (-F.col("amount")).alias("amount")))
        )
        per_account = amounts.groupBy(F.col("entity_id").alias("account_id")).agg(
            F.sum("amount").alias("balance"), F.count(F.lit(1)).alias("movements"),
            F.max("position").alias("last_position"),
        )
        spent = (
            typed_events(events, registry, ItemBought)
            .groupBy(F.col("account").alias("account_id")).agg(F.sum("price").alias("spent"))
        )
        return per_account.join(spent, "account_id", "full_outer").select(
            "account_id", F.coalesce("balance", F.lit(0)).alias("balance"),
            F.coalesce("movements", F.lit(0)).alias("movements"), "last_position",
            F.coalesce("spent", F.lit(0)).alias("spent"),
        )

    return build


BALANCES = DataFrameProjection(
    name="spending", build=balances((Deposited, Withdrawn, ItemBought)), keys=("account_id",),
    categories=("Account", "Cart"),
    combine={"balance": "sum", "movements": "sum", "last_position": "max", "spent": "sum"},
)


def table(spark: SparkSession, path: Path) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in spark.read.format("delta").load(str(path)).collect())


async def test_dataframe_projection_rebuild_and_combining_update(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    appends = workload(500, 20, seed=13)
    first = await history(store, appends[:250])
    root = tmp_path / "df"
    run = rebuild(spark, BALANCES, store.settings, root, partitions=2)
    assert (run.mode, run.position, list(run.tables)) == ("rebuild", first, ["spending"])
    second = await history(store, appends[250:])
    assert update(spark, BALANCES, store.settings, root).mode == "merge"
    rebuild(spark, BALANCES, store.settings, tmp_path / "full")
    merged = table(spark, root / "spending")
    assert merged == table(spark, tmp_path / "full" / "spending")
    assert any(row[4] > 0 for row in merged)  # cart spending joined in
    assert update(spark, BALANCES, store.settings, root).mode == "noop"
    assert history_positions(root / "spending") == [("rebuild", first), ("merge", second)]


async def test_cli_rebuild_and_update(
    spark: SparkSession, store: EventStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last = await history(store, workload(80, 6, seed=17))
    args = ["projection_examples:Movements", "--root", str(tmp_path / "cli"), "--nats-url", str(store.settings.nats_url),
            "--stream", store.settings.stream, "--subject-prefix", store.settings.subject_prefix]
    assert main(["rebuild", *args], spark=spark) == 0
    out = capsys.readouterr().out
    handled = Movements().handled_types
    events = sum(type(e).__name__ in handled for _, evs in workload(80, 6, seed=17) for e in evs)
    assert f"movements: rebuild, positions 1 to {last:,}, {events:,} events folded" in out
    stages = [line.split("] ", 1)[1] for line in out.splitlines() if line.startswith("[")]
    assert stages[0].startswith(f"reading positions 1 to {last:,} of stream {store.settings.stream!r}")
    assert stages[1].startswith("folding the events per stream_id") and stages[2].startswith("writing table movements")
    [written] = [line for line in out.splitlines() if line.startswith("  movements: committed")]
    rows = len(table(spark, tmp_path / "cli" / "movements"))
    assert written.endswith(f", {rows:,} rows written"), written
    await history(store, workload(20, 3, seed=18))
    assert main(["update", *args], spark=spark) == 0
    out = capsys.readouterr().out
    assert "merging into table movements" in out and ", rows " in out and " inserted" in out, out
    assert main(["update", *args], spark=spark) == 0
    assert "movements: noop" in capsys.readouterr().out
    assert main(["update", "no_such_module:X", "--root", str(tmp_path)], spark=spark) == 2
    assert "Cannot import 'no_such_module'" in capsys.readouterr().err
