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

Planning asks the stream's leader (a message get per trigger, over a fresh
connection) and retries a lost server or a leader election with backoff for up
to ``give_up_s`` (default 30 s) before the micro-batch fails with an
:class:`~spark_projections.errors.EventSourceError` that names the server. The
partitions' reads retry the same way (see :mod:`eventstore.jetstream`).
``Trigger.AvailableNow`` reads what the stream holds when the query starts,
then stops.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from eventstore import EventStoreError, ServerUnavailableError
from eventstore.jetstream import BulkConnection, last_commit_boundary, whole_commits_end
from spark_projections._options import Options, int_option
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
    give_up_s: float

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
        give_up = opts.get("give_up_s", "30")
        try:
            give_up_s = float(give_up)
        except ValueError:
            raise EventSourceError(f"Option 'give_up_s' must be a number of seconds, not {give_up!r}.") from None
        if not give_up_s > 0:
            raise EventSourceError(f"Option 'give_up_s' must be positive, not {give_up!r}.")
        limit = int_option(opts, "max_events_per_trigger", DEFAULT_MAX_EVENTS_PER_TRIGGER, minimum=1)
        return cls(starting, limit or DEFAULT_MAX_EVENTS_PER_TRIGGER, give_up_s)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The micro-batch reader behind ``spark.readStream.format("jetstream")`` (see the module docs)."""

    def __init__(self, options: Options, stream: StreamOptions, columns: tuple[str, ...]) -> None:
        self.options = options
        self.stream = stream
        self.columns = columns
        self._target: int | None = None  # Trigger.AvailableNow: the last position when the query started

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
        return {"position": self._plan(lambda conn: self._end(conn, after, limit), "Planning a micro-batch")}

    def reportLatestOffset(self) -> dict[str, int] | None:
        return None  # one more round trip per trigger for a figure Spark only displays

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        from spark_projections.source import _Range, split_range

        return [_Range(a, b) for a, b in split_range(_position(start) + 1, _position(end), self.options.partitions)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        from spark_projections.source import _Range

        if not isinstance(partition, _Range):
            return iter(())
        return read_range(self.options, partition.start, partition.stop, self.columns)

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
        """Run ``step`` over a fresh connection, again with backoff while the server is lost or electing a leader."""
        deadline = time.monotonic() + self.stream.give_up_s
        delay = 0.1
        while True:
            try:
                return asyncio.run(self._once(step))
            except (ServerUnavailableError, EventSourceError) as exc:
                if isinstance(exc, EventSourceError) and not isinstance(exc.__cause__, ServerUnavailableError):
                    raise
                if time.monotonic() + delay > deadline:
                    raise EventSourceError(
                        f"{what} of stream {self.options.stream!r}: no server at {self.options.url} answered within "
                        f"{self.stream.give_up_s:g}s ({exc}). Check that the NATS servers run and are reachable."
                    ) from exc
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 2.0)

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
