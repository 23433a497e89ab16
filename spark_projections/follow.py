"""Follow the event stream continuously into a projection's Delta tables: a Structured Streaming query.

Example::

    from spark_projections import follow

    follower = follow(spark, AccountBalances(), settings, "/lake/accounts", trigger_s=1.0)
    ...
    follower.stop()          # after the micro-batch in flight, if any

From a shell: ``jetsourcing spark follow myapp.views:AccountBalances --root /lake/accounts``
(SIGTERM or Ctrl-C stops it after the current micro-batch).

How it works: ``spark.readStream.format("jetstream")`` (:mod:`spark_projections.stream`)
hands over micro-batches of whole commits; each one goes through
:func:`~spark_projections.projection.merge_events`, which folds it with the
projection's handlers as :func:`~spark_projections.projection.update` does and
MERGEs it into each table in one Delta commit carrying ``txnAppId=<name>.v<version>``
and ``txnVersion=<the batch's last position>``. So:

* a micro-batch Spark runs again after a crash (its offsets were logged, its
  commit was not) changes nothing the first run already wrote;
* with its checkpoint deleted, the query starts after the tables' recorded
  position, and anything it reads again is skipped by the same guard;
* the first micro-batch of new tables (or of a new projection version) builds
  them from the first event.

The checkpoint defaults to ``<root>/_jetsourcing/checkpoints/<name>.v<version>``;
after each micro-batch, what it did is written to
``<root>/_jetsourcing/follow-<name>.v<version>.json`` (``jetsourcing spark status``
shows it). A DataFrame projection follows only when it has ``combine`` (its
partial rows are merged into the stored ones); otherwise it is refused.

A NATS outage (servers down, restarting, electing a leader, silent) is waited
out as the daemon waits it out, for ``settings.outage_limit_s``
(``JETSOURCING_OUTAGE_LIMIT_S``; None, the default: for ever): no micro-batch
starts while the servers are out, and one already planned waits in its reads
and then goes on, whole (:mod:`spark_projections.stream`). The outage is logged
when it starts, each minute while it lasts and when it ends. At the limit the
query fails with an :class:`~spark_projections.errors.EventSourceError` naming
the server, and nothing of the batch in flight was written; a later run does
that batch again, exactly once. :meth:`Follower.stop` never waits for an
outage: a batch it cuts short is redone whole by the next run.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import StructType

from eventstore import EventStoreSettings, TypeRegistry
from projections import ErrorPolicy
from spark_projections.delta import recorded_position
from spark_projections.errors import NO_SERVER, SparkProjectionError, root_cause
from spark_projections.executors import preflight
from spark_projections.projection import (
    AnyProjection,
    DataFrameProjection,
    Progress,
    ProjectionRun,
    app_id_of,
    common_position,
    error_policy_of,
    merge_events,
    rebuild,
    table_names,
    table_root,
)
from spark_projections.source import EVENTS_SCHEMA, FORMAT, register, settings_options
from spark_projections.stream import DEFAULT_MAX_EVENTS_PER_TRIGGER, offset_position

__all__ = ["FollowError", "FollowStatus", "Follower", "batch_end", "follow", "follow_status", "status_path"]

_STATE = "_jetsourcing"


class FollowError(SparkProjectionError):
    """A projection cannot be followed as asked (a DataFrame projection without ``combine``, a checkpoint whose
    tables are gone, ...); the message says what to do."""


@dataclass(frozen=True)
class FollowStatus:
    """What the last micro-batch of a follower did, as written after it (``jetsourcing spark status`` shows it).

    ``position`` is the last stream position the follower has read (the batch's
    end offset); ``tables_position`` the one the tables record (lower when the
    newest events change nothing: events of other categories, or of types
    without a handler); ``mode`` the
    :class:`~spark_projections.projection.ProjectionRun` mode (``"rebuild"``,
    ``"merge"``, ``"noop"``); ``positions`` how many stream positions the batch
    covered (its events, and those of categories the projection does not read);
    ``seconds`` how long it took; ``at`` when it ended (Unix time);
    ``last_progress`` Spark's ``StreamingQuery.lastProgress`` of the batch
    before it (rates, durations, ``numInputRows``).
    """

    app_id: str
    batch_id: int
    mode: str
    position: int
    tables_position: int
    positions: int
    seconds: float
    at: float
    last_progress: dict[str, Any] | None


def checkpoint_path(root: str | os.PathLike[str], projection: AnyProjection) -> Path:
    """Where :func:`follow` keeps its Spark checkpoint unless told otherwise."""
    return table_root(root) / _STATE / "checkpoints" / app_id_of(projection)


def status_path(root: str | os.PathLike[str], projection: AnyProjection) -> Path:
    """Where :func:`follow` writes its :class:`FollowStatus` after each micro-batch."""
    return table_root(root) / _STATE / f"follow-{app_id_of(projection)}.json"


def follow_status(root: str | os.PathLike[str], projection: AnyProjection) -> FollowStatus | None:
    """The last :class:`FollowStatus` a follower of ``projection`` wrote under ``root``; None if none ever ran."""
    try:
        data = json.loads(status_path(root, projection).read_text())
    except FileNotFoundError:
        return None
    return FollowStatus(**data)


class Follower:
    """A running :func:`follow`: its streaming query, and a stop that lets the micro-batch in flight finish."""

    def __init__(self, query: StreamingQuery, writer: _BatchWriter, trigger_s: float | None) -> None:
        self.query = query
        self._writer = writer
        self._trigger_s = trigger_s  # None: an available-now query, which ends by itself

    @property
    def status(self) -> FollowStatus | None:
        """What the last micro-batch did (None before the first one ends)."""
        return self._writer.last

    @property
    def error(self) -> BaseException | None:
        """The error that failed the query, as raised in the micro-batch (e.g. a :class:`HandlerFailedError`)."""
        return self._writer.error

    @property
    def failure(self) -> str | None:
        """Why the query failed, in one paragraph without a stack trace (None while it runs or after a stop):
        what :func:`~spark_projections.errors.root_cause` finds in :attr:`error` or the query's exception, e.g.
        "Could not connect to NATS at nats://host:4222 within 5.0s (...); the outage reached its limit of 60s"."""
        error = self._writer.error or self.query.exception()
        return None if error is None else root_cause(error)

    @property
    def active(self) -> bool:
        """True while the query runs."""
        return bool(self.query.isActive)

    def await_termination(self, timeout_s: float | None = None) -> bool:
        """Wait for the query to end (an ``available_now`` follower ends once caught up); False on timeout.

        Raises the query's error, as :class:`pyspark.errors.StreamingQueryException`, if it failed.
        """
        if timeout_s is None:
            self.query.awaitTermination()
            return True
        return bool(self.query.awaitTermination(timeout_s))  # type: ignore[arg-type] # seconds, any number

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the query once the micro-batch in flight has been written, waiting at most ``grace_s`` for it.

        After ``grace_s`` the query is stopped anyway: the batch's Delta commits are
        exactly-once, so a batch cut short is redone whole by the next run.
        """
        deadline = time.monotonic() + grace_s
        self._writer.idle.wait(grace_s)
        done = self._writer.last
        # Spark logs a batch as committed after our function returns, then reports its progress.
        while done is not None and time.monotonic() < deadline:
            progress = self.query.lastProgress
            if progress is not None and progress["batchId"] >= done.batch_id:
                break
            time.sleep(0.05)
        self._between_triggers(deadline)
        self._writer.stopping = True
        self.query.stop()

    def _between_triggers(self, deadline: float) -> None:
        """Return once the query's thread sleeps until its next trigger, not close to it (or at ``deadline``).

        Spark stops a query by interrupting its thread. While it starts the source and during a trigger, that
        thread talks to the source's Python process (the jetstream source plans micro-batches there), and an
        interrupt closes their socket under it: the process then prints an ``EOFError`` / ``BrokenPipeError``
        traceback before Spark ends it. Between triggers the thread only sleeps, and an interrupt just wakes it. Spark starts processing-time
        triggers at whole multiples of the interval on the wall clock (``ProcessingTimeExecutor``), so a stop
        made well before the next one finds the thread asleep.
        """
        if self._trigger_s is None:
            return
        interval_ms = max(1, round(self._trigger_s * 1000))
        margin_ms = min(100, interval_ms // 3)  # the stop's own round trip to the JVM takes a few ms
        while time.monotonic() < deadline and self.query.isActive:
            status = self.query.status
            to_next_ms = interval_ms - time.time() * 1000 % interval_ms
            if not status["isTriggerActive"] and status["message"].startswith("Waiting for") and to_next_ms > margin_ms:
                return
            time.sleep(0.01)


def follow(
    spark: SparkSession,
    projection: AnyProjection,
    settings: EventStoreSettings,
    root: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    trigger_s: float = 1.0,
    max_events_per_trigger: int = DEFAULT_MAX_EVENTS_PER_TRIGGER,
    partitions: int | None = None,
    registry: TypeRegistry | None = None,
    group_by: str = "stream_id",
    error_policy: ErrorPolicy | str | None = None,
    available_now: bool = False,
    progress: Progress | None = None,
) -> Follower:
    """Start a streaming query that keeps ``projection``'s Delta tables under ``root`` up to date; see the module docs.

    ``trigger_s``: a micro-batch starts every ``trigger_s`` seconds (when the previous
    one is done). ``max_events_per_trigger`` bounds a micro-batch in stream
    positions; ``partitions`` is how many parallel reads a micro-batch makes
    (default: Spark's default parallelism). ``error_policy`` (default: the projection's own) is the daemon's:
    ``stop`` fails the query naming the event, ``dead_letter`` records the failing
    commit in ``<root>/_dead_letters`` and goes on. ``available_now`` reads what
    the stream holds now, then ends (see :meth:`Follower.await_termination`).
    ``progress`` is told each micro-batch's outcome in words.

    Raises :class:`FollowError` for a projection that cannot stream, or tables
    gone while the checkpoint remains, before anything starts.
    """
    if settings.nats_url is None:
        raise FollowError(NO_SERVER)
    if not (isinstance(trigger_s, (int, float)) and not isinstance(trigger_s, bool) and trigger_s > 0):
        raise FollowError(f"trigger_s must be a positive number of seconds, not {trigger_s!r}.")
    if isinstance(projection, DataFrameProjection) and projection.combine is None:
        raise FollowError(
            f"DataFrame projection {projection.name!r} has no combine, so a micro-batch's rows cannot be merged into "
            "the stored ones. Give it combine= (combine={} when each batch only adds new keys, as an append-only "
            "output does), or run `jetsourcing spark rebuild` on a schedule instead."
        )
    policy = error_policy_of(projection, error_policy)
    checkpoint_dir = table_root(checkpoint) if checkpoint is not None else checkpoint_path(root, projection)
    recorded = common_position(spark, projection, root)
    if recorded is None and any(
        recorded_position(spark, table_root(root) / name, app_id_of(projection)) is not None for name in table_names(projection)
    ):
        # An interrupted batch run left the tables at different positions: new events cannot bring them up to date.
        if progress is not None:
            progress("the tables record different positions: rebuilding them first")
        recorded = rebuild(spark, projection, settings, root, registry=registry, partitions=partitions,
                           group_by=group_by, error_policy=policy, progress=progress).position
    elif recorded is None and _has_progress(checkpoint_dir):
        raise FollowError(
            f"The tables of {projection.name!r} under {root} are missing, but the checkpoint {checkpoint_dir} says "
            "batches were written: the tables were deleted. Delete the checkpoint folder too, to build them again "
            "from the first event."
        )
    preflight(spark, settings)
    register(spark)
    reader = (
        spark.readStream.format(FORMAT)
        .options(**settings_options(settings))
        .option("starting_position", str((recorded or 0) + 1))
        .option("max_events_per_trigger", str(max_events_per_trigger))
        .option("partitions", str(partitions or spark.sparkContext.defaultParallelism))
        .option("outage_limit_s", "none" if settings.outage_limit_s is None else str(settings.outage_limit_s))
    )
    if projection.categories:
        reader = reader.option("categories", ",".join(projection.categories))
    if isinstance(projection, DataFrameProjection) and projection.columns is not None:
        fields = {f.name: f for f in EVENTS_SCHEMA.fields}
        reader = reader.schema(StructType([fields[c] for c in dict.fromkeys(("position", *projection.columns))]))
    writer = _BatchWriter(projection, table_root(root), checkpoint_dir, recorded or 0, registry, group_by, policy,
                          progress)
    stream = reader.load().writeStream.foreachBatch(writer).option("checkpointLocation", str(checkpoint_dir))
    stream = stream.queryName(f"jetsourcing-{app_id_of(projection)}")
    stream = stream.trigger(availableNow=True) if available_now else stream.trigger(processingTime=f"{trigger_s} seconds")
    query = stream.start()
    writer.query = query
    return Follower(query, writer, None if available_now else trigger_s)


def _has_progress(checkpoint: Path) -> bool:
    """Whether a (local) Spark checkpoint has committed batches."""
    commits = checkpoint / "commits"
    return commits.is_dir() and any(commits.iterdir())


class _BatchWriter:
    """The ``foreachBatch`` function: one micro-batch of events into the tables, then the status file."""

    def __init__(
        self,
        projection: AnyProjection,
        root: Path,
        checkpoint: Path,
        start: int,
        registry: TypeRegistry | None,
        group_by: str,
        policy: ErrorPolicy,
        progress: Progress | None,
    ) -> None:
        self.projection = projection
        self.root = root
        self.checkpoint = checkpoint
        self.start = start  # the position the first micro-batch starts after, when the checkpoint is new
        self.registry = registry
        self.group_by = group_by
        self.policy = policy
        self.progress = progress
        self.query: StreamingQuery | None = None
        self.last: FollowStatus | None = None
        self.error: BaseException | None = None
        self.stopping = False  # Follower.stop is stopping the query: a failure now is its cancelled job
        self.idle = threading.Event()
        self.idle.set()

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        self.idle.clear()
        try:
            self._write(df, batch_id)
        except BaseException as exc:
            if self.stopping and self.query is not None:
                # Spark tells a stop from a failure by the text of what this raised. Its pattern backtracks once
                # per character of the text: the cancelled job's JVM trace (thousands of lines) overflows its
                # stack and kills the query's thread with a StackOverflowError. A short text naming the job group
                # it cancelled is taken for the stop it is.
                raise _Cancelled(
                    f"org.apache.spark.SparkException: micro-batch {batch_id} was cancelled (job group "
                    f"{self.query.runId}): the follower stopped; its next run does the micro-batch again, whole."
                ) from None
            self.error = exc  # Spark hands the query's caller a JVM wrapper of it; keep the original
            raise
        finally:
            self.idle.set()

    def _write(self, df: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        # The batch's range comes from Spark's offset log, not from a pass over the events: the fold reads them once.
        start = self.start if batch_id == 0 else batch_end(self.checkpoint, batch_id - 1)
        position = batch_end(self.checkpoint, batch_id)
        run = merge_events(
            df.sparkSession, self.projection, df, self.root, position=position,
            registry=self.registry, group_by=self.group_by, error_policy=self.policy,
        )
        status = FollowStatus(
            app_id=app_id_of(self.projection),
            batch_id=batch_id,
            mode=run.mode,
            position=position,
            tables_position=run.position,
            positions=position - start,
            seconds=round(time.monotonic() - started, 3),
            at=time.time(),
            last_progress=_last_progress(self.query),
        )
        self.last = status
        _write_json(status_path(self.root, self.projection), status.__dict__)
        if self.progress is not None:
            self.progress(f"batch {batch_id}: positions {start + 1:,} to {position:,}, {status.mode}, the tables at "
                          f"{run.position:,} in {status.seconds:.1f}s")


class _Cancelled(Exception):
    """A micro-batch cut short by :meth:`Follower.stop` (its Delta commits are exactly-once: nothing is lost)."""


def batch_end(checkpoint: Path, batch_id: int) -> int:
    """The stream position micro-batch ``batch_id`` of the query checkpointed at ``checkpoint`` reads up to.

    Spark logs a batch's end offsets (``offsets/<batch_id>``: a version line, the
    batch's metadata, then one offset per source) before it runs the batch, and
    keeps the recent ones. Raises :class:`FollowError` when the log is missing or
    not of the version read here (``v1``, the format since Spark 2.1).
    """
    path = checkpoint / "offsets" / str(batch_id)
    try:
        lines = path.read_text().splitlines()
        offset = json.loads(lines[2]) if len(lines) == 3 and lines[0] == "v1" else None
    except (OSError, ValueError) as exc:
        raise FollowError(f"Cannot read micro-batch {batch_id}'s offsets in {path}: {exc}.") from exc
    position = offset_position(offset)
    if position is None:
        raise FollowError(
            f"{path} is not a Spark offset log of the jetstream source (version v1, one offset "
            '{"position": N}): the checkpoint belongs to another query, or this Spark writes another format.'
        )
    return position


def _last_progress(query: StreamingQuery | None) -> dict[str, Any] | None:
    progress = None if query is None else query.lastProgress
    if progress is None:
        return None
    return dict(json.loads(progress.json)) if hasattr(progress, "json") else dict(progress)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(data, out)
    os.replace(tmp, path)

