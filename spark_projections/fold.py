"""Folding the daemon's projections in Spark: the same handlers, entity group by entity group, with its error policy.

Events are grouped per entity (``stream_id``, or another group column), sorted
by ``(position, index)`` and applied group by group to an in-memory
:class:`projections.MemoryStore` inside ``mapInArrow`` tasks; the stores' rows
are the read-model tables. **Constraint:** a group is folded without seeing
other groups, so a handler may only read and write rows that belong to its
event's group (keys derived from ``event.stream_id`` or the event itself). Two
groups writing the same row fail the run with :class:`FoldConstraintError`; a
handler that *reads* another group's row silently sees nothing, so keep
handlers entity-local.

**Handler errors** follow the daemon's :class:`projections.ErrorPolicy`. A
group is folded in one transaction; when a handler raises, the group is folded
again commit by commit so that a failing commit leaves no rows behind (a
commit is applied whole or not at all), and the failure becomes a row of its
own (:data:`FAILURE_SCHEMA`: position, index, entity, type, event id, error and
traceback). Under ``stop`` the group's later commits are not folded and the
run reports the earliest failure as :class:`HandlerFailedError` before writing
anything; under ``dead_letter`` the group goes on and the failures are written
to the projection's dead-letter table.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import groupby
from typing import Any

import pyarrow as pa
from pyspark import Accumulator
from pyspark.sql import DataFrame, Row
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

from eventstore import RecordedEvent, StreamId, TypeRegistry
from projections import ErrorPolicy, MemoryStore, Projection, Table, fold
from spark_projections.errors import SparkProjectionError
from spark_projections.source import EVENTS_SCHEMA

__all__ = [
    "DEAD_LETTERS_TABLE",
    "DELETED",
    "FAILURE_SCHEMA",
    "FoldConstraintError",
    "FoldSummary",
    "GROUP_COLUMN",
    "HandlerFailedError",
    "TABLE",
    "bound_registry",
    "fold_events",
    "fold_summary",
    "fold_tables",
    "handler_failures",
    "split_tables",
    "table_schema",
    "value_column",
]

GROUP_COLUMN = "_jetsourcing_group"
"""Column of fold projections' Delta tables: the group (entity) whose events produced the row."""

DEAD_LETTERS_TABLE = "_dead_letters"
"""The Delta table (under a projection's root) of the commits its handlers failed on, under ``dead_letter``."""

FAILURE_SCHEMA = StructType([
    StructField("position", LongType()),
    StructField("index", IntegerType()),
    StructField("stream_id", StringType()),
    StructField("event_type", StringType()),
    StructField("event_id", StringType()),
    StructField("error", StringType()),
    StructField("traceback", StringType()),
    StructField("recorded_at", StringType()),
    StructField("dead_at", DoubleType()),
])
"""A handler failure: the event, the error, its traceback and when it was recorded (Unix time)."""

KIND = "_jetsourcing_kind"  # 0: a stored row (fold start state), 1: an event
TABLE = "_jetsourcing_table"  # which of the projection's tables a state/output row belongs to (-1: a failure)
DELETED = "_jetsourcing_deleted"  # output tombstone: the row existed at the start and was deleted
_FAILED = -1
_OUTPUT_ROWS = 5000  # rows per Arrow batch a fold task emits

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


class HandlerFailedError(SparkProjectionError):
    """A handler raised under the ``stop`` policy; nothing was written. Names the earliest failing event.

    ``position``, ``index``, ``event_type``, ``stream_id``, ``event_id``, ``error`` and
    ``traceback`` describe it; ``failures`` is how many commits failed in the run.
    """

    def __init__(self, projection: str, failure: Mapping[str, Any], failures: int) -> None:
        self.projection = projection
        self.position = int(failure["position"])
        self.index = int(failure["index"])
        self.event_type = str(failure["event_type"])
        self.stream_id = str(failure["stream_id"])
        self.event_id = str(failure["event_id"])
        self.error = str(failure["error"])
        self.traceback = str(failure["traceback"])
        self.failures = failures
        more = f" ({failures - 1} more commits failed too)" if failures > 1 else ""
        super().__init__(
            f"{projection}: the handler of {self.event_type} at position {self.position} (event {self.index} of the "
            f"commit, entity {self.stream_id}, event id {self.event_id}) raised {self.error}{more}. Nothing was "
            "written. Fix the handler and run again, or run with error_policy='dead_letter' to record failing commits "
            f"in the {DEAD_LETTERS_TABLE} table and go on.\n\nThe handler's traceback:\n{self.traceback}"
        )


