"""An update costs what its events change: only the affected groups' rows are read, folded and rewritten.

Asserted through what Delta records of each commit (its operation metrics) and through
the Spark jobs a call starts, never through timings. The results equal a rebuild.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from eventstore import EventStore, RecordedEvent, StreamId
from projections import Projection, Table, Transaction, handles
from spark_projections.delta import full_rebuild, recorded_position, table_history
from spark_projections.errors import SparkProjectionError
from spark_projections.projection import FoldConstraintError, app_id_of, merge_events, rebuild, update
from spark_projections.source import read_events

from test_projection import EXAMPLES, delta_rows, history
from test_spark_delta import spark_jobs
from projection_examples import (  # noqa: E402
    AccountBalances,
    AccountClosed,
    AccountOpened,
    Corrupted,
    Deposited,
    Withdrawn,
    register_all,
    workload,
)


@pytest.fixture(scope="module", autouse=True)
def shipped(spark: SparkSession) -> None:
    """Executors import the example projections and this module, with the ones it imports (in production: an
    installed package)."""
    spark.sparkContext.addPyFile(str(EXAMPLES / "projection_examples.py"))
    for module in ("test_projection.py", "test_spark_delta.py", Path(__file__).name):
        spark.sparkContext.addPyFile(str(Path(__file__).with_name(module)))


def newest_metrics(spark: SparkSession, path: Path) -> dict[str, int]:
    """Delta's operation metrics of the table's newest commit, as numbers."""
    return {k: int(v) for k, v in table_history(spark, path, limit=1)[0].metrics.items()}


async def test_an_update_folds_and_rewrites_only_the_rows_its_events_touch(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    register_all(store)
    for i in range(40):
        await store.append(StreamId("Account", f"acc-{i:02d}"), [AccountOpened(owner=f"o{i}"), Deposited(amount=10)])
    await store.append(StreamId("Account", "acc-00"), [AccountClosed(reason="moved")])
    projection = AccountBalances()
    root = tmp_path / "accounts"
    first = rebuild(spark, projection, store.settings, root).position

    await store.append(StreamId("Account", "acc-01"), [Deposited(amount=5)])
    await store.append(StreamId("Account", "acc-02"), [Deposited(amount=7), Withdrawn(amount=3)])
    await store.append(StreamId("Account", "acc-03"), [Withdrawn(amount=1)])
    await store.append(StreamId("Account", "acc-04"), [AccountClosed(reason="moved")])
    await store.append(StreamId("Account", "acc-00"), [Deposited(amount=1)])  # closed: changes nothing
    run = update(spark, projection, store.settings, root)
    assert (run.mode, run.from_position) == ("merge", first + 1)
    assert run.events == 6  # the new events only

    balances = newest_metrics(spark, root / "balances")
    # The rows of the five affected accounts (acc-00 has none, acc-04's is a tombstone), not the table's 40.
    assert balances["numSourceRows"] == 4
    assert (balances["numTargetRowsUpdated"], balances["numTargetRowsDeleted"], balances["numTargetRowsInserted"]) == (
        3, 1, 0)
    closures = newest_metrics(spark, root / "closures")
    # acc-00's closure went through the fold again, unchanged: matched, not rewritten.
    assert closures["numSourceRows"] == 2
    assert (closures["numTargetRowsUpdated"], closures["numTargetRowsInserted"]) == (0, 1)

    rebuild(spark, projection, store.settings, tmp_path / "full")
    assert delta_rows(spark, root, projection) == delta_rows(spark, tmp_path / "full", projection)

    # Nothing new: the positions come from Delta's checksum files, without a Spark job.
    with spark_jobs(spark) as jobs:
        assert update(spark, projection, store.settings, root).mode == "noop"
    assert jobs == []

    # New events, none of them handled: nothing is written, and the tables stay at their position.
    second = run.position
    await store.append(StreamId("Account", "acc-05"), [Corrupted(detail="not handled here")])
    run = update(spark, projection, store.settings, root)
    assert (run.mode, run.position, run.tables) == ("noop", second, {})
    assert [len(table_history(spark, root / name)) for name in ("balances", "closures")] == [2, 2]


class Owners(Projection):
    """Accounts by owner: rows keyed by the owner, so two accounts of one owner write the same row."""

    name = "owners"
    categories = ("Account",)
    tables = (Table("owners", key="owner", columns={"owner": str, "account": str}),)

    @handles(AccountOpened)
    def opened(self, event: RecordedEvent, tx: Transaction) -> None:
        data = event.data
        assert isinstance(data, AccountOpened)
        tx.upsert("owners", data.owner, {"account": event.stream_id.entity_id})


async def test_an_update_refuses_two_new_groups_writing_one_row(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    register_all(store)
    await store.append(StreamId("Account", "a1"), [AccountOpened(owner="ann")])
    root = tmp_path / "owners"
    first = rebuild(spark, Owners(), store.settings, root).position
    await store.append(StreamId("Account", "a2"), [AccountOpened(owner="cy")])
    await store.append(StreamId("Account", "a3"), [AccountOpened(owner="cy")])
    with pytest.raises(FoldConstraintError) as caught:
        update(spark, Owners(), store.settings, root)
    assert caught.value.examples == (("cy", ["Account/a2", "Account/a3"]),)
    assert recorded_position(spark, root / "owners", app_id_of(Owners())) == first
    with pytest.raises(FoldConstraintError):
        rebuild(spark, Owners(), store.settings, tmp_path / "full")


async def test_an_update_refuses_a_new_group_writing_a_stored_groups_row(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    register_all(store)
    await store.append(StreamId("Account", "a1"), [AccountOpened(owner="ann")])
    await store.append(StreamId("Account", "a2"), [AccountOpened(owner="bob")])
    root = tmp_path / "owners"
    first = rebuild(spark, Owners(), store.settings, root).position
    await store.append(StreamId("Account", "a3"), [AccountOpened(owner="ann")])
    # The fold of a3 cannot see a1's row; the MERGE finds it and commits nothing.
    with pytest.raises(FoldConstraintError) as caught:
        update(spark, Owners(), store.settings, root)
    assert caught.value.examples == (("ann", ["Account/a1", "Account/a3"]),)
    assert recorded_position(spark, root / "owners", app_id_of(Owners())) == first
    assert len(table_history(spark, root / "owners")) == 1
    with pytest.raises(FoldConstraintError):
        rebuild(spark, Owners(), store.settings, tmp_path / "full")


async def test_merge_events_applies_the_events_a_caller_has(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    appends = workload(300, 12, seed=31)
    first = await history(store, appends[:150])
    projection = AccountBalances()
    root = tmp_path / "accounts"
    # No table yet: they are built from the events given, which start at the first one.
    built = merge_events(spark, projection, read_events(spark, store.settings, to_position=first), root, position=first)
    assert (built.mode, built.position) == ("rebuild", first)

    second = await history(store, appends[150:])
    events = read_events(spark, store.settings, from_position=first + 1, to_position=second)
    run = merge_events(spark, projection, events, root, position=second)
    assert (run.mode, run.from_position, run.position) == ("merge", first + 1, second)
    rebuild(spark, projection, store.settings, tmp_path / "full")
    assert delta_rows(spark, root, projection) == delta_rows(spark, tmp_path / "full", projection)

    # The same events again (a micro-batch Spark runs twice): nothing computed, nothing written.
    with spark_jobs(spark) as jobs:
        assert merge_events(spark, projection, events, root, position=second).mode == "noop"
    assert jobs == []

    # Tables left at different positions by an interrupted run cannot take new events.
    closures = root / "closures"
    full_rebuild(spark.read.format("delta").load(str(closures)), closures, app_id=app_id_of(projection),
                 position=second + 10)
    with pytest.raises(SparkProjectionError, match="different positions"):
        merge_events(spark, projection, events, root, position=second + 20)
