"""Materialisation into Delta: one commit per position, idempotent retries, merge == rebuild.

Everything runs on real Spark + Delta; delta-rs (``deltalake``) reads the tables back as
an independent implementation of the Delta protocol.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import deltalake
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from py4j.protocol import Py4JError

from spark_projections import delta as sp_delta
from spark_projections.delta import (
    TXN_APP_ID_CONF,
    TXN_VERSION_CONF,
    USER_METADATA_CONF,
    full_rebuild,
    incremental_merge,
    latest_per_key,
    position_from_history,
    recorded_position,
    table_history,
)
from spark_projections.errors import DuplicateKeysError, SchemaMismatchError

STATE_SCHEMA = "account STRING, balance BIGINT, seq BIGINT, closed BOOLEAN"

# (seq, account, balance, closed): the event stream, already projected to "state after
# this event" rows. seq is the stream position. Account c is closed at 7, e opened at 8.
EVENTS = [
    (1, "a", 10, False),
    (2, "b", 20, False),
    (3, "c", 30, False),
    (4, "a", 15, False),
    (5, "d", 40, False),
    (6, "b", 25, False),
    (7, "c", 30, True),
    (8, "e", 50, False),
    (9, "a", 12, False),
]


def events(spark: SparkSession, after: int = 0, upto: int = 10**9) -> DataFrame:
    rows = [(a, b, s, c) for (s, a, b, c) in EVENTS if after < s <= upto]
    return spark.createDataFrame(rows, STATE_SCHEMA)


def state(spark: SparkSession, after: int = 0, upto: int = 10**9) -> DataFrame:
    """One row per account: its latest state in (after, upto]."""
    return latest_per_key(events(spark, after, upto), ["account"], "seq")


@contextmanager
def spark_jobs(spark: SparkSession) -> Iterator[list[int]]:
    """The ids of the Spark jobs started inside the block, by this thread or by Delta's threads for it (when it ends)."""
    group = uuid.uuid4().hex
    context = spark.sparkContext
    context.setJobGroup(group, "counted by a test")
    started: list[int] = []
    try:
        yield started
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type] # null clears it
        started.extend(context.statusTracker().getJobIdsForGroup(group))


def rows(spark: SparkSession, path: Path) -> list[tuple[Any, ...]]:
    frame = spark.read.format("delta").load(str(path))
    return sorted(tuple(r) for r in frame.select(sorted(frame.columns)).collect())


def delta_rs_rows(path: Path) -> list[tuple[Any, ...]]:
    table = deltalake.DeltaTable(str(path)).to_pyarrow_table()
    columns = sorted(table.column_names)
    return sorted(zip(*(table.column(c).to_pylist() for c in columns)))


ALL_NINE = [("a", 12, False, 9), ("b", 25, False, 6), ("c", 30, True, 7), ("d", 40, False, 5), ("e", 50, False, 8)]