def table_schema(table: Table) -> StructType:
    """The Spark schema of a fold projection's Delta table: declared columns, then :data:`GROUP_COLUMN`."""
    fields = [StructField(c.name, _PYTHON_TO_SPARK[c.type], nullable=True) for c in table.columns]
    return StructType([*fields, StructField(GROUP_COLUMN, StringType(), nullable=True)])


def fold_tables(
    projection: Projection,
    events: DataFrame,
    *,
    registry: TypeRegistry | None = None,
    group_by: str = "stream_id",
) -> dict[str, DataFrame]:
    """The read-model tables ``projection``'s handlers build from ``events`` (table name -> rows).

    Each DataFrame has :func:`table_schema`'s columns. Lazy: nothing runs until
    an action; use :func:`~spark_projections.projection.rebuild` to write them with
    their position. A handler error fails the action (the ``stop`` policy, raised in
    the task).
    """
    folded = fold_events(projection, events, registry, group_by, state=None, policy=None)
    return {name: frame.drop(DELETED) for name, frame in split_tables(projection, folded).items()}


def bound_registry(projection: Projection, registry: TypeRegistry | None) -> TypeRegistry:
    """``registry`` (or a new one) with ``projection``'s event types registered in it."""
    registry = registry if registry is not None else TypeRegistry()
    projection.bind(registry)
    return registry


def value_column(index: int, column: str) -> str:
    """The column of the fold's output that holds ``column`` of the projection's table number ``index``."""
    return f"_jetsourcing_t{index}_{column}"


def _failure_column(column: str) -> str:
    return f"_jetsourcing_failed_{column}"


def _fold_schema(projection: Projection) -> StructType:
    """Rows a fold emits (and reads back as its start state): group, table, tombstone, every table's columns,
    then a failure's columns."""
    fields = [
        StructField(GROUP_COLUMN, StringType()),
        StructField(TABLE, IntegerType()),
        StructField(DELETED, BooleanType()),
    ]
    for i, table in enumerate(projection.tables):
        fields += [StructField(value_column(i, c.name), _PYTHON_TO_SPARK[c.type]) for c in table.columns]
    fields += [StructField(_failure_column(f.name), f.dataType) for f in FAILURE_SCHEMA.fields]
    return StructType(fields)


_EVENT_COLUMNS = ("position", "index", "stream_id", "version", "type", "schema_version", "event_id",
                  "correlation_id", "causation_id", "recorded_at", "payload")


def fold_events(
    projection: Projection,
    events: DataFrame,
    registry: TypeRegistry | None,
    group_by: str,
    state: Sequence[DataFrame] | None,
    counter: Accumulator[int] | None = None,
    *,
    policy: ErrorPolicy | None,
) -> DataFrame:
    """Fold the handled events group by group; ``state`` holds each table's stored rows of the affected groups;
    ``counter`` counts the events folded; ``policy`` None raises a handler's error in its task, otherwise
    failures become rows (see :func:`handler_failures`)."""
    registry = bound_registry(projection, registry)
    spark = events.sparkSession
    out_schema = _fold_schema(projection)
    event_types = {f.name: f.dataType for f in EVENTS_SCHEMA.fields}
    handled = events.where(F.col("type").isin(sorted(projection.handled_types)))
    # One input stream per task: state rows (kind 0) then events (kind 1), per group.
    inputs = handled.select(
        F.col(group_by).cast("string").alias(GROUP_COLUMN),
        F.lit(1).alias(KIND),
        *[F.col(c) for c in _EVENT_COLUMNS],
        *[F.lit(None).cast(f.dataType).alias(f.name) for f in out_schema.fields[1:]],
    )
    for i, (table, rows) in enumerate(zip(projection.tables, state or ())):
        values = {value_column(i, c.name): F.col(c.name) for c in table.columns}
        inputs = inputs.unionByName(
            rows.select(
                F.col(GROUP_COLUMN),
                F.lit(0).alias(KIND),
                *[F.lit(None).cast(event_types[c]).alias(c) for c in _EVENT_COLUMNS],
                F.lit(i).alias(TABLE),
                F.lit(False).alias(DELETED),
                *[
                    values.get(f.name, F.lit(None)).cast(f.dataType).alias(f.name)
                    for f in out_schema.fields[3:]
                ],
            )
        )
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or "2")
    ordered = inputs.repartition(partitions, GROUP_COLUMN).sortWithinPartitions(
        GROUP_COLUMN, KIND, "position", "index"
    )
    folder = _GroupFolder(projection, registry, incremental=state is not None, counter=counter, policy=policy)
    return ordered.mapInArrow(folder, out_schema)


