"""The Spark page's account (docs/concepts/spark.md) of the column fold tables carry beyond the declared ones (GROUP_COLUMN)."""

from __future__ import annotations

import sys
from pathlib import Path

import deltalake
import pytest
from pyspark.sql import SparkSession

from eventstore import EventStore
from spark_projections import GROUP_COLUMN, rebuild

EXAMPLES = Path(__file__).resolve().parents[1] / "projections"
sys.path.insert(0, str(EXAMPLES))

from projection_examples import Movements, append_workload, register_all, workload  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def shipped(spark: SparkSession) -> None:
    """Executors import the example projections (in production: an installed package)."""
    spark.sparkContext.addPyFile(str(EXAMPLES / "projection_examples.py"))


async def test_fold_tables_end_with_the_group_column_that_readers_can_drop(
    spark: SparkSession, store: EventStore, tmp_path: Path
) -> None:
    register_all(store)
    await append_workload(store, workload(60, 5, seed=23))
    rebuild(spark, Movements(), store.settings, tmp_path)
    (table,) = Movements.tables
    declared = [column.name for column in table.columns]

    # As any Delta reader sees it (delta-rs here): the declared columns, then the group, the stream id by default.
    stored = deltalake.DeltaTable(str(tmp_path / table.name)).to_pyarrow_table()
    assert stored.column_names == [*declared, GROUP_COLUMN] and GROUP_COLUMN == "_jetsourcing_group"
    rows = stored.to_pylist()
    assert rows and all(row[GROUP_COLUMN] == f"Account/{row['account_id']}" for row in rows)

    frame = spark.read.format("delta").load(str(tmp_path / table.name)).drop(GROUP_COLUMN)
    assert frame.columns == declared
