"""Run projections in Spark and materialise them into Delta tables, in full or incrementally.

Two kinds of projection run here:

* **The daemon's own definitions** (:class:`projections.Projection`): the same
  handlers that keep the SQLite read model up to date fold the events in
  Spark. Events are grouped per entity (``stream_id``, or another group
  column), sorted by ``(position, index)`` and applied group by group to an
  in-memory :class:`projections.MemoryStore` inside ``mapInArrow`` tasks; the
  stores' rows are the read-model tables. **Constraint:** a group is folded
  without seeing other groups, so a handler may only read and write rows that
  belong to its event's group (keys derived from ``event.stream_id`` or the
  event itself). Two groups writing the same row fail the run with
  :class:`FoldConstraintError`; a handler that *reads* another group's row
  silently sees nothing, so keep handlers entity-local.
* **DataFrame projections** (:class:`DataFrameProjection`): a plain function
  from the events DataFrame to the read-model DataFrame - aggregations, joins
  across categories, anything Spark does.

Each table lives in its own Delta table at ``<root>/<table name>`` and every
write records the stream position it reflects (see
:mod:`spark_projections.delta`), under the app id ``<name>.v<version>`` (a new
version rebuilds instead of being skipped as "already recorded"):

* :func:`rebuild` computes every table from the whole history up to the
  stream's last position and replaces each table in one commit;
* :func:`update` reads only the events after the recorded position, and costs
  what they change. A fold projection loads the current rows of the affected
  groups from Delta as the fold's starting state (tables of fold projections
  carry a ``_jetsourcing_group`` column for that) and merges the groups' new
  rows, deleting rows the handlers deleted; a DataFrame projection's MERGE
  combines its partial result with the stored rows per column (``combine``).
  A stored row is rewritten only when its values change. Running it again
  with no new events changes nothing, and the result equals a rebuild;
  :func:`merge_events` does the same with events the caller has already (a
  Structured Streaming micro-batch).

Example::

    from projections import Projection
    from spark_projections.projection import rebuild, update

    rebuild(spark, AccountBalances(), settings, "/lake/accounts")   # /lake/accounts/balances, .../closures
    update(spark, AccountBalances(), settings, "/lake/accounts")    # later: only the new events

From a shell: ``jetsourcing spark rebuild myapp.views:AccountBalances --root /lake/accounts``.

Executors must import the projection's module (an installed package, or
``spark.sparkContext.addPyFile``). Handler errors fail the Spark job (the
daemon's ``dead_letter`` policy does not apply here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial, reduce
from pathlib import Path
from typing import Any, Literal, TypeVar

import pyarrow as pa
from pyspark import Accumulator, StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from eventstore import EventStoreSettings, RecordedEvent, StreamId, TypeRegistry
from projections import MemoryStore, Projection, Table, fold
from spark_projections.delta import (
    WriteResult,
    check_one_row_per_key,
    full_rebuild,
    incremental_merge,
    recorded_position,
    table_version,
)
from spark_projections.errors import SparkProjectionError
from spark_projections.source import EVENTS_SCHEMA, read_events, stream_bounds

__all__ = [
    "GROUP_COLUMN",
    "Combine",
    "DataFrameProjection",
    "FoldConstraintError",
    "Progress",
    "ProjectionRun",
    "app_id_of",
    "common_position",
    "fold_tables",
    "merge_events",
    "rebuild",
    "table_schema",
    "update",
]

GROUP_COLUMN = "_jetsourcing_group"
"""Column of fold projections' Delta tables: the group (entity) whose events produced the row."""

_KIND = "_jetsourcing_kind"  # 0: a stored row (fold start state), 1: an event
_TABLE = "_jetsourcing_table"  # which of the projection's tables a state/output row belongs to
_DELETED = "_jetsourcing_deleted"  # output tombstone: the row existed at the start and was deleted
_OUTPUT_ROWS = 5000  # rows per Arrow batch a fold task emits
_CLASH = "jetsourcing: a row changes group"  # raised inside a MERGE, turned into a FoldConstraintError

Combine = Literal["sum", "min", "max", "last", "first"] | Callable[[Column, Column], Column]
"""How :func:`update` merges a column of a DataFrame projection's partial result into the stored row.

``"sum"`` adds them; ``"min"`` / ``"max"`` keep the extreme; ``"last"`` takes the new value
unless it is null; ``"first"`` keeps the stored value unless it is null; a callable gets
``(stored, new)`` columns (stored is null for a new key) and returns the merged column.
"""

