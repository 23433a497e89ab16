"""Materialise projection results into Delta tables, exactly once per stream position.

The DataFrame can come from anywhere; what this module adds is the bookkeeping that makes
a projection restartable:

* every commit carries Delta's idempotent-write identity ``(txnAppId=app_id,
  txnVersion=position)``, so Delta itself refuses to apply the same position twice - a
  retry after a crash, or a second job racing the first, becomes a no-op;
* every commit records ``{"jetsourcing.app_id", "jetsourcing.position",
  "jetsourcing.mode", "jetsourcing.write_id"}`` as JSON commit user metadata, so the
  table's history says which stream position each version reflects (and the write id
  which call made it).

``position`` is the stream sequence number of the last event the data reflects. Delta
skips a write whose ``txnVersion`` is not greater than the one recorded for its app id,
so positions must grow per ``app_id``; to rebuild at (or rewind to) a position already
recorded - e.g. because the projection's code changed - use a new ``app_id`` (for
instance one that includes the projection's version).

Row deletion: give the updates a boolean tombstone column (``deleted_col``); rows with
``true`` there are removed from the table (merge) or left out (rebuild), and the column
itself is never stored.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import reduce
from typing import Any, Literal

from delta.exceptions import (
    ConcurrentAppendException,
    ConcurrentDeleteDeleteException,
    ConcurrentDeleteReadException,
    ConcurrentTransactionException,
    ConcurrentWriteException,
    DeltaConcurrentModificationException,
    MetadataChangedException,
    ProtocolChangedException,
)
from delta.tables import DeltaTable
from py4j.protocol import Py4JError
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from spark_projections.errors import DuplicateKeysError, SchemaMismatchError

__all__ = [
    "METADATA_APP_ID",
    "METADATA_MODE",
    "METADATA_POSITION",
    "METADATA_WRITE_ID",
    "TXN_APP_ID_CONF",
    "TXN_VERSION_CONF",
    "USER_METADATA_CONF",
    "HistoryEntry",
    "WriteResult",
    "check_one_row_per_key",
    "full_rebuild",
    "incremental_merge",
    "latest_per_key",
    "position_from_history",
    "recorded_position",
    "table_history",
    "table_version",
]

METADATA_APP_ID = "jetsourcing.app_id"
METADATA_POSITION = "jetsourcing.position"
METADATA_MODE = "jetsourcing.mode"
# A fresh id per call: Delta skips a repeated idempotent write silently, and a racing twin
# writes the same app_id/position, so only this tells whether *this* call committed.
METADATA_WRITE_ID = "jetsourcing.write_id"

# Delta reads a DML command's (MERGE/UPDATE/DELETE) idempotency identity and commit
# metadata from these session confs - the DeltaTable API has no per-call options - and
# leaves them set after the commit. They are therefore only ever set on a private
# session (see _isolated_session) and unset again in `finally`.
TXN_APP_ID_CONF = "spark.databricks.delta.write.txnAppId"
TXN_VERSION_CONF = "spark.databricks.delta.write.txnVersion"
USER_METADATA_CONF = "spark.databricks.delta.commitInfo.userMetadata"
# Delta's MERGE copies a source that is not a plain Delta scan before it starts, in case it
# changes between MERGE's two passes; "none" skips the copy for sources known to be stable.
_MATERIALIZE_SOURCE_CONF = "spark.databricks.delta.merge.materializeSource"
_CACHED_SOURCE = "DELTA_MERGE_SOURCE_CACHED_DURING_EXECUTION"  # Delta's error for a cached source it did not copy

_CONFLICTS: tuple[type[Exception], ...] = (
    DeltaConcurrentModificationException,
    ConcurrentWriteException,
    MetadataChangedException,
    ProtocolChangedException,
    ConcurrentAppendException,
    ConcurrentDeleteReadException,
    ConcurrentDeleteDeleteException,
    ConcurrentTransactionException,
)

PathLike = str | os.PathLike[str]
Mode = Literal["rebuild", "merge"]
Combine = Callable[[Column, Column], Column]
"""How :func:`incremental_merge` merges a column: ``(stored, new)`` columns -> the merged column."""


@dataclass(frozen=True)
class WriteResult:
    """Outcome of :func:`full_rebuild` / :func:`incremental_merge`.

    ``applied`` is true iff this call committed (false: the position was already recorded
    - by an earlier run or a concurrent twin - and this call changed nothing).
    ``table_version`` is the table's latest version after the call (-1: no table).
    ``recorded_position`` is the position recorded for the app id as this call observed
    it (``position`` itself when applied).
    """

    applied: bool
    table_version: int
    recorded_position: int | None


@dataclass(frozen=True)
class HistoryEntry:
    """One commit of a Delta table as :func:`table_history` reports it.

    ``position``, ``app_id``, ``mode`` and ``write_id`` come from the commit's jetsourcing
    user metadata and are ``None`` for commits not made by this module (e.g. OPTIMIZE).
    """

    version: int
    operation: str
    timestamp: datetime
    position: int | None
    app_id: str | None
    mode: str | None
    write_id: str | None = None
    metrics: dict[str, str] = field(default_factory=dict)
    """Delta's ``operationMetrics`` of the commit (e.g. ``numOutputRows``, ``numTargetRowsInserted``)."""