def split_tables(projection: Projection, folded: DataFrame) -> dict[str, DataFrame]:
    """Each table's rows (declared columns, the group, the tombstone) from the folded rows."""
    out = {}
    for i, table in enumerate(projection.tables):
        out[table.name] = folded.where(F.col(TABLE) == i).select(
            *[F.col(value_column(i, c.name)).alias(c.name) for c in table.columns],
            F.col(GROUP_COLUMN),
            F.col(DELETED),
        )
    return out


def handler_failures(folded: DataFrame) -> DataFrame:
    """The handler failures of a fold (rows of :data:`FAILURE_SCHEMA`)."""
    return folded.where(F.col(TABLE) == _FAILED).select(
        *[F.col(_failure_column(f.name)).alias(f.name) for f in FAILURE_SCHEMA.fields]
    )


@dataclass(frozen=True)
class FoldSummary:
    """What a fold's output is checked for before any table changes (:func:`fold_summary`)."""

    failures: int
    """How many handler failures it holds."""
    earliest: Row | None
    """The earliest of them (a row of :data:`FAILURE_SCHEMA`), None without failures."""
    clashes: list[Row]
    """Up to three keys emitted by several groups, of the first table that has any: each with the table's index
    (``TABLE``), the key's value columns (:func:`value_column`) and the sorted ``groups``."""


def fold_summary(projection: Projection, folded: DataFrame) -> FoldSummary:
    """The handler failures and the keys emitted by several groups of a fold's output, from one query."""
    keys = [F.col(value_column(i, k)) for i, table in enumerate(projection.tables) for k in table.key]
    # A failure's key columns are null: the failures make one group of their own, table -1, which the ordering
    # puts first; the ordered take is one job over the groups, without another shuffle.
    found = (
        folded.groupBy(F.col(TABLE), *keys)
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.array_sort(F.collect_set(GROUP_COLUMN)).alias("groups"),
            F.min_by(F.struct(*[F.col(_failure_column(f.name)).alias(f.name) for f in FAILURE_SCHEMA.fields]),
                     F.struct(_failure_column("position"), _failure_column("index"))).alias("earliest"),
        )
        .where((F.col(TABLE) == _FAILED) | (F.col("rows") > 1))
        .orderBy(TABLE)
        .limit(4)
        .collect()
    )
    failed = [row for row in found if row[TABLE] == _FAILED]
    clashes = [row for row in found if row[TABLE] != _FAILED][:3]
    return FoldSummary(
        failures=failed[0]["rows"] if failed else 0,
        earliest=failed[0]["earliest"] if failed else None,
        clashes=[row for row in clashes if row[TABLE] == clashes[0][TABLE]],
    )