_PYTHON_TO_SPARK: dict[type, DataType] = {
    str: StringType(),
    int: LongType(),
    float: DoubleType(),
    bool: BooleanType(),
    bytes: BinaryType(),
}


class FoldConstraintError(SparkProjectionError):
    """Several groups wrote the same read-model row, so the projection cannot be folded per group.

    ``table`` is the table, ``examples`` some offending keys with the groups that wrote them.
    """

    def __init__(self, projection: str, table: str, group_by: str, examples: Sequence[tuple[Any, list[str]]]) -> None:
        self.projection = projection
        self.table = table
        self.examples = tuple(examples)
        shown = "; ".join(f"key {key!r} by {', '.join(groups[:3])}" for key, groups in examples)
        super().__init__(
            f"{projection}: rows of table {table!r} were written while folding several {group_by} groups ({shown}). "
            f"Spark folds each {group_by} group on its own, so handlers may only touch rows keyed by their event's "
            "group; fold by a coarser column (group_by=...), or write this read model as a DataFrameProjection."
        )


@dataclass(frozen=True)
class DataFrameProjection:
    """A read model computed by a plain function from the events DataFrame.

    ``build`` gets the events (:data:`~spark_projections.source.EVENTS_SCHEMA`,
    or just ``columns``, limited to ``categories``) and returns one row per ``keys``. For
    :func:`update` it gets only the new events; ``combine`` (column -> how, see
    :data:`Combine`; unlisted columns: ``"last"``) then merges the partial rows
    into the stored ones. Without ``combine``, :func:`update` rebuilds.
    """

    name: str
    build: Callable[[DataFrame], DataFrame]
    keys: tuple[str, ...]
    categories: tuple[str, ...] | None = None
    version: int = 1
    combine: Mapping[str, Combine] | None = None
    columns: tuple[str, ...] | None = None
    """The event columns ``build`` uses (default: all): the source then builds only those."""

    def __post_init__(self) -> None:
        if isinstance(self.keys, str):
            object.__setattr__(self, "keys", (self.keys,))
        if isinstance(self.categories, str):
            object.__setattr__(self, "categories", (self.categories,))
        if not self.keys:
            raise ValueError(f"DataFrameProjection {self.name!r} needs at least one key column.")


AnyProjection = Projection | DataFrameProjection


@dataclass(frozen=True)
class ProjectionRun:
    """What :func:`rebuild` / :func:`update` did.

    ``mode`` is ``"rebuild"`` (tables replaced), ``"merge"`` (new rows merged) or
    ``"noop"`` (nothing new; nothing written). ``from_position`` is the first
    stream position read, ``position`` the one the tables now reflect, ``tables``
    each table's :class:`~spark_projections.delta.WriteResult` (empty for noop).
    ``events`` is how many events a projection's handlers folded (None for a
    DataFrame projection or a noop), counted by a Spark accumulator as the fold
    reads them: a partition Spark had to compute twice would count twice.
    """

    projection: str
    app_id: str
    mode: Literal["rebuild", "merge", "noop"]
    from_position: int
    position: int
    tables: dict[str, WriteResult] = field(default_factory=dict)
    events: int | None = None


def app_id_of(projection: AnyProjection) -> str:
    """The Delta app id a projection's writes are recorded under: ``<name>.v<version>``."""
    return f"{projection.name}.v{projection.version}"


def table_names(projection: AnyProjection) -> list[str]:
    """The projection's table names (a DataFrame projection has one, named after it)."""
    if isinstance(projection, DataFrameProjection):
        return [projection.name]
    return [table.name for table in projection.tables]


def table_schema(table: Table) -> StructType:
    """The Spark schema of a fold projection's Delta table: declared columns, then :data:`GROUP_COLUMN`."""
    fields = [StructField(c.name, _PYTHON_TO_SPARK[c.type], nullable=True) for c in table.columns]
    return StructType([*fields, StructField(GROUP_COLUMN, StringType(), nullable=True)])


# -- running ---------------------------------------------------------------------------------------