def full_rebuild(
    df: DataFrame,
    path: PathLike,
    *,
    app_id: str,
    position: int,
    partition_by: Sequence[str] = (),
    deleted_col: str | None = None,
) -> WriteResult:
    """Replace the table at ``path`` with ``df`` in ONE Delta commit, recording ``position``.

    Overwrites data and schema (``overwriteSchema``) and partitioning; creates the table
    if absent. The commit carries ``txnAppId=app_id, txnVersion=position`` and the
    position in its user metadata. If ``position`` is already recorded for ``app_id``
    (retry, concurrent twin, or an older position), nothing is written and
    ``applied=False`` - Delta enforces this even when two jobs race past our own check.
    With ``deleted_col``, rows whose tombstone is true are left out and the column dropped.
    """
    _check_identity(app_id, position)
    target = os.fspath(path)
    spark = df.sparkSession
    already = recorded_position(spark, target, app_id)
    if already is not None and already >= position:
        return WriteResult(False, table_version(spark, target), already)
    version_before = table_version(spark, target)
    write_id = uuid.uuid4().hex
    writer = (
        _drop_tombstones(df, deleted_col)
        .write.format("delta")
        .mode("overwrite")
        .option("overwriteSchema", "true")
        .option("txnAppId", app_id)
        .option("txnVersion", str(position))
        .option("userMetadata", _user_metadata(app_id, position, "rebuild", write_id))
    )
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    try:
        writer.save(target)
    except _CONFLICTS:
        # A concurrent writer committed first. If it recorded this position, the work
        # is done (by it); any other conflict is the caller's to retry.
        if not _position_reached(spark, target, app_id, position):
            raise
    return _result(spark, target, app_id, write_id, version_before)


