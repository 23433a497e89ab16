"""Run projections in Spark and materialise them into Delta tables, in full or incrementally.

Two kinds of projection run here:

* **The daemon's own definitions** (:class:`projections.Projection`): the same
  handlers that keep the SQLite read model up to date fold the events in
  Spark, entity group by entity group (:mod:`spark_projections.fold`: how,
  the one constraint on handlers, and the error policy);
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
``spark.sparkContext.addPyFile``). Handler errors follow the daemon's error
policy (see :mod:`spark_projections.fold`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from functools import partial, reduce
from pathlib import Path
from typing import Any, Literal, TypeVar

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from eventstore import EventStoreSettings, TypeRegistry
from projections import ErrorPolicy, Projection, Table
from spark_projections.delta import (
    WriteResult,
    check_one_row_per_key,
    full_rebuild,
    incremental_merge,
    recorded_position,
    table_version,
)
from spark_projections.errors import SparkProjectionError
from spark_projections.fold import (
    DEAD_LETTERS_TABLE,
    DELETED,
    GROUP_COLUMN,
    TABLE,
    FoldConstraintError,
    FoldSummary,
    HandlerFailedError,
    bound_registry,
    fold_events,
    fold_summary,
    fold_tables,
    handler_failures,
    split_tables,
    table_schema,
    value_column,
)
from spark_projections.executors import reports_missing_modules, separate_executors
from spark_projections.ship import ship_code
from spark_projections.source import read_events, stream_bounds

__all__ = [
    "GROUP_COLUMN",
    "Combine",
    "DataFrameProjection",
    "FoldConstraintError",
    "Progress",
    "ProjectionRun",
    "app_id_of",
    "common_position",
    "error_policy_of",
    "fold_tables",
    "merge_events",
    "rebuild",
    "table_root",
    "table_schema",
    "update",
]

_CLASH = "jetsourcing: a row changes group"  # raised inside a MERGE, turned into a FoldConstraintError
_BROADCAST_POSITIONS = 1_000_000  # an update of at most this many positions broadcasts its groups

Combine = Literal["sum", "min", "max", "last", "first"] | Callable[[Column, Column], Column]
"""How :func:`update` merges a column of a DataFrame projection's partial result into the stored row.