def rebuild(
    spark: SparkSession,
    projection: AnyProjection,
    settings: EventStoreSettings,
    root: str | os.PathLike[str],
    *,
    registry: TypeRegistry | None = None,
    to_position: int | None = None,
    partitions: int | None = None,
    group_by: str = "stream_id",
    progress: Progress | None = None,
) -> ProjectionRun:
    """Compute every table of ``projection`` from the whole history and replace it, one commit per table.

    Reads positions 1..``to_position`` (default: the stream's last position now)
    and records that position. ``registry`` decodes ``event.data`` for fold
    projections (default: a new one the projection registers its events in).
    ``partitions`` is the number of parallel stream reads (default: Spark's
    default parallelism). A table already recorded at that position is left
    alone (``applied=False``), so re-running after a crash finishes the job;
    when every table is, nothing is computed (``noop``). ``progress`` is told each
    stage as it starts (reading, folding or building, writing each table).
    """
    high = last_position(settings) if to_position is None else to_position
    return _rebuild(spark, projection, settings, Path(root), registry, high, partitions, group_by, progress or _quiet)


def update(
    spark: SparkSession,
    projection: AnyProjection,
    settings: EventStoreSettings,
    root: str | os.PathLike[str],
    *,
    registry: TypeRegistry | None = None,
    to_position: int | None = None,
    partitions: int | None = None,
    group_by: str = "stream_id",
    progress: Progress | None = None,
) -> ProjectionRun:
    """Bring the tables from their recorded position up to ``to_position`` (default: the last position).

    Reads only the newer events and merges the changed rows, one commit per
    table. Falls back to :func:`rebuild` when a table has no recorded position
    for this projection version, when the tables disagree (an interrupted run)
    or for a DataFrame projection without ``combine``. Nothing new: ``noop``.
    ``progress`` is told each stage as it starts, as for :func:`rebuild`.
    """
    root = Path(root)
    say = progress or _quiet
    app_id = app_id_of(projection)
    high = last_position(settings) if to_position is None else to_position
    low = common_position(spark, projection, root)
    if low is None:
        say("no common recorded position in the tables: rebuilding")
        return _rebuild(spark, projection, settings, root, registry, high, partitions, group_by, say)
    if high <= low:
        say(f"the tables are at position {low}: nothing new")
        return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
    if isinstance(projection, DataFrameProjection) and projection.combine is None:
        say("a DataFrame projection without combine: rebuilding")
        return _rebuild(spark, projection, settings, root, registry, high, partitions, group_by, say)
    say(_reading(settings, projection, low + 1, high))
    events = read_events(spark, settings, categories=projection.categories, from_position=low + 1,
                         to_position=high, partitions=partitions, columns=_columns_of(projection))
    if isinstance(projection, DataFrameProjection):
        return _merge_dataframe(projection, events, root, app_id, low, high, say)
    return _merge_fold(projection, events, root, app_id, low, high, registry, group_by, say)


def common_position(spark: SparkSession, projection: AnyProjection, root: str | os.PathLike[str]) -> int | None:
    """The stream position every table of ``projection`` under ``root`` records for its version.

    None when a table records none (it is missing, or was written by another
    version) or the tables record different ones (an interrupted run).
    """
    app_id = app_id_of(projection)
    recorded = {recorded_position(spark, Path(root) / name, app_id) for name in table_names(projection)}
    return recorded.pop() if len(recorded) == 1 else None