def incremental_merge(
    updates_df: DataFrame,
    path: PathLike,
    *,
    keys: Sequence[str],
    app_id: str,
    position: int,
    deleted_col: str | None = None,
    combine: Mapping[str, Combine] | None = None,
    checked: bool = False,
) -> WriteResult:
    """Upsert one-row-per-key ``updates_df`` into the table at ``path`` in ONE commit.

    Matched keys get the update's values, new keys are inserted; with ``deleted_col``,
    keys whose tombstone is true are deleted (and not inserted). Keys compare with
    null-safe equality. ``combine`` maps a value column to a function of the stored and
    the new column giving the merged value (the stored column is null for a new key);
    other columns take the new value. A stored row is rewritten only when a value
    changes. Creates the table (from the non-deleted rows) when absent. The commit
    carries ``txnAppId=app_id, txnVersion=position`` and the position in its user
    metadata; when the position is already recorded nothing happens (``applied=False``).

    Raises :class:`~spark_projections.errors.DuplicateKeysError` when a key has several
    rows, :class:`~spark_projections.errors.SchemaMismatchError` when the columns differ
    from the table's, ``ValueError`` for unusable arguments. ``updates_df`` is persisted
    and computed once, by the check, for the check and the merge. ``checked=True`` says
    the caller made sure of both (one row per key; the same rows each time it is read,
    without a cache: ``DataFrame.localCheckpoint``, say): the check's Spark job is
    skipped, and so is the copy of the source Delta's MERGE otherwise makes first (a Spark
    job and its planning). Delta refuses to read a cached source without that copy, so
    ``checked=True`` with cached rows raises ``ValueError`` (nothing is written).
    """
    _check_identity(app_id, position)
    keys = list(keys)
    combine = dict(combine or {})
    columns = list(updates_df.columns)
    if not keys:
        raise ValueError("incremental_merge needs at least one key column")
    unknown = [k for k in [*keys, *([deleted_col] if deleted_col else []), *combine] if k not in columns]
    if unknown:
        raise ValueError(f"columns {unknown} are not in the updates ({columns})")
    if deleted_col in keys:
        raise ValueError(f"the tombstone column {deleted_col!r} cannot be a key")
    fixed = [c for c in combine if c in keys or c == deleted_col]
    if fixed:
        raise ValueError(f"keys and the tombstone column cannot be combined ({fixed})")
    target = os.fspath(path)
    spark = updates_df.sparkSession
    already = recorded_position(spark, target, app_id)
    if already is not None and already >= position:
        return WriteResult(False, table_version(spark, target), already)
    version_before = table_version(spark, target)
    write_id = uuid.uuid4().hex

    # Persist so the check and the merge see the same rows and the source is read once;
    # released in `finally`.
    updates = updates_df if checked else updates_df.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        if not checked:
            check_one_row_per_key(updates, keys)
        try:
            if version_before < 0:
                _create_from_updates(updates, target, app_id, position, write_id, deleted_col, combine)
            else:
                _merge(updates, target, keys, app_id, position, write_id, deleted_col, combine, stable=checked)
        except _CONFLICTS:
            if not _position_reached(spark, target, app_id, position):
                raise
        except Exception as exc:  # the JVM's error, as py4j or PySpark hands it over
            if not checked or _CACHED_SOURCE not in str(exc):
                raise
            raise ValueError(
                "incremental_merge(checked=True) needs rows that are not cached (Delta reads them twice and cannot "
                "trust a cache to stay the same): pass updates_df.localCheckpoint(), or checked=False"
            ) from None
    finally:
        if not checked:
            updates.unpersist()
    return _result(spark, target, app_id, write_id, version_before)


def check_one_row_per_key(df: DataFrame, keys: Sequence[str]) -> int:
    """The number of rows of ``df``, in one Spark job that also makes sure no key has several.

    Raises :class:`~spark_projections.errors.DuplicateKeysError` with some of the repeated
    keys and their counts.
    """
    keys = list(keys)
    per_key = df.groupBy(*[F.col(_quote(k)) for k in keys]).agg(F.count(F.lit(1)).alias("rows"))
    repeated = F.when(F.col("rows") > 1, F.struct(*[F.col(_quote(k)) for k in keys], F.col("rows")))
    summary = per_key.agg(
        F.sum("rows").alias("rows"), F.slice(F.collect_list(repeated), 1, 5).alias("repeated")
    ).first()
    assert summary is not None
    if summary["repeated"]:
        raise DuplicateKeysError(keys, [tuple(row) for row in summary["repeated"]])
    return int(summary["rows"] or 0)


def table_version(spark: SparkSession, path: PathLike) -> int:
    """The latest version of the Delta table at ``path`` (-1: no table), without a Spark job."""
    target = os.fspath(path)
    try:
        return int(_snapshot(spark, target).version())
    except Py4JError:
        history = table_history(spark, target, limit=1)
        return history[0].version if history else -1


