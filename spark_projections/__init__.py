"""Spark batch projections of jetsourcing event streams into Delta Lake.

If you are here to read the code, start with ``source.py`` (the JetStream data
source), then ``projection.py`` (daemon projections and DataFrame projections
run in Spark), ``delta.py`` and ``session.py``. Modules, one job each:

* :mod:`spark_projections.source` - ``spark.read.format("jetstream")`` / ``read_events``:
  the stream's positions split into ranges read in parallel, one row per event;
* :mod:`spark_projections.stream` - ``spark.readStream.format("jetstream")``: micro-batches
  whose offsets are stream positions;
* :mod:`spark_projections.typed` - Spark schemas from pydantic models, typed frames per
  event type with upcasting;
* :mod:`spark_projections.projection` - ``rebuild`` / ``update`` / ``merge_events`` of a projection's
  Delta tables;
* :mod:`spark_projections.fold` - the daemon's projections folded per entity, with its error policy;
* :mod:`spark_projections.follow` - ``follow``: a streaming query that keeps the tables up to date;
* :mod:`spark_projections.session` - ``spark_session(settings)``: a Spark session with
  Delta Lake guaranteed usable (settings in :mod:`spark_projections.settings`);
* :mod:`spark_projections.delta` - ``full_rebuild`` / ``incremental_merge`` into Delta,
  exactly once per stream position, and ``recorded_position`` / ``table_history``;
* :mod:`spark_projections.ship` - the user's projection code shipped to the executors;
* :mod:`spark_projections.executors` - the driver's preflight of what executors need (a reachable URL, files, jars, modules);
* :mod:`spark_projections.jars` - where the Delta jars come from (Maven or offline folder);
* :mod:`spark_projections.jars_lock` - one resolution through Ivy at a time per Ivy directory, across processes;
* :mod:`spark_projections.java` - the Java 17+ check done before a JVM starts;
* :mod:`spark_projections.errors` - the typed errors, each with a user-facing remedy;
* :mod:`spark_projections.cli` - ``jetsourcing spark``: ``check``, ``fetch-delta-jars``,
  ``rebuild`` and ``update`` (``follow`` and ``status`` in :mod:`spark_projections.follow_command`),
  and :mod:`spark_projections.interrupt` - Ctrl-C and SIGTERM in them.

Spark and Delta are the ``[spark]`` extra: ``pip install 'jetsourcing[spark]'``. The event
store, aggregates and projections install and import without them.
"""

import importlib.util

_MISSING = [name for name in ("pyspark", "delta", "pyarrow", "pandas") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(
        f"jetsourcing's Spark projections need {', '.join(_MISSING)}, which come with the [spark] extra: "
        "pip install 'jetsourcing[spark]'. The event store, aggregates and projections work without it."
    )

from .delta import HistoryEntry, WriteResult, full_rebuild, incremental_merge, latest_per_key, recorded_position, table_history
from .errors import (
    DeltaJarsUnavailableError,
    DeltaNotConfiguredError,
    DuplicateKeysError,
    EventSourceError,
    ExecutorSetupError,
    JavaNotFoundError,
    JavaTooOldError,
    SchemaMismatchError,
    SparkProjectionError,
    SparkStartupError,
    SparkUsageError,
)
from .jars import export_delta_jars
from .java import check_java
from .fold import DEAD_LETTERS_TABLE, GROUP_COLUMN, FoldConstraintError, HandlerFailedError
from .follow import FollowError, Follower, FollowStatus, follow, follow_status
from .projection import DataFrameProjection, ProjectionRun, merge_events, rebuild, update
from .session import ensure_delta, spark_session
from .settings import SparkSettings
from .source import EVENTS_SCHEMA, JetStreamDataSource, read_events
from .typed import TypedDecodingError, spark_schema, typed_events, typed_frames

__all__ = [
    "DEAD_LETTERS_TABLE",
    "DataFrameProjection",
    "DeltaJarsUnavailableError",
    "DeltaNotConfiguredError",
    "DuplicateKeysError",
    "EVENTS_SCHEMA",
    "EventSourceError",
    "ExecutorSetupError",
    "FoldConstraintError",
    "FollowError",
    "FollowStatus",
    "Follower",
    "GROUP_COLUMN",
    "HandlerFailedError",
    "HistoryEntry",
    "JavaNotFoundError",
    "JavaTooOldError",
    "JetStreamDataSource",
    "ProjectionRun",
    "SchemaMismatchError",
    "SparkProjectionError",
    "SparkSettings",
    "SparkStartupError",
    "SparkUsageError",
    "TypedDecodingError",
    "WriteResult",
    "check_java",
    "ensure_delta",
    "export_delta_jars",
    "follow",
    "follow_status",
    "full_rebuild",
    "incremental_merge",
    "latest_per_key",
    "merge_events",
    "read_events",
    "rebuild",
    "recorded_position",
    "spark_schema",
    "spark_session",
    "table_history",
    "typed_events",
    "typed_frames",
    "update",
]