def merge_events(
    spark: SparkSession,
    projection: AnyProjection,
    events: DataFrame,
    root: str | os.PathLike[str],
    *,
    position: int,
    registry: TypeRegistry | None = None,
    group_by: str = "stream_id",
    progress: Progress | None = None,
) -> ProjectionRun:
    """Bring the tables to ``position`` with ``events``: the events after their recorded position, up to ``position``.

    What :func:`update` does once it has read the new events, for a caller that
    has them already (a Structured Streaming micro-batch, say): the changed rows
    are merged, one Delta commit per table recorded at ``position``, so a second
    call with the same ``position`` changes nothing (``noop``, nothing computed).
    When no table records a position for this projection version yet, the
    tables are built from ``events`` alone, as :func:`rebuild` builds them from
    the whole history: ``events`` must then start at the first event. Tables at
    different positions (an interrupted run) cannot be brought up to date with
    these events: :class:`SparkProjectionError`, rebuild them. A DataFrame
    projection needs ``combine``. ``events`` has the columns of
    :data:`~spark_projections.source.EVENTS_SCHEMA` (a DataFrame projection's
    ``columns`` at least).
    """
    root = Path(root)
    say = progress or _quiet
    app_id = app_id_of(projection)
    recorded = {recorded_position(spark, root / name, app_id) for name in table_names(projection)}
    if recorded == {None}:
        return _rebuild_from(projection, events, root, app_id, position, registry, group_by, say)
    low = recorded.pop() if len(recorded) == 1 else None
    if low is None:
        raise SparkProjectionError(
            f"The tables of {projection.name} under {root} record different positions for {app_id} (an interrupted "
            "run): new events cannot bring them up to date; rebuild them."
        )
    if position <= low:
        say(f"the tables are at position {low}: nothing new")
        return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
    if isinstance(projection, DataFrameProjection):
        if projection.combine is None:
            raise SparkProjectionError(
                f"{projection.name}: a DataFrame projection without combine cannot merge new events; rebuild it."
            )
        return _merge_dataframe(projection, events, root, app_id, low, position, say)
    return _merge_fold(projection, events, root, app_id, low, position, registry, group_by, say)


Progress = Callable[[str], None]
"""Told each stage of a :func:`rebuild` or :func:`update` as it starts, in words."""


def _quiet(stage: str) -> None:
    """The progress of a caller that did not ask for it."""


def _reading(settings: EventStoreSettings, projection: AnyProjection, low: int, high: int) -> str:
    what = ", ".join(projection.categories) if projection.categories else "every category"
    return f"reading positions {low:,} to {high:,} of stream {settings.stream!r} ({what}) from JetStream"


def _columns_of(projection: AnyProjection) -> tuple[str, ...] | None:
    return projection.columns if isinstance(projection, DataFrameProjection) else None


def _rebuild(
    spark: SparkSession,
    projection: AnyProjection,
    settings: EventStoreSettings,
    root: Path,
    registry: TypeRegistry | None,
    high: int,
    partitions: int | None,
    group_by: str,
    say: Progress,
) -> ProjectionRun:
    app_id = app_id_of(projection)
    recorded = [recorded_position(spark, root / name, app_id) for name in table_names(projection)]
    if all(position is not None and position >= high for position in recorded):
        say(f"every table is recorded at position {high} or later: nothing to do")
        return ProjectionRun(projection.name, app_id, "noop", 1, min(p for p in recorded if p is not None))
    say(_reading(settings, projection, 1, high))
    events = read_events(spark, settings, categories=projection.categories, to_position=high, partitions=partitions,
                         columns=_columns_of(projection))
    return _rebuild_from(projection, events, root, app_id, high, registry, group_by, say)


def _rebuild_from(
    projection: AnyProjection,
    events: DataFrame,
    root: Path,
    app_id: str,
    high: int,
    registry: TypeRegistry | None,
    group_by: str,
    say: Progress,
) -> ProjectionRun:
    """Replace each table with what ``events``, the whole history up to ``high``, make of it (one commit each)."""
    if isinstance(projection, DataFrameProjection):
        say(f"building table {projection.name} from the events and writing it (one Delta commit)")
        result = full_rebuild(projection.build(events), root / projection.name, app_id=app_id, position=high)
        return ProjectionRun(projection.name, app_id, "rebuild", 1, high, {projection.name: result})
    say(f"folding the events per {group_by} through the projection's handlers")
    counter = events.sparkSession.sparkContext.accumulator(0)
    folded = _fold(projection, events, registry, group_by, None, counter).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        tables = _split(projection, folded)
        _check_one_writer(projection, tables, group_by)
        results = {}
        for name, frame in tables.items():
            say(f"writing table {name} (one Delta commit)")
            results[name] = full_rebuild(frame.drop(_DELETED), root / name, app_id=app_id, position=high)
    finally:
        folded.unpersist()
    return ProjectionRun(projection.name, app_id, "rebuild", 1, high, results, counter.value)