def recorded_position(spark: SparkSession, path: PathLike, app_id: str) -> int | None:
    """The highest stream position the table at ``path`` reflects for ``app_id``.

    Read from the Delta transaction identity recorded for ``app_id`` - the very value
    Delta compares against to skip repeated writes - as the version's checksum file lists
    it (Delta writes them there at each commit), or else from the table's state, which
    takes a few Spark jobs. ``None`` when there is no table or nothing was recorded for
    ``app_id``. Should Delta's (internal) log API be unavailable, falls back to
    :func:`position_from_history`.
    """
    target = os.fspath(path)
    try:
        snapshot = _snapshot(spark, target)
        if snapshot.version() < 0:
            return None
        listed = _checksum_transactions(snapshot)
        if listed is not None:
            return listed.get(app_id)
        recorded = snapshot.transactions().get(app_id)
        return int(recorded.get()) if recorded.isDefined() else None
    except Py4JError:
        return position_from_history(spark, target, app_id)


def position_from_history(spark: SparkSession, path: PathLike, app_id: str) -> int | None:
    """The position in the newest commit whose user metadata was written for ``app_id``.

    Independent of Delta internals, but only sees commits still in the log (Delta cleans
    up old log entries after ``delta.logRetentionDuration``, 30 days by default).
    """
    for entry in table_history(spark, path):
        if entry.app_id == app_id and entry.position is not None:
            return entry.position
    return None


def table_history(spark: SparkSession, path: PathLike, limit: int | None = None) -> list[HistoryEntry]:
    """The table's commits (the newest ``limit`` of them, or all), newest first, with the jetsourcing metadata
    decoded.

    Empty when there is no Delta table at ``path``.
    """
    target = os.fspath(path)
    if not DeltaTable.isDeltaTable(spark, target):
        return []
    # Delta returns the history newest first; collecting it is a local operation.
    table = DeltaTable.forPath(spark, target)
    rows = (table.history() if limit is None else table.history(limit)).collect()
    entries = [_history_entry(row.asDict()) for row in rows]
    return sorted(entries, key=lambda entry: entry.version, reverse=True)


def latest_per_key(df: DataFrame, keys: Sequence[str], order_col: str) -> DataFrame:
    """Keep, for each key, the row with the greatest ``order_col`` (e.g. stream sequence).

    ``order_col`` must be unique within a key (a stream position is); with ties, which of
    the tied rows survives is unspecified. Output has the input's columns.
    """
    if not keys:
        raise ValueError("latest_per_key needs at least one key column")
    rank = "__jetsourcing_rank"
    window = Window.partitionBy(*keys).orderBy(F.col(order_col).desc())
    return df.withColumn(rank, F.row_number().over(window)).where(F.col(rank) == 1).drop(rank)


# --- internals -------------------------------------------------------------------------


def _check_identity(app_id: str, position: int) -> None:
    if not isinstance(app_id, str) or not app_id.strip():
        raise ValueError(f"app_id must be a non-empty string, got {app_id!r}")
    # bool is an int subclass; True as a position is a bug, not position 1.
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise ValueError(f"position must be an int >= 0, got {position!r}")


def _user_metadata(app_id: str, position: int, mode: Mode, write_id: str) -> str:
    return json.dumps(
        {
            METADATA_APP_ID: app_id,
            METADATA_POSITION: position,
            METADATA_MODE: mode,
            METADATA_WRITE_ID: write_id,
        },
        sort_keys=True,
    )


def _history_entry(row: dict[str, Any]) -> HistoryEntry:
    meta = _jetsourcing_metadata(row.get("userMetadata"))
    return HistoryEntry(
        metrics={str(k): str(v) for k, v in (row.get("operationMetrics") or {}).items()},
        version=int(row["version"]),
        operation=str(row["operation"]),
        timestamp=row["timestamp"],
        position=meta.get(METADATA_POSITION),
        app_id=meta.get(METADATA_APP_ID),
        mode=meta.get(METADATA_MODE),
        write_id=meta.get(METADATA_WRITE_ID),
    )


def _jetsourcing_metadata(raw: str | None) -> dict[str, Any]:
    """The jetsourcing keys of a commit's user metadata; empty for a commit not made by this module."""
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError:  # someone else's free-text metadata
        return {}
    if not isinstance(meta, dict) or not isinstance(meta.get(METADATA_POSITION), int):
        return {}
    return {key: meta.get(key) for key in (METADATA_APP_ID, METADATA_POSITION, METADATA_MODE, METADATA_WRITE_ID)}