``"sum"`` adds them; ``"min"`` / ``"max"`` keep the extreme; ``"last"`` takes the new value
unless it is null; ``"first"`` keeps the stored value unless it is null; a callable gets
``(stored, new)`` columns (stored is null for a new key) and returns the merged column.
"""



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


# -- running ---------------------------------------------------------------------------------------


@reports_missing_modules
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
    error_policy: ErrorPolicy | str | None = None,
    progress: Progress | None = None,
) -> ProjectionRun:
    """Compute every table of ``projection`` from the whole history and replace it, one commit per table.

    Reads positions 1..``to_position`` (default: the stream's last position now)
    and records that position. ``registry`` decodes ``event.data`` for fold
    projections (default: a new one the projection registers its events in).
    ``partitions`` is the number of parallel stream reads (default: Spark's
    default parallelism). A table already recorded at that position is left
    alone (``applied=False``), so re-running after a crash finishes the job;
    when every table is, nothing is computed (``noop``). ``error_policy`` (default:
    the projection's own) says what a handler error does, as in the daemon:
    ``stop`` raises :class:`HandlerFailedError` naming the earliest failing event
    and writes nothing; ``dead_letter`` leaves the failing commits out and records
    them in the ``_dead_letters`` table under ``root``. ``progress`` is told each
    stage as it starts (reading, folding or building, writing each table).
    """
    high = last_position(settings) if to_position is None else to_position
    policy = error_policy_of(projection, error_policy)
    ship_code(spark, user_code(projection, registry))
    return _rebuild(spark, projection, settings, table_root(root), registry, high, partitions, group_by, progress or _quiet,
                    policy)


@reports_missing_modules
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
    error_policy: ErrorPolicy | str | None = None,
    progress: Progress | None = None,
) -> ProjectionRun:
    """Bring the tables from their recorded position up to ``to_position`` (default: the last position).

    Reads only the newer events and merges the changed rows, one commit per
    table. Falls back to :func:`rebuild` when a table has no recorded position
    for this projection version, when the tables disagree (an interrupted run)
    or for a DataFrame projection without ``combine``. Nothing new: ``noop``.
    ``error_policy`` and ``progress`` work as for :func:`rebuild`.
    """
    root = table_root(root)
    say = progress or _quiet
    policy = error_policy_of(projection, error_policy)
    ship_code(spark, user_code(projection, registry))
    app_id = app_id_of(projection)
    high = last_position(settings) if to_position is None else to_position
    low = common_position(spark, projection, root)
    if low is None:
        say("no common recorded position in the tables: rebuilding")
        return _rebuild(spark, projection, settings, root, registry, high, partitions, group_by, say, policy)
    if high <= low:
        say(f"the tables are at position {low}: nothing new")
        return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
    if isinstance(projection, DataFrameProjection) and projection.combine is None:
        say("a DataFrame projection without combine: rebuilding")
        return _rebuild(spark, projection, settings, root, registry, high, partitions, group_by, say, policy)
    say(_reading(settings, projection, low + 1, high))
    events = read_events(spark, settings, categories=projection.categories, from_position=low + 1,
                         to_position=high, partitions=partitions, columns=_columns_of(projection))
    if isinstance(projection, DataFrameProjection):
        return _merge_dataframe(projection, events, root, app_id, low, high, say)
    return _merge_fold(projection, events, root, app_id, low, high, registry, group_by, say, policy)


def table_root(root: str | os.PathLike[str]) -> Path:
    """``root`` as an absolute path: Spark's JVM resolves a relative one against its own working directory, which
    need not be Python's."""
    return Path(root).absolute()


def common_position(spark: SparkSession, projection: AnyProjection, root: str | os.PathLike[str]) -> int | None:
    """The stream position every table of ``projection`` under ``root`` records for its version.

    None when a table records none (it is missing, or was written by another
    version) or the tables record different ones (an interrupted run).
    """
    app_id = app_id_of(projection)
    recorded = {recorded_position(spark, table_root(root) / name, app_id) for name in table_names(projection)}
    return recorded.pop() if len(recorded) == 1 else None


@reports_missing_modules
def merge_events(
    spark: SparkSession,
    projection: AnyProjection,
    events: DataFrame,
    root: str | os.PathLike[str],
    *,
    position: int,
    registry: TypeRegistry | None = None,
    group_by: str = "stream_id",
    error_policy: ErrorPolicy | str | None = None,
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
    ``columns`` at least); events at or before the recorded position are left out,
    so ``events`` may reach back further. ``error_policy`` works as for :func:`rebuild`.
    """
    root = table_root(root)
    say = progress or _quiet
    policy = error_policy_of(projection, error_policy)
    ship_code(spark, user_code(projection, registry))
    app_id = app_id_of(projection)
    recorded = {recorded_position(spark, root / name, app_id) for name in table_names(projection)}
    if recorded == {None}:
        return _rebuild_from(projection, events, root, app_id, position, registry, group_by, say, policy)
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
    new = events.where(F.col("position") > low)
    if isinstance(projection, DataFrameProjection):
        return _merge_dataframe(projection, new, root, app_id, low, position, say)
    return _merge_fold(projection, new, root, app_id, low, position, registry, group_by, say, policy)


Progress = Callable[[str], None]
"""Told each stage of a :func:`rebuild` or :func:`update` as it starts, in words."""


def user_code(projection: AnyProjection, registry: TypeRegistry | None) -> list[object]:
    """What the executors run of the user's: the projection, a DataFrame projection's functions, the event models
    (``registry``'s and those the projection's handlers name); :func:`~spark_projections.ship.ship_code` ships them."""
    objects: list[object] = [projection]
    models = TypeRegistry()
    if isinstance(projection, DataFrameProjection):
        objects += [projection.build, *(how for how in (projection.combine or {}).values() if callable(how))]
    else:
        projection.register_events(models)
    for known in (models, registry):
        if known is not None:
            objects += [model for model, _ in known.types().values()]
    return objects


def error_policy_of(projection: AnyProjection, given: ErrorPolicy | str | None) -> ErrorPolicy:
    """The error policy asked for, or else the projection's own (a DataFrame projection has no handlers)."""
    if given is not None:
        try:
            return ErrorPolicy(given)
        except ValueError:
            raise SparkProjectionError(
                f"Unknown error policy {given!r}: use {' or '.join(repr(p.value) for p in ErrorPolicy)}."
            ) from None
    return projection.error_policy if isinstance(projection, Projection) else ErrorPolicy.STOP


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
    policy: ErrorPolicy,
) -> ProjectionRun:
    app_id = app_id_of(projection)
    recorded = [recorded_position(spark, root / name, app_id) for name in table_names(projection)]
    if all(position is not None and position >= high for position in recorded):
        say(f"every table is recorded at position {high} or later: nothing to do")
        return ProjectionRun(projection.name, app_id, "noop", 1, min(p for p in recorded if p is not None))
    say(_reading(settings, projection, 1, high))
    events = read_events(spark, settings, categories=projection.categories, to_position=high, partitions=partitions,
                         columns=_columns_of(projection))
    return _rebuild_from(projection, events, root, app_id, high, registry, group_by, say, policy)


def _rebuild_from(
    projection: AnyProjection,
    events: DataFrame,
    root: Path,
    app_id: str,
    high: int,
    registry: TypeRegistry | None,
    group_by: str,
    say: Progress,
    policy: ErrorPolicy,
) -> ProjectionRun:
    """Replace each table with what ``events``, the whole history up to ``high``, make of it (one commit each)."""
    if isinstance(projection, DataFrameProjection):
        say(f"building table {projection.name} from the events and writing it (one Delta commit)")
        result = full_rebuild(projection.build(events), root / projection.name, app_id=app_id, position=high)
        return ProjectionRun(projection.name, app_id, "rebuild", 1, high, {projection.name: result})
    say(f"folding the events per {group_by} through the projection's handlers")
    counter = events.sparkSession.sparkContext.accumulator(0)
    folded = fold_events(projection, events, registry, group_by, None, counter, policy=policy)
    folded = folded.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        summary = fold_summary(projection, folded)
        _handle_failures(projection, folded, summary, root, app_id, high, policy, replace=True)
        _check_clashes(projection, summary, group_by)
        tables = split_tables(projection, folded)
        results = {}
        for name, frame in tables.items():
            say(f"writing table {name} (one Delta commit)")
            results[name] = full_rebuild(frame.drop(DELETED), root / name, app_id=app_id, position=high)
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
    policy: ErrorPolicy,
) -> ProjectionRun:
    spark = events.sparkSession
    registry = bound_registry(projection, registry)
    say(f"folding the new events per {group_by} onto the affected rows")
    # The new events are read from the stream once: their groups and the fold both use them.
    handled = events.where(F.col("type").isin(sorted(projection.handled_types))).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        affected = handled.select(F.col(group_by).cast("string").alias(GROUP_COLUMN)).distinct()
        if high - low <= _BROADCAST_POSITIONS:
            # Each position adds at most one group (a commit is one stream's): few enough to
            # broadcast to the scans of the stored rows, which keep only those groups' rows
            # without shuffling the tables.
            affected = F.broadcast(affected)
        versions = {table.name: table_version(spark, root / table.name) for table in projection.tables}
        state = [
            _stored(spark, root / table.name, versions[table.name]).join(affected, GROUP_COLUMN, "left_semi")
            for table in projection.tables
        ]
        counter = spark.sparkContext.accumulator(0)
        # Computed once, before the first table changes: the summary and each MERGE read these rows.
        folded = _kept(fold_events(projection, handled, registry, group_by, state, counter, policy=policy))
        summary = fold_summary(projection, folded)
        if not counter.value:  # the summary folded every new event: none was handled (a recount cannot make 0)
            return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
        _handle_failures(projection, folded, summary, root, app_id, high, policy, replace=False)
        _check_clashes(projection, summary, group_by)
        tables = split_tables(projection, folded)
        results = {}
        for table in projection.tables:
            say(f"merging into table {table.name} (one Delta commit)")
            results[table.name] = _merge_fold_table(
                projection, table, tables[table.name], root, app_id, high, versions[table.name], group_by
            )
    finally:
        handled.unpersist()
    return ProjectionRun(projection.name, app_id, "merge", low + 1, high, results, counter.value)