def _merge_fold(
    projection: Projection,
    events: DataFrame,
    root: Path,
    app_id: str,
    low: int,
    high: int,
    registry: TypeRegistry | None,
    group_by: str,
    say: Progress,
) -> ProjectionRun:
    spark = events.sparkSession
    registry = _bound(projection, registry)
    say(f"folding the new events per {group_by} onto the affected rows")
    # The new events are read from the stream once, here. Cached, their size is known, so
    # Spark broadcasts their groups to the scans of the stored rows rather than shuffling
    # the tables, however large.
    handled = events.where(F.col("type").isin(sorted(projection.handled_types))).persist(StorageLevel.MEMORY_AND_DISK)
    folded: DataFrame | None = None
    try:
        if handled.count() == 0:
            return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
        affected = handled.select(F.col(group_by).cast("string").alias(GROUP_COLUMN)).distinct()
        versions = {table.name: table_version(spark, root / table.name) for table in projection.tables}
        state = [
            _stored(spark, root / table.name, versions[table.name]).join(affected, GROUP_COLUMN, "left_semi")
            for table in projection.tables
        ]
        counter = spark.sparkContext.accumulator(0)
        folded = _fold(projection, handled, registry, group_by, state, counter).persist(StorageLevel.MEMORY_AND_DISK)
        # Computed in full once, before the first table changes; should Spark recompute a
        # lost partition later, the pinned table versions above give it the same start state.
        if _check_fold(projection, folded, group_by) == 0:
            return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
        tables = _split(projection, folded)
        results = {}
        for table in projection.tables:
            say(f"merging into table {table.name} (one Delta commit)")
            results[table.name] = _merge_fold_table(
                projection, table, tables[table.name], root, app_id, high, versions[table.name], group_by
            )
    finally:
        if folded is not None:
            folded.unpersist()
        handled.unpersist()
    return ProjectionRun(projection.name, app_id, "merge", low + 1, high, results, counter.value)


def _check_fold(projection: Projection, folded: DataFrame, group_by: str) -> int:
    """The number of rows the fold emitted, in one Spark job that also checks that no two groups emitted one row.

    Within a group the store holds one row per key, so a key emitted twice (alive or
    deleted) was written by two groups: :class:`FoldConstraintError`. A :func:`rebuild`
    would refuse the same history, unless one group deleted the row before the other
    wrote it; a merge refuses that too, as it cannot tell who owns the row.
    """
    keys = {i: [_value_column(i, k) for k in table.key] for i, table in enumerate(projection.tables)}
    every_key = [F.col(c) for columns in keys.values() for c in columns]
    per_key = folded.groupBy(F.col(_TABLE), *every_key).agg(
        F.count(F.lit(1)).alias("rows"), F.array_sort(F.collect_set(GROUP_COLUMN)).alias("groups")
    )
    clash = F.when(F.col("rows") > 1, F.struct(F.col(_TABLE), F.col("groups"), *every_key))
    summary = per_key.agg(F.sum("rows").alias("rows"), F.slice(F.collect_list(clash), 1, 3).alias("clashes")).first()
    assert summary is not None
    if summary["clashes"]:
        index = summary["clashes"][0][_TABLE]
        examples = [
            (row[keys[index][0]] if len(keys[index]) == 1 else tuple(row[c] for c in keys[index]), list(row["groups"]))
            for row in summary["clashes"]
            if row[_TABLE] == index
        ]
        raise FoldConstraintError(projection.name, projection.tables[index].name, group_by, examples)
    return int(summary["rows"] or 0)


def _merge_fold_table(
    projection: Projection,
    table: Table,
    rows: DataFrame,
    root: Path,
    app_id: str,
    high: int,
    version: int,
    group_by: str,
) -> WriteResult:
    """MERGE a table's folded rows; a stored row of a group that did not take part, written again by one that did,
    fails the MERGE (no commit) and becomes a :class:`FoldConstraintError`, as it would fail a rebuild."""
    path = root / table.name
    try:
        return incremental_merge(
            rows, path, keys=table.key, app_id=app_id, position=high, deleted_col=_DELETED,
            combine={GROUP_COLUMN: _same_group}, checked=True,
        )
    except Exception as exc:  # the JVM's error, as py4j or PySpark hands it over
        if _CLASH not in str(exc):
            raise
        stored = _stored(rows.sparkSession, path, version)
        raise FoldConstraintError(projection.name, table.name, group_by, _group_changes(table, rows, stored)) from None