def _snapshot(spark: SparkSession, target: str) -> Any:
    """A freshly updated Delta snapshot of ``target`` (version -1 when no table).

    Delta's Python API exposes neither the recorded transaction identities nor a cheap
    "current version", so this reaches the JVM DeltaLog directly.
    """
    jvm: Any = spark.sparkContext._jvm
    jsession: Any = spark._jsparkSession
    return jvm.org.apache.spark.sql.delta.DeltaLog.forTableWithSnapshot(jsession, target)._2()


def _checksum_transactions(snapshot: Any) -> dict[str, int] | None:
    """The recorded positions (app id -> txnVersion) the snapshot's checksum file lists; None when it lists none."""
    checksum = snapshot.checksumOpt()
    if not checksum.isDefined():
        return None
    listed = checksum.get().setTransactions()
    if not listed.isDefined():
        return None
    transactions = listed.get()
    return {t.appId(): int(t.version()) for t in (transactions.apply(i) for i in range(transactions.size()))}


def _position_reached(spark: SparkSession, target: str, app_id: str, position: int) -> bool:
    recorded = recorded_position(spark, target, app_id)
    return recorded is not None and recorded >= position


def _result(
    spark: SparkSession, target: str, app_id: str, write_id: str, version_before: int
) -> WriteResult:
    """Whether this call's commit (found by ``write_id``) appeared after ``version_before``.

    Delta skips a repeated idempotent write silently, so success of the call says nothing;
    the new commits' metadata does.
    """
    version_after = table_version(spark, target)
    if version_after > version_before:
        for meta in _metadata_since(spark, target, version_before, version_after):
            if meta.get(METADATA_WRITE_ID) == write_id:
                # Our commit recorded `position`; no need to recompute the table state
                # (a Spark job) to read it back.
                return WriteResult(True, version_after, meta[METADATA_POSITION])
    return WriteResult(False, version_after, recorded_position(spark, target, app_id))


def _metadata_since(spark: SparkSession, target: str, version_before: int, version_after: int) -> list[dict[str, Any]]:
    """The jetsourcing metadata of the commits after ``version_before``, read from the log by the driver.

    ``DeltaTable.history`` reads the commits in a Spark job; it still does should the
    log API be unavailable.
    """
    try:
        jvm: Any = spark.sparkContext._jvm
        log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, target)
        changes = log.getChanges(version_before + 1, jvm.scala.Option.empty(), False)
        found = []
        while changes.hasNext():
            actions = changes.next()._2()
            # Delta writes the commit info first: a commit of many files is not walked through.
            for i in range(actions.size()):
                action = actions.apply(i)
                if action.getClass().getSimpleName() == "CommitInfo":
                    raw = action.userMetadata()
                    found.append(_jetsourcing_metadata(raw.get() if raw.isDefined() else None))
                    break
        return found
    except Py4JError:
        history = table_history(spark, target, version_after - version_before)
        return [{METADATA_POSITION: e.position, METADATA_WRITE_ID: e.write_id}
                for e in history if e.version > version_before]


def _drop_tombstones(df: DataFrame, deleted_col: str | None) -> DataFrame:
    if deleted_col is None:
        return df
    return df.where(~_is_deleted(F.col(deleted_col))).drop(deleted_col)


def _is_deleted(column: Column) -> Column:
    # A null tombstone means "not deleted".
    return F.coalesce(column, F.lit(False))


def _create_from_updates(
    updates: DataFrame,
    target: str,
    app_id: str,
    position: int,
    write_id: str,
    deleted_col: str | None,
    combine: Mapping[str, Combine],
) -> None:
    inserted = updates.alias("s")
    if deleted_col is not None:
        inserted = inserted.where(~_is_deleted(F.col(f"s.{_quote(deleted_col)}")))
    values = _insert_values(updates, deleted_col, combine)
    # Append (not overwrite): if another job creates the table concurrently, Delta's
    # conflict detection sees both, instead of one silently replacing the other.
    (
        inserted.select(*[value.alias(name) for name, value in values.items()])
        .write.format("delta")
        .mode("append")
        .option("txnAppId", app_id)
        .option("txnVersion", str(position))
        .option("userMetadata", _user_metadata(app_id, position, "merge", write_id))
        .save(target)
    )


