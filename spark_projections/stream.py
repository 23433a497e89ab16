"""The event store as a Spark streaming source: ``spark.readStream.format("jetstream")``.

Example::

    events = (spark.readStream.format("jetstream")
              .option("url", "nats://host:4222").option("categories", "Account")
              .option("starting_position", "earliest").option("max_events_per_trigger", 100_000)
              .load())
    query = events.writeStream.foreachBatch(handle).option("checkpointLocation", "/lake/_chk").start()

The offsets are stream positions: ``{"position": p}`` means every position up to
``p`` has been read. Each micro-batch reads the positions after the previous
offset up to the new one, split into ``partitions`` ranges read in parallel
exactly as a batch read (:mod:`spark_projections.source`) reads them, so each
event of the range arrives once, in one row per event. An offset never falls
inside an atomic batch (:mod:`eventstore.jetstream.boundaries`): a command's
events always arrive in the same micro-batch.

Options, besides the batch reader's (``url``, ``stream``, ``categories``,
``partitions``, the connection's security, ...):

* ``starting_position``: where a query without a checkpoint begins:
  ``earliest`` (default: the first event), ``latest`` (only events appended
  after the query started), or a position ``N`` (the first micro-batch starts
  at ``N``). A query restarted from its checkpoint goes on after its last
  committed offset whatever this says.
* ``max_events_per_trigger``: at most this many stream positions per
  micro-batch (default :data:`DEFAULT_MAX_EVENTS_PER_TRIGGER`). A position
  holds one commit, usually one event; an atomic batch longer than the bound
  is read whole.

* ``outage_limit_s``: how long a NATS outage (servers unreachable, restarting,
  electing a leader, silent) is waited out before the query fails; ``none``
  (default) waits for ever. ``follow`` passes ``EventStoreSettings.outage_limit_s``
  (``JETSOURCING_OUTAGE_LIMIT_S``). It replaces the former ``give_up_s``, which is
  refused with a message saying so.

Planning asks the stream's leader (a message get per trigger, over a fresh
connection). While the servers are out, planning never blocks: each trigger
tries once when its backoff delay has passed (at most 5 s apart) and, until one
answers, reports no new data, so no micro-batch starts and a stop is never held
up; the outage is logged when it starts, each minute while it lasts and when it
ends (on the planner's stderr, which Spark forwards). A micro-batch already
planned waits the outage out in its partitions' reads, which go on after the
last position they handed over, so the batch holds its range whole, once.
At the limit the query fails with an :class:`~spark_projections.errors.EventSourceError`
that names the server and the limit; nothing of the failed micro-batch was
written, and the query restarted from its checkpoint does it again whole.
``Trigger.AvailableNow`` reads what the stream holds when the query starts,
then stops; its planning waits an outage out in place (reporting no data would
end the query), under the same limit.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from eventstore import EventStoreError, ServerUnavailableError, ride_out
from eventstore.jetstream import BulkConnection, last_commit_boundary, whole_commits_end
from spark_projections._options import Options, int_option
from spark_projections._outage import OutageAcrossCalls, gave_up, is_outage, parse_limit, worker_logger
from spark_projections._range_reader import open_connection, read_range
from spark_projections.errors import EventSourceError
from spark_projections.settings import DEFAULT_MAX_EVENTS_PER_TRIGGER

__all__ = ["DEFAULT_MAX_EVENTS_PER_TRIGGER", "StreamOptions", "StreamReader", "offset_position"]

T = TypeVar("T")


@dataclass(frozen=True)
class StreamOptions:
    """What only a streaming read takes, checked where it is given."""

    starting_position: str | int
    """``"earliest"``, ``"latest"`` or the first position to read."""
    max_events_per_trigger: int
    outage_limit_s: float | None
    """How long a NATS outage is waited out; None: for ever."""

    @classmethod
    def parse(cls, options: Any) -> StreamOptions:
        opts = {str(k).lower(): str(v) for k, v in dict(options).items()}
        start = opts.get("starting_position", "earliest").strip().lower()
        starting: str | int = start
        if start not in ("earliest", "latest"):
            if not start.isdigit():
                raise EventSourceError(
                    f"Option 'starting_position' must be 'earliest', 'latest' or a position (an integer >= 1), "
                    f"not {start!r}."
                )
            starting = int_option(opts, "starting_position", None, minimum=1) or 1
        if "give_up_s" in opts:
            raise EventSourceError(
                "Option 'give_up_s' is now 'outage_limit_s': how long a NATS outage is waited out, in seconds, "
                "or 'none' (the default) to wait for ever, as EventStoreSettings.outage_limit_s says."
            )
        limit = int_option(opts, "max_events_per_trigger", DEFAULT_MAX_EVENTS_PER_TRIGGER, minimum=1)
        return cls(starting, limit or DEFAULT_MAX_EVENTS_PER_TRIGGER, parse_limit(opts.get("outage_limit_s")))


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The micro-batch reader behind ``spark.readStream.format("jetstream")`` (see the module docs)."""

    def __init__(self, options: Options, stream: StreamOptions, columns: tuple[str, ...]) -> None:
        self.options = options
        self.stream = stream
        self.columns = columns
        self._target: int | None = None  # Trigger.AvailableNow: the last position when the query started
        self._outage = OutageAcrossCalls(
            f"Planning a micro-batch of stream {options.stream!r} at {options.url}", stream.outage_limit_s
        )

    def initialOffset(self) -> dict[str, int]:
        start = self.stream.starting_position
        if start == "earliest":
            return {"position": 0}
        if start == "latest":
            return {"position": self._plan(self._last, "Reading the stream's last position")}
        assert isinstance(start, int)
        return {"position": start - 1}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.stream.max_events_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._plan(self._last, "Reading the stream's last position")

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        after = _position(start)
        step = lambda conn: self._end(conn, after, limit)  # noqa: E731
        if self._target is not None:
            # Trigger.AvailableNow ends at the first trigger without new data: wait the outage out here.
            return {"position": self._plan(step, "Planning a micro-batch")}
        if not self._outage.due:
            return {"position": after}  # no new data while the servers are out: no micro-batch, no blocking
        try:
            end = asyncio.run(self._once(step))
        except (ServerUnavailableError, EventSourceError) as exc:
            if not is_outage(exc):
                raise
            self._outage.failed(exc)  # raises at the outage limit
            return {"position": after}
        self._outage.succeeded()
        return {"position": end}

    def reportLatestOffset(self) -> dict[str, int] | None:
        return None  # one more round trip per trigger for a figure Spark only displays

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        from spark_projections.source import _Range, split_range

        return [_Range(a, b) for a, b in split_range(_position(start) + 1, _position(end), self.options.partitions)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        from spark_projections.source import _Range

        if not isinstance(partition, _Range):
            return iter(())
        return read_range(self.options, partition.start, partition.stop, self.columns,
                          outage_limit_s=self.stream.outage_limit_s)

    async def _last(self, conn: BulkConnection) -> int:
        return await last_commit_boundary(conn, self.options.stream, timeout_s=self.options.request_timeout_s)

    async def _end(self, conn: BulkConnection, after: int, limit: ReadLimit) -> int:
        last = await self._last(conn)
        if self._target is not None:
            last = min(last, self._target)
        if last < after:
            raise EventSourceError(
                f"The query's checkpoint says positions up to {after} of stream {self.options.stream!r} were read, "
                f"but the stream ends at {last}: it was deleted and created again, or this checkpoint belongs to "
                "another stream. Start the query with a new checkpoint location."
            )
        if last == after:
            return after
        if isinstance(limit, ReadMaxRows) and after + limit.max_rows < last:
            return await whole_commits_end(
                conn, self.options.stream, after, after + limit.max_rows, timeout_s=self.options.request_timeout_s
            )
        if not isinstance(limit, (ReadMaxRows, ReadAllAvailable)):
            raise EventSourceError(f"The jetstream source cannot limit a micro-batch by {limit!r}.")
        return last

    def _plan(self, step: Callable[[BulkConnection], Awaitable[T]], what: str) -> T:
        """Run ``step`` over a fresh connection, waiting an outage out in place (:func:`eventstore.ride_out`);
        for calls whose answer Spark needs before it goes on."""
        return asyncio.run(self._ride_out(step, f"{what} of stream {self.options.stream!r} at {self.options.url}"))

    async def _ride_out(self, step: Callable[[BulkConnection], Awaitable[T]], what: str) -> T:
        # The JVM stops waiting for this process when its query stops, and this call would go on: end it when the
        # process that started it (the JVM) is gone.
        stop = asyncio.Event()
        watch = asyncio.create_task(_watch_parent(stop))
        try:
            return await ride_out(lambda: self._once(step), what=what, logger=worker_logger(), transient=is_outage,
                                  limit_s=self.stream.outage_limit_s, stop=stop)
        except (ServerUnavailableError, EventSourceError) as exc:
            if is_outage(exc) and not stop.is_set() and self.stream.outage_limit_s is not None:
                raise gave_up(exc, self.stream.outage_limit_s) from exc
            raise
        finally:
            watch.cancel()

    async def _once(self, step: Callable[[BulkConnection], Awaitable[T]]) -> T:
        conn = await open_connection(self.options)
        try:
            return await step(conn)
        except EventStoreError as exc:
            if isinstance(exc, ServerUnavailableError):
                raise
            raise EventSourceError(f"{exc} (server {self.options.url})") from exc
        finally:
            conn.close()


async def _watch_parent(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    stop.set()


def offset_position(offset: object) -> int | None:
    """The position of a jetstream offset (``{"position": p}``, ``p`` >= 0); None when ``offset`` is not one."""
    position = offset.get("position") if isinstance(offset, dict) else None
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
        return None
    return position


def _position(offset: dict[str, Any]) -> int:
    position = offset_position(offset)
    if position is None:
        raise EventSourceError(
            f"A jetstream offset is {{'position': <int >= 0>}}, not {offset!r}: this checkpoint was not written by "
            "the jetstream source. Start the query with a new checkpoint location."
        )
    return position