def _same_group(stored: Column, new: Column) -> Column:
    return F.when(stored.isNull() | stored.eqNullSafe(new), new).otherwise(F.raise_error(F.lit(_CLASH)))


def _group_changes(table: Table, rows: DataFrame, stored: DataFrame) -> list[tuple[Any, list[str]]]:
    """Some keys of ``rows`` stored under another group, with both groups."""
    alive = rows.where(~F.coalesce(F.col(_DELETED), F.lit(False)))
    same_key = reduce(lambda a, b: a & b, [F.col(f"n.`{k}`").eqNullSafe(F.col(f"o.`{k}`")) for k in table.key])
    found = (
        alive.alias("n").join(stored.alias("o"), same_key)
        .where(~F.col(f"n.{GROUP_COLUMN}").eqNullSafe(F.col(f"o.{GROUP_COLUMN}")))
        .select(*[F.col(f"n.`{k}`") for k in table.key], F.col(f"n.{GROUP_COLUMN}"), F.col(f"o.{GROUP_COLUMN}"))
        .limit(3)
        .collect()
    )
    width = len(table.key)
    return [(row[0] if width == 1 else tuple(row[:width]), sorted([row[width], row[width + 1]])) for row in found]


def _merge_dataframe(
    projection: DataFrameProjection, events: DataFrame, root: Path, app_id: str, low: int, high: int, say: Progress
) -> ProjectionRun:
    path = root / projection.name
    say(f"building {projection.name}'s rows from the new events and merging them (one Delta commit)")
    partial_rows = projection.build(events).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        # Computed in full once; the MERGE then combines them with the stored rows it matches.
        if check_one_row_per_key(partial_rows, projection.keys) == 0:
            return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
        combine = projection.combine or {}
        how = {c: partial(_combine, combine.get(c, "last")) for c in partial_rows.columns if c not in projection.keys}
        result = incremental_merge(
            partial_rows, path, keys=projection.keys, app_id=app_id, position=high, combine=how, checked=True
        )
    finally:
        partial_rows.unpersist()
    return ProjectionRun(projection.name, app_id, "merge", low + 1, high, {projection.name: result})


def _stored(spark: SparkSession, path: Path, version: int) -> DataFrame:
    """The table's rows at ``version``, pinned: a recomputation never sees our own later commits."""
    return spark.read.format("delta").option("versionAsOf", version).load(str(path))


def _combine(how: Combine, stored: Column, new: Column) -> Column:
    if callable(how):
        return how(stored, new)
    if how == "sum":
        return F.when(stored.isNull(), new).when(new.isNull(), stored).otherwise(stored + new)
    if how == "min":
        return F.least(stored, new)
    if how == "max":
        return F.greatest(stored, new)
    if how == "last":
        return F.coalesce(new, stored)
    if how == "first":
        return F.coalesce(stored, new)
    raise ValueError(f"Unknown combine {how!r}: use 'sum', 'min', 'max', 'last', 'first' or a function.")


# -- folding the daemon's projections ---------------------------------------------------------------


def fold_tables(
    projection: Projection,
    events: DataFrame,
    *,
    registry: TypeRegistry | None = None,
    group_by: str = "stream_id",
) -> dict[str, DataFrame]:
    """The read-model tables ``projection``'s handlers build from ``events`` (table name -> rows).

    Each DataFrame has :func:`table_schema`'s columns. Lazy: nothing runs until
    an action; use :func:`rebuild` to write them with their position.
    """
    folded = _fold(projection, events, registry, group_by, state=None)
    return {name: frame.drop(_DELETED) for name, frame in _split(projection, folded).items()}


def _bound(projection: Projection, registry: TypeRegistry | None) -> TypeRegistry:
    registry = registry if registry is not None else TypeRegistry()
    projection.bind(registry)
    return registry


def _value_column(index: int, column: str) -> str:
    return f"_jetsourcing_t{index}_{column}"


def _fold_schema(projection: Projection) -> StructType:
    """Rows a fold emits (and reads back as its start state): group, table, tombstone, every table's columns."""
    fields = [
        StructField(GROUP_COLUMN, StringType()),
        StructField(_TABLE, IntegerType()),
        StructField(_DELETED, BooleanType()),
    ]
    for i, table in enumerate(projection.tables):
        fields += [StructField(_value_column(i, c.name), _PYTHON_TO_SPARK[c.type]) for c in table.columns]
    return StructType(fields)