class _GroupFolder:
    """The ``mapInArrow`` function: folds each group of a sorted partition into a MemoryStore.

    Picklable (shipped to the executors with the projection and registry).
    Input rows are sorted by (group, kind, position, index), so a group's stored
    rows come before its events, and its events in stream order.
    """

    def __init__(
        self,
        projection: Projection,
        registry: TypeRegistry,
        *,
        incremental: bool,
        counter: Accumulator[int] | None,
        policy: ErrorPolicy | None,
    ) -> None:
        self.projection = projection
        self.registry = registry
        self.incremental = incremental
        self.counter = counter
        self.policy = policy

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        projection, registry = self.projection, self.registry
        projection.bind(registry)
        tables = projection.tables
        names = [t.name for t in tables]
        columns = [[value_column(i, c.name) for c in t.columns] for i, t in enumerate(tables)]
        emitter = _Emitter(projection)
        streams: dict[str, StreamId] = {}
        group: str | None = None
        store = MemoryStore.for_projection(projection)
        events: list[RecordedEvent] = []
        for batch in batches:
            data = batch.to_pydict()
            groups, kinds = data[GROUP_COLUMN], data[KIND]
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
                    t = data[TABLE][r]
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
        try:
            fold(self.projection, events, store)  # one transaction: rolled back whole when a handler raises
        except Exception:
            if self.policy is None:
                raise
            self._fold_commit_by_commit(group, store, events, emitter)
        for name, rows in store.data.items():
            for row in rows.values():
                emitter.add(name, group, row, deleted=False)
            if initial is not None:
                for key, row in initial[name].items():
                    if key not in rows:
                        emitter.add(name, group, row, deleted=True)

    def _fold_commit_by_commit(
        self, group: str, store: MemoryStore, events: list[RecordedEvent], emitter: _Emitter
    ) -> None:
        apply = self.projection.apply
        for _, commit in groupby(events, key=lambda e: e.position):
            tx = store.transaction()
            event = None
            try:
                for event in commit:
                    apply(event, tx)
            except Exception as exc:  # noqa: BLE001 - every handler failure is reported, never swallowed
                tx.rollback()
                assert event is not None
                emitter.fail(group, event, exc)
                if self.policy is ErrorPolicy.STOP:
                    return  # the run fails: the group's later commits do not matter
                continue
            tx.commit()


def _recorded_at_text(value: datetime | None) -> str:
    if value is None:
        return ""
    if value.tzinfo is None:  # Arrow hands over UTC timestamps as naive or aware depending on the path
        value = value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc).isoformat(timespec="microseconds")


class _Emitter:
    """Collects output rows per table (and failures) and turns them into Arrow batches of the fold schema."""

    def __init__(self, projection: Projection) -> None:
        self.schema = _fold_schema(projection)
        self.arrow_schema = _arrow_schema(self.schema)
        self.tables = {t.name: (i, t) for i, t in enumerate(projection.tables)}
        self.rows: dict[str, list[tuple[str, bool, dict[str, Any]]]] = {t.name: [] for t in projection.tables}
        self.failures: list[tuple[str, dict[str, Any]]] = []
        self.count = 0

    def add(self, table: str, group: str, row: dict[str, Any], *, deleted: bool) -> None:
        self.rows[table].append((group, deleted, row))
        self.count += 1

    def fail(self, group: str, event: RecordedEvent, exc: BaseException) -> None:
        self.failures.append((group, {
            "position": event.position,
            "index": event.index,
            "stream_id": str(event.stream_id),
            "event_type": event.type,
            "event_id": event.event_id,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc)),
            "recorded_at": event.recorded_at_text,
            "dead_at": time.time(),
        }))
        self.count += 1

    def flush(self, at_least: int) -> Iterator[pa.RecordBatch]:
        if self.count == 0 or self.count < at_least:
            return
        for name, rows in self.rows.items():
            if not rows:
                continue
            index, table = self.tables[name]
            values = {value_column(index, c.name): [r[2].get(c.name) for r in rows] for c in table.columns}
            yield self._batch([r[0] for r in rows], index, [r[1] for r in rows], values)
            rows.clear()
        if self.failures:
            values = {_failure_column(f.name): [r[1][f.name] for r in self.failures] for f in FAILURE_SCHEMA.fields}
            yield self._batch([r[0] for r in self.failures], _FAILED, [False] * len(self.failures), values)
            self.failures.clear()
        self.count = 0

    def _batch(self, groups: list[str], table: int, deleted: list[bool], values: dict[str, list[Any]]) -> pa.RecordBatch:
        size = len(groups)
        arrays: dict[str, pa.Array] = {
            GROUP_COLUMN: pa.array(groups, pa.string()),
            TABLE: pa.array([table] * size, pa.int32()),
            DELETED: pa.array(deleted, pa.bool_()),
        }
        for name, column in values.items():
            arrays[name] = pa.array(column, self.arrow_schema.field(name).type)
        return pa.RecordBatch.from_arrays(
            [arrays[f.name] if f.name in arrays else pa.nulls(size, f.type) for f in self.arrow_schema],
            schema=self.arrow_schema,
        )


def _arrow_schema(schema: StructType) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")