def test_rebuild_is_one_commit_and_a_retry_is_a_no_op(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "balances"
    result = full_rebuild(state(spark, upto=5), path, app_id="balances-v1", position=5)
    assert (result.applied, result.table_version, result.recorded_position) == (True, 0, 5)
    assert [(h.version, h.position, h.operation, h.mode) for h in table_history(spark, path)] == [
        (0, 5, "WRITE", "rebuild")
    ]
    first = [("a", 15, False, 4), ("b", 20, False, 2), ("c", 30, False, 3), ("d", 40, False, 5)]
    assert rows(spark, path) == first

    # Same (app_id, position) - even with other data - and older positions change nothing.
    retry = full_rebuild(state(spark, upto=9), path, app_id="balances-v1", position=5)
    assert (retry.applied, retry.table_version, retry.recorded_position) == (False, 0, 5)
    older = full_rebuild(state(spark, upto=3), path, app_id="balances-v1", position=3)
    assert (older.applied, older.table_version) == (False, 0)
    assert deltalake.DeltaTable(str(path)).version() == 0
    assert delta_rs_rows(path) == first

    # A later position replaces the table in exactly one more commit.
    again = full_rebuild(state(spark, upto=9), path, app_id="balances-v1", position=9)
    assert (again.applied, again.table_version, again.recorded_position) == (True, 1, 9)
    assert [(h.version, h.position, h.mode) for h in table_history(spark, path)] == [
        (1, 9, "rebuild"),
        (0, 5, "rebuild"),
    ]

    # delta-rs, an independent reader, sees the same version, rows, metadata and txn.
    table = deltalake.DeltaTable(str(path))
    assert table.version() == 1
    assert table.transaction_version("balances-v1") == 9
    meta = json.loads(table.history(1)[0]["userMetadata"])
    assert meta.pop("jetsourcing.write_id")
    assert meta == {"jetsourcing.app_id": "balances-v1", "jetsourcing.mode": "rebuild", "jetsourcing.position": 9}
    assert delta_rs_rows(path) == rows(spark, path) == ALL_NINE


def test_delta_itself_skips_a_repeated_position(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulate a racing twin: our pre-check saw nothing recorded, Delta's txn guard must hold.

    Both the DataFrameWriter options (rebuild) and the session confs (MERGE) are checked.
    """
    path = tmp_path / "balances"
    full_rebuild(state(spark, upto=5), path, app_id="app", position=5)
    incremental_merge(state(spark, after=5, upto=7), path, keys=["account"], app_id="app", position=7)
    before = delta_rs_rows(path)

    monkeypatch.setattr(sp_delta, "recorded_position", lambda *_args: None)
    rebuild = full_rebuild(state(spark, upto=9), path, app_id="app", position=7)
    merge = incremental_merge(state(spark, after=7, upto=9), path, keys=["account"], app_id="app", position=6)
    monkeypatch.undo()

    assert rebuild.applied is False and merge.applied is False
    assert [h.version for h in table_history(spark, path)] == [1, 0]
    assert delta_rs_rows(path) == before
    assert recorded_position(spark, path, "app") == 7


def test_incremental_merge_equals_full_rebuild_and_repeats_are_no_ops(
    spark: SparkSession, tmp_path: Path
) -> None:
    latest = {r.account: (r.balance, r.seq) for r in state(spark).collect()}
    assert latest == {"a": (12, 9), "b": (25, 6), "c": (30, 7), "d": (40, 5), "e": (50, 8)}

    rebuilt = tmp_path / "rebuilt"
    merged = tmp_path / "merged"
    full_rebuild(state(spark, upto=9), rebuilt, app_id="r", position=9, deleted_col="closed")

    full_rebuild(state(spark, upto=4), merged, app_id="m", position=4, deleted_col="closed")
    # Updates for (4, 9]: a and b change, c is closed (deleted), d and e are new.
    updates = state(spark, after=4, upto=9)
    spark.conf.set("spark.sql.shuffle.partitions", "3")  # a runtime setting the merge inherits
    try:
        first = incremental_merge(updates, merged, keys=["account"], app_id="m", position=9, deleted_col="closed")
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", "2")
    assert (first.applied, first.table_version, first.recorded_position) == (True, 1, 9)

    expected = [("a", 12, 9), ("b", 25, 6), ("d", 40, 5), ("e", 50, 8)]
    assert rows(spark, rebuilt) == expected
    assert rows(spark, merged) == expected
    assert delta_rs_rows(merged) == expected
    assert [(h.version, h.operation, h.position, h.mode) for h in table_history(spark, merged)] == [
        (1, "MERGE", 9, "merge"),
        (0, "WRITE", 4, "rebuild"),
    ]

    # The same merge again changes nothing.
    second = incremental_merge(updates, merged, keys=["account"], app_id="m", position=9, deleted_col="closed")
    assert (second.applied, second.table_version, second.recorded_position) == (False, 1, 9)
    assert deltalake.DeltaTable(str(merged)).version() == 1
    assert delta_rs_rows(merged) == expected

    # The MERGE's identity was set on a private session: the caller's session is clean, so
    # a plain write afterwards is neither skipped nor stamped with it.
    for key in (TXN_APP_ID_CONF, TXN_VERSION_CONF, USER_METADATA_CONF):
        assert spark.conf.get(key, None) is None
    extra = spark.createDataFrame([("z", 1, 99)], "account STRING, balance BIGINT, seq BIGINT")
    extra.write.format("delta").mode("append").save(str(merged))
    newest = table_history(spark, merged)[0]
    assert (newest.version, newest.operation, newest.position) == (2, "WRITE", None)
    assert recorded_position(spark, merged, "m") == 9
    assert ("z", 1, 99) in delta_rs_rows(merged)


def test_recorded_position(spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "balances"
    assert recorded_position(spark, path, "app") is None  # no table yet
    assert table_history(spark, path) == []
    # A merge into a missing table creates it.
    created = incremental_merge(state(spark, upto=3), path, keys=["account"], app_id="app", position=3)
    assert (created.applied, created.table_version, created.recorded_position) == (True, 0, 3)
    incremental_merge(state(spark, after=3, upto=8), path, keys=["account"], app_id="app", position=8)
    full_rebuild(state(spark, upto=9), path, app_id="other", position=9)

    assert recorded_position(spark, path, "app") == 8
    assert recorded_position(spark, path, "other") == 9
    assert recorded_position(spark, path, "never") is None
    assert position_from_history(spark, path, "app") == 8
    assert position_from_history(spark, path, "other") == 9
    assert [(h.version, h.operation, h.app_id, h.position, h.mode) for h in table_history(spark, path)] == [
        (2, "WRITE", "other", 9, "rebuild"),
        (1, "MERGE", "app", 8, "merge"),
        (0, "WRITE", "app", 3, "merge"),
    ]
    table = deltalake.DeltaTable(str(path))
    assert (table.transaction_version("app"), table.transaction_version("other")) == (8, 9)
    assert delta_rs_rows(path) == ALL_NINE

    # If Delta's internal log API ever disappears, the history fallback gives the same answer.
    def broken(*_args: Any) -> Any:
        raise Py4JError("simulated: DeltaLog API unavailable")

    monkeypatch.setattr(sp_delta, "_snapshot", broken)
    assert recorded_position(spark, path, "app") == 8
    assert recorded_position(spark, path, "never") is None


def test_recorded_position_comes_from_the_checksum_without_a_spark_job(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "balances"
    full_rebuild(state(spark, upto=4), path, app_id="app", position=4)
    incremental_merge(state(spark, after=4, upto=9), path, keys=["account"], app_id="app", position=9)
    spark.sparkContext._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()  # type: ignore[union-attr]
    with spark_jobs(spark) as jobs:
        assert recorded_position(spark, path, "app") == 9
        assert recorded_position(spark, path, "other") is None
    assert jobs == []
    # Without the checksum files (a writer that leaves none, say), the table's state answers.
    for checksum in path.glob("_delta_log/0*.crc"):
        checksum.unlink()
    spark.sparkContext._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()  # type: ignore[union-attr]
    assert recorded_position(spark, path, "app") == 9


def test_merge_combines_with_the_stored_values_and_rewrites_only_changed_rows(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = tmp_path / "totals"
    schema = "k STRING, v BIGINT, note STRING"
    full_rebuild(spark.createDataFrame([("a", 1, "x"), ("b", 2, "y"), ("c", 3, "z")], schema), path, app_id="app",
                 position=1)
    add = {"v": lambda stored, new: F.coalesce(stored, F.lit(100)) + new}
    updates = spark.createDataFrame([("a", 10, "x"), ("b", 0, "y"), ("d", 5, "w")], schema)
    incremental_merge(updates, path, keys=["k"], app_id="app", position=2, combine=add)
    assert rows(spark, path) == [("a", "x", 11), ("b", "y", 2), ("c", "z", 3), ("d", "w", 105)]
    merge = table_history(spark, path, limit=1)[0].metrics
    # b's values stay the same: matched, not rewritten.
    assert (merge["numSourceRows"], merge["numTargetRowsUpdated"], merge["numTargetRowsInserted"]) == ("3", "1", "1")

    # A table created by a merge holds what merging into an empty one would.
    created = tmp_path / "created"
    incremental_merge(updates, created, keys=["k"], app_id="app", position=2, combine=add)
    assert rows(spark, created) == [("a", "x", 110), ("b", "y", 100), ("d", "w", 105)]
    with pytest.raises(ValueError, match="cannot be combined"):
        incremental_merge(updates, path, keys=["k"], app_id="app", position=3, combine={"k": add["v"]})


def test_merge_refuses_several_rows_per_key_and_other_columns(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "balances"
    full_rebuild(state(spark, upto=4), path, app_id="app", position=4)
    with pytest.raises(DuplicateKeysError) as caught:
        # Unfolded events: accounts a, b and c appear several times in (0, 9].
        incremental_merge(events(spark, upto=9), path, keys=["account"], app_id="app", position=9)
    assert set(caught.value.examples) == {("a", 3), ("b", 2), ("c", 2)}
    assert "latest_per_key" in str(caught.value)

    wider = state(spark, after=4, upto=9).withColumn("currency", F.lit("EUR"))
    with pytest.raises(SchemaMismatchError) as mismatch:
        incremental_merge(wider, path, keys=["account"], app_id="app", position=9)
    assert mismatch.value.extra == ("currency",) and mismatch.value.missing == ()

    assert deltalake.DeltaTable(str(path)).version() == 0
    assert recorded_position(spark, path, "app") == 4


def test_merge_edge_cases_null_keys_and_empty_updates(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "nullable"
    schema = "k STRING, v BIGINT"
    full_rebuild(spark.createDataFrame([(None, 1), ("x", 1)], schema), path, app_id="app", position=1)
    incremental_merge(spark.createDataFrame([(None, 2)], schema), path, keys=["k"], app_id="app", position=2)
    # Null-safe key equality: the null key is updated, not inserted a second time.
    found = deltalake.DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    assert sorted(found, key=lambda r: str(r["k"])) == [{"k": None, "v": 2}, {"k": "x", "v": 1}]

    # A range without changes still commits, so the table records that it is up to date.
    empty = incremental_merge(spark.createDataFrame([], schema), path, keys=["k"], app_id="app", position=3)
    assert (empty.applied, empty.table_version, empty.recorded_position) == (True, 2, 3)
    assert deltalake.DeltaTable(str(path)).to_pyarrow_table().num_rows == 2


def test_concurrent_merges_of_the_same_range_apply_once(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "balances"
    full_rebuild(state(spark, upto=4), path, app_id="app", position=4)
    updates = state(spark, after=4, upto=9)
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(incremental_merge(updates, path, keys=["account"], app_id="app", position=9))
        except Exception as exc:  # surfaced by the assertion below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert all(not isinstance(r, Exception) for r in results), results
    assert sorted(r.applied for r in results) == [False, True]
    merges = [h for h in table_history(spark, path) if h.operation == "MERGE"]
    assert [(m.position, m.app_id) for m in merges] == [(9, "app")]
    assert delta_rs_rows(path) == ALL_NINE


def test_bad_arguments_are_rejected(spark: SparkSession, tmp_path: Path) -> None:
    frame = state(spark, upto=2)
    with pytest.raises(ValueError):
        full_rebuild(frame, tmp_path / "t", app_id="", position=1)
    with pytest.raises(ValueError):
        full_rebuild(frame, tmp_path / "t", app_id="app", position=-1)
    with pytest.raises(ValueError):
        full_rebuild(frame, tmp_path / "t", app_id="app", position=True)
    with pytest.raises(ValueError):
        incremental_merge(frame, tmp_path / "t", keys=[], app_id="app", position=1)
    with pytest.raises(ValueError):
        incremental_merge(frame, tmp_path / "t", keys=["nope"], app_id="app", position=1)
    with pytest.raises(ValueError):
        incremental_merge(frame, tmp_path / "t", keys=["account"], app_id="app", position=1, deleted_col="account")
    assert not (tmp_path / "t").exists()


def test_checked_rows_are_read_as_they_are_and_cached_ones_are_refused(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "balances"
    full_rebuild(state(spark, upto=4), path, app_id="app", position=4)
    # A local checkpoint is read twice by the MERGE as it is, without Delta's copy.
    incremental_merge(state(spark, after=4, upto=6).localCheckpoint(), path, keys=["account"], app_id="app",
                      position=6, checked=True)
    assert rows(spark, path) == sorted(
        [("a", 15, False, 4), ("b", 25, False, 6), ("c", 30, False, 3), ("d", 40, False, 5)]
    )
    # Delta cannot trust a cache to stay the same between its two reads without that copy.
    cached = state(spark, after=6, upto=9).persist()
    try:
        cached.count()
        with pytest.raises(ValueError, match=r"not cached.*localCheckpoint\(\), or checked=False"):
            incremental_merge(cached, path, keys=["account"], app_id="app", position=9, checked=True)
        assert (deltalake.DeltaTable(str(path)).version(), recorded_position(spark, path, "app")) == (1, 6)
        # Unchecked, the same cached rows merge (Delta copies them first).
        incremental_merge(cached, path, keys=["account"], app_id="app", position=9)
    finally:
        cached.unpersist()
    assert rows(spark, path) == delta_rs_rows(path) == sorted(ALL_NINE)