_EVENT_COLUMNS = ("position", "index", "stream_id", "version", "type", "schema_version", "event_id",
                  "correlation_id", "causation_id", "recorded_at", "payload")


def _fold(
    projection: Projection,
    events: DataFrame,
    registry: TypeRegistry | None,
    group_by: str,
    state: Sequence[DataFrame] | None,
    counter: Accumulator[int] | None = None,
) -> DataFrame:
    """Fold the handled events group by group; ``state`` holds each table's stored rows of the affected groups;
    ``counter`` counts the events folded."""
    registry = _bound(projection, registry)
    spark = events.sparkSession
    out_schema = _fold_schema(projection)
    event_types = {f.name: f.dataType for f in EVENTS_SCHEMA.fields}
    handled = events.where(F.col("type").isin(sorted(projection.handled_types)))
    # One input stream per task: state rows (kind 0) then events (kind 1), per group.
    inputs = handled.select(
        F.col(group_by).cast("string").alias(GROUP_COLUMN),
        F.lit(1).alias(_KIND),
        *[F.col(c) for c in _EVENT_COLUMNS],
        *[F.lit(None).cast(f.dataType).alias(f.name) for f in out_schema.fields[1:]],
    )
    for i, (table, rows) in enumerate(zip(projection.tables, state or ())):
        values = {_value_column(i, c.name): F.col(c.name) for c in table.columns}
        inputs = inputs.unionByName(
            rows.select(
                F.col(GROUP_COLUMN),
                F.lit(0).alias(_KIND),
                *[F.lit(None).cast(event_types[c]).alias(c) for c in _EVENT_COLUMNS],
                F.lit(i).alias(_TABLE),
                F.lit(False).alias(_DELETED),
                *[
                    values.get(f.name, F.lit(None)).cast(f.dataType).alias(f.name)
                    for f in out_schema.fields[3:]
                ],
            )
        )
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or "2")
    ordered = inputs.repartition(partitions, GROUP_COLUMN).sortWithinPartitions(
        GROUP_COLUMN, _KIND, "position", "index"
    )
    folder = _GroupFolder(projection, registry, incremental=state is not None, counter=counter)
    return ordered.mapInArrow(folder, out_schema)


def _split(projection: Projection, folded: DataFrame) -> dict[str, DataFrame]:
    """Each table's rows (declared columns, the group, the tombstone) from the folded rows."""
    out = {}
    for i, table in enumerate(projection.tables):
        out[table.name] = folded.where(F.col(_TABLE) == i).select(
            *[F.col(_value_column(i, c.name)).alias(c.name) for c in table.columns],
            F.col(GROUP_COLUMN),
            F.col(_DELETED),
        )
    return out


def _check_one_writer(projection: Projection, tables: Mapping[str, DataFrame], group_by: str) -> None:
    for table in projection.tables:
        keys = [F.col(f"`{k}`") for k in table.key]
        clashes = (
            tables[table.name]
            .groupBy(*keys)
            .agg(F.count(F.lit(1)).alias("rows"), F.collect_set(GROUP_COLUMN).alias("groups"))
            .where(F.col("rows") > 1)
            .limit(3)
            .collect()
        )
        if clashes:
            examples = [
                (row[0] if len(table.key) == 1 else tuple(row[: len(table.key)]), sorted(row["groups"]))
                for row in clashes
            ]
            raise FoldConstraintError(projection.name, table.name, group_by, examples)