def _check_clashes(projection: Projection, summary: FoldSummary, group_by: str) -> None:
    """Make sure no two groups emitted one row, as ``summary`` (:func:`fold_summary`) lists them.

    Within a group the store holds one row per key, so a key emitted twice (alive or
    deleted) was written by two groups: :class:`FoldConstraintError`. A :func:`rebuild`
    emits no deleted rows; a merge also refuses a row one group deleted and another wrote,
    as it cannot tell who owns the row.
    """
    if not summary.clashes:
        return
    index = summary.clashes[0][TABLE]
    keys = [value_column(index, k) for k in projection.tables[index].key]
    examples = [
        (row[keys[0]] if len(keys) == 1 else tuple(row[c] for c in keys), list(row["groups"]))
        for row in summary.clashes
    ]
    raise FoldConstraintError(projection.name, projection.tables[index].name, group_by, examples)


def _handle_failures(
    projection: Projection,
    folded: DataFrame,
    summary: FoldSummary,
    root: Path,
    app_id: str,
    high: int,
    policy: ErrorPolicy,
    *,
    replace: bool,
) -> None:
    """Apply the error policy to the fold's handler failures, as ``summary`` (:func:`fold_summary`) counts them, before
    any table changes: under ``stop`` raise :class:`HandlerFailedError` for the earliest; under ``dead_letter`` write
    them to the dead-letter table, in place of its rows (``replace``, a rebuild) or added to them, recorded at
    ``high`` as every table is."""
    count, earliest = summary.failures, summary.earliest
    if earliest is not None and policy is ErrorPolicy.STOP:
        raise HandlerFailedError(projection.name, earliest.asDict(), count)
    failures = handler_failures(folded)
    path = root / DEAD_LETTERS_TABLE
    if replace and (count or table_version(folded.sparkSession, path) >= 0):
        full_rebuild(failures, path, app_id=app_id, position=high)
    elif count:
        incremental_merge(failures, path, keys=("position", "index"), app_id=app_id, position=high)


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
            rows, path, keys=table.key, app_id=app_id, position=high, deleted_col=DELETED,
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
    alive = rows.where(~F.coalesce(F.col(DELETED), F.lit(False)))
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
    partial_rows = _kept(projection.build(events))
    # Computed in full once, by the check; the MERGE then combines them with the stored rows it matches.
    if check_one_row_per_key(partial_rows, projection.keys) == 0:
        return ProjectionRun(projection.name, app_id, "noop", low + 1, low)
    combine = projection.combine or {}
    how = {c: partial(_combine, combine.get(c, "last")) for c in partial_rows.columns if c not in projection.keys}
    result = incremental_merge(
        partial_rows, path, keys=projection.keys, app_id=app_id, position=high, combine=how, checked=True
    )
    return ProjectionRun(projection.name, app_id, "merge", low + 1, high, {projection.name: result})


def _kept(rows: DataFrame) -> DataFrame:
    """``rows`` computed once, when first read, and cut from their lineage: every later reader sees the same rows.

    A local checkpoint, not a cache: Delta's MERGE copies a cached source again before it
    starts (a checkpoint it reads as it is, see ``incremental_merge``), and AQE plans a cached
    query anew for each reader; together 0.2-0.3 s of an update. Without a lineage a lost
    block cannot be recomputed, and a lost executor between two tables' MERGEs would leave
    them at different positions: on a cluster each block is kept on two executors. The
    blocks go with the DataFrame (Spark's ContextCleaner).
    """
    kept = StorageLevel.MEMORY_AND_DISK_2 if separate_executors(rows.sparkSession) else StorageLevel.MEMORY_AND_DISK
    return rows.localCheckpoint(eager=False, storageLevel=kept)


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