def _insert_values(updates: DataFrame, deleted_col: str | None, combine: Mapping[str, Combine]) -> dict[str, Column]:
    """A new key's row: each column of source ``s`` combined with a null stored value."""
    types = {f.name: f.dataType for f in updates.schema.fields}
    values = {}
    for name in updates.columns:
        if name == deleted_col:
            continue
        new = F.col(f"s.{_quote(name)}")
        values[name] = combine[name](F.lit(None).cast(types[name]), new) if name in combine else new
    return values


def _merge(
    updates: DataFrame,
    target: str,
    keys: list[str],
    app_id: str,
    position: int,
    write_id: str,
    deleted_col: str | None,
    combine: Mapping[str, Combine],
    *,
    stable: bool,
) -> None:
    spark = updates.sparkSession
    table_columns = DeltaTable.forPath(spark, target).toDF().columns
    value_columns = [c for c in updates.columns if c != deleted_col]
    missing = [c for c in table_columns if c not in value_columns]
    extra = [c for c in value_columns if c not in table_columns]
    if missing or extra:
        raise SchemaMismatchError(target, missing, extra)

    session = _isolated_session(spark)
    settings = {
        TXN_APP_ID_CONF: app_id,
        TXN_VERSION_CONF: str(position),
        USER_METADATA_CONF: _user_metadata(app_id, position, "merge", write_id),
    }
    if stable:
        settings[_MATERIALIZE_SOURCE_CONF] = "none"
    for key, value in settings.items():
        session.conf.set(key, value)
    try:
        condition = " AND ".join(f"t.{_quote(k)} <=> s.{_quote(k)}" for k in keys)
        inserted = _insert_values(updates, deleted_col, combine)
        updated = {
            c: combine[c](F.col(f"t.{_quote(c)}"), F.col(f"s.{_quote(c)}")) if c in combine else F.col(f"s.{_quote(c)}")
            for c in value_columns
        }
        # A matched row whose values stay the same is neither rewritten nor counted as updated.
        changes = [~F.col(f"t.{_quote(c)}").eqNullSafe(v) for c, v in updated.items() if c not in keys]
        changed = reduce(lambda a, b: a | b, changes) if changes else F.lit(False)
        set_values: dict[str, str | Column] = {_quote(c): v for c, v in updated.items()}
        insert_values: dict[str, str | Column] = {_quote(c): v for c, v in inserted.items()}
        builder = DeltaTable.forPath(session, target).alias("t").merge(updates.alias("s"), condition)
        if deleted_col is None:
            builder = builder.whenMatchedUpdate(condition=changed, set=set_values).whenNotMatchedInsert(
                values=insert_values
            )
        else:
            deleted = _is_deleted(F.col(f"s.{_quote(deleted_col)}"))
            # Clauses are tried in order: a tombstone deletes, anything else updates.
            builder = (
                builder.whenMatchedDelete(condition=deleted)
                .whenMatchedUpdate(condition=changed, set=set_values)
                .whenNotMatchedInsert(condition=~deleted, values=insert_values)
            )
        builder.execute()
    finally:
        for key in settings:
            session.conf.unset(key)


def _isolated_session(spark: SparkSession) -> SparkSession:
    """A session sharing ``spark``'s context and runtime SQL settings, but not its conf.

    Setting the txn confs on the caller's session would leak into every other write made
    on it meanwhile (other threads included), which Delta would then silently skip or
    stamp with our identity.
    """
    session = spark.newSession()
    for key, value in spark.conf.getAll.items():
        if spark.conf.isModifiable(key) and key not in (
            TXN_APP_ID_CONF,
            TXN_VERSION_CONF,
            USER_METADATA_CONF,
        ):
            session.conf.set(key, value)
    return session


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"