class _GroupFolder:
    """The ``mapInArrow`` function: folds each group of a sorted partition into a MemoryStore.

    Picklable (shipped to the executors with the projection and registry).
    Input rows are sorted by (group, kind, position, index), so a group's stored
    rows come before its events, and its events in stream order.
    """

    def __init__(
        self, projection: Projection, registry: TypeRegistry, *, incremental: bool, counter: Accumulator[int] | None
    ) -> None:
        self.projection = projection
        self.registry = registry
        self.incremental = incremental
        self.counter = counter

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        projection, registry = self.projection, self.registry
        projection.bind(registry)
        tables = projection.tables
        names = [t.name for t in tables]
        columns = [[_value_column(i, c.name) for c in t.columns] for i, t in enumerate(tables)]
        emitter = _Emitter(projection)
        streams: dict[str, StreamId] = {}
        group: str | None = None
        store = MemoryStore.for_projection(projection)
        events: list[RecordedEvent] = []
        for batch in batches:
            data = batch.to_pydict()
            groups, kinds = data[GROUP_COLUMN], data[_KIND]
            if self.counter is not None:
                self.counter.add(sum(kinds))  # kind 1: an event
            for r in range(batch.num_rows):
                if groups[r] != group:
                    if group is not None:
                        self._finish(group, store, events, emitter)
                    group = groups[r]
                    store = MemoryStore.for_projection(projection)
                    events = []
                if kinds[r] == 0:
                    t = data[_TABLE][r]
                    row = {c.name: data[name][r] for c, name in zip(tables[t].columns, columns[t])}
                    store.data[names[t]][tables[t].key_of(row)] = row
                    continue
                text = data["stream_id"][r]
                stream_id = streams.get(text)
                if stream_id is None:
                    stream_id = streams[text] = StreamId.parse(text)
                recorded_at: datetime = data["recorded_at"][r]
                events.append(
                    RecordedEvent(
                        data["position"][r], data["index"][r], stream_id, data["version"][r], data["type"][r],
                        data["schema_version"][r], data["event_id"][r], data["payload"][r].encode(),
                        _recorded_at_text(recorded_at), data["correlation_id"][r], data["causation_id"][r],
                        registry,
                    )
                )
            yield from emitter.flush(_OUTPUT_ROWS)
        if group is not None:
            self._finish(group, store, events, emitter)
        yield from emitter.flush(0)

    def _finish(self, group: str, store: MemoryStore, events: list[RecordedEvent], emitter: _Emitter) -> None:
        initial = {name: dict(rows) for name, rows in store.data.items()} if self.incremental else None
        fold(self.projection, events, store)
        for name, rows in store.data.items():
            for row in rows.values():
                emitter.add(name, group, row, deleted=False)
            if initial is not None:
                for key, row in initial[name].items():
                    if key not in rows:
                        emitter.add(name, group, row, deleted=True)


def _recorded_at_text(value: datetime | None) -> str:
    if value is None:
        return ""
    if value.tzinfo is None:  # Arrow hands over UTC timestamps as naive or aware depending on the path
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).isoformat(timespec="microseconds")


class _Emitter:
    """Collects output rows per table and turns them into Arrow batches of the fold schema."""

    def __init__(self, projection: Projection) -> None:
        self.schema = _fold_schema(projection)
        self.arrow_schema = _arrow_schema(self.schema)
        self.tables = {t.name: (i, t) for i, t in enumerate(projection.tables)}
        self.rows: dict[str, list[tuple[str, bool, dict[str, Any]]]] = {t.name: [] for t in projection.tables}
        self.count = 0

    def add(self, table: str, group: str, row: dict[str, Any], *, deleted: bool) -> None:
        self.rows[table].append((group, deleted, row))
        self.count += 1

    def flush(self, at_least: int) -> Iterator[pa.RecordBatch]:
        if self.count == 0 or self.count < at_least:
            return
        for name, rows in self.rows.items():
            if not rows:
                continue
            index, table = self.tables[name]
            size = len(rows)
            arrays: dict[str, pa.Array] = {
                GROUP_COLUMN: pa.array([r[0] for r in rows], pa.string()),
                _TABLE: pa.array([index] * size, pa.int32()),
                _DELETED: pa.array([r[1] for r in rows], pa.bool_()),
            }
            for column in table.columns:
                name_out = _value_column(index, column.name)
                arrays[name_out] = pa.array(
                    [r[2].get(column.name) for r in rows], self.arrow_schema.field(name_out).type
                )
            yield pa.RecordBatch.from_arrays(
                [arrays[f.name] if f.name in arrays else pa.nulls(size, f.type) for f in self.arrow_schema],
                schema=self.arrow_schema,
            )
            rows.clear()
        self.count = 0


def _arrow_schema(schema: StructType) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


# -- helpers -----------------------------------------------------------------------------------------

T = TypeVar("T")


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion, also when called from code running inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def last_position(settings: EventStoreSettings) -> int:
    """The stream's last position, from synchronous code (a CLI checks the server with it before starting Spark)."""
    return _run_sync(stream_bounds(settings))[1]
