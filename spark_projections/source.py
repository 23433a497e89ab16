"""The event store as a Spark data source: ``spark.read.format("jetstream")``.

Example::

    from eventstore import EventStoreSettings
    from spark_projections.source import read_events

    events = read_events(spark, EventStoreSettings(nats_url="nats://host:4222"), categories=["Account"])
    events.groupBy("type").count().show()

    # the same, through the data source API
    events = (spark.read.format("jetstream")
              .option("url", "nats://host:4222").option("stream", "EVENTS").option("subject_prefix", "events")
              .option("categories", "Account,Cart").option("from_position", 1).option("to_position", 5000)
              .option("partitions", 4).load())

One row per *event* (a commit of n events gives n rows with the same
``position`` and ``index`` 0..n-1), with the columns of :data:`EVENTS_SCHEMA`.

How a read runs:

* **Planning** (``partitions()``, in a Python worker next to the driver) asks
  the server for the stream's first and last sequence, clamps
  ``[from_position, to_position]`` to it (``to_position`` defaults to the last
  sequence *at planning time*, so every action re-plans; pin it for repeatable
  reads) and cuts the range into ``partitions`` equal sequence ranges.
* **Reading** (``read()``, in the executors): each partition opens its own NATS
  connection and reads its range with the event store's ordered replay
  (:class:`eventstore.jetstream.OrderedReplay`: in order, delivery sequence
  checked on every message, a fresh consumer after a gap, a deleted consumer,
  missed heartbeats or a server restart; the category filter is applied by
  the server, so positions have gaps). An asyncio loop private to
  the task drives it. Each pulled batch becomes one Arrow record batch built
  with vectorised Arrow kernels. Works the same on ``local[*]`` and on a
  cluster whose executors can reach the NATS servers.

Speed: nats-py builds a message object with a header dict per message and runs a
callback for it, which caps one partition far below what the server sends. Here the
partition's connection (``eventstore.jetstream.BulkConnection``) frames whole socket
reads and hands each run of the consumer's messages to the native scanner
(``eventstore/_native.c``): it checks every frame (our subscription and consumer,
consecutive consumer sequences, the subject layout, each required header once) and
cuts out the subject's category and entity, the header values and the body as Arrow
binary views into the received bytes (``_batches.Frames``). ``_batches.Converter``
turns a batch of such runs into the columns with a few Arrow kernels. Any frame the
scanner does not take (a status message, an earlier consumer's message, another
writer's header layout, a malformed frame) goes through the Python framing, which is
kept, tested, for them and for installs without a C compiler.

Spark cannot tell a Python source which columns a query uses, so a reader
that needs few should say so (``columns=`` / ``.schema(...)``). Yielding
Arrow batches rather than row tuples cuts the conversion cost by more than
half (``jetstream_read_eps_p2_rows`` in ``benchmarks/bench_spark.py``).

Where the time goes in a rebuild is in ``cpu_us_per_event`` of
``benchmarks/bench_spark.py`` (figures: ``benchmarks/README.md``): the
nats-server's delivery of each message, the reader in Spark's Python worker,
and Spark's JVM, which spends on these events what it spends on the same
events read from Parquet. When the server shares the executors' cores, the
server's CPU sets the gap to a Parquet read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

from py4j.protocol import Py4JError
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from eventstore import EventStore, EventStoreError, EventStoreSettings, ServerUnavailableError
from eventstore.jetstream import Subjects
from spark_projections._batches import EVENTS_SCHEMA
from spark_projections._options import DEFAULT_BATCH, Options
from spark_projections._range_reader import open_connection, read_range
from spark_projections.errors import NO_SERVER, EventSourceError
from spark_projections.executors import preflight
from spark_projections.stream import StreamOptions, StreamReader

__all__ = [
    "EVENTS_SCHEMA",
    "FORMAT",
    "EventSourceError",
    "JetStreamDataSource",
    "read_events",
    "register",
    "settings_options",
    "split_range",
    "stream_bounds",
]

FORMAT = "jetstream"
"""The data source's short name: ``spark.read.format(FORMAT)``."""


# -- the data source ---------------------------------------------------------------------


class JetStreamDataSource(DataSource):
    """``spark.read.format("jetstream")``: the events of one event-store stream (see the module docs).

    Options: ``url`` (required), ``stream`` (default ``EVENTS``), ``subject_prefix``
    (default ``events``), ``categories`` (comma-separated; default all),
    ``from_position`` (default 1), ``to_position`` (default: the last position when
    the query is planned), ``partitions`` (parallel reads; default 1), ``batch``
    (messages per pull request; default 5000), ``request_timeout_s`` (default 5),
    and the fields of :class:`~eventstore.ConnectionSecurity` for a secured server
    (``user``, ``password``, ``token``, ``nkey_seed_file``, ``credentials_file``,
    ``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``, ``tls_hostname``; files
    must exist on the driver and on every executor). See docs/guides/security.md
    for where secrets are safest.

    Column pruning: Spark does not tell Python sources which columns a query uses,
    so ``.schema("position BIGINT, type STRING, payload STRING")`` (any subset of
    :data:`EVENTS_SCHEMA`, same types) makes the read build only those columns.
    """

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return EVENTS_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return _Reader(Options.parse(self.options), _columns(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """``spark.readStream.format("jetstream")``: micro-batches of stream positions (:mod:`spark_projections.stream`)."""
        return StreamReader(Options.parse(self.options), StreamOptions.parse(self.options), _columns(schema))


def _columns(schema: StructType) -> tuple[str, ...]:
    """The event columns a read must produce: all, or the subset a user schema names (column pruning)."""
    known = {f.name: f.dataType for f in EVENTS_SCHEMA.fields}
    wrong = [f"{f.name} {f.dataType.simpleString()}" for f in schema.fields if known.get(f.name) != f.dataType]
    if wrong or not schema.fields:
        raise EventSourceError(
            f"A jetstream schema may only pick columns of the events schema, with their types; not {wrong or 'none'}. "
            f"Columns: {', '.join(f'{f.name} {f.dataType.simpleString()}' for f in EVENTS_SCHEMA.fields)}."
        )
    return tuple(schema.fieldNames())


class _Range(InputPartition):
    """One partition: the stream sequences ``start..stop`` (inclusive)."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__((start, stop))
        self.start = start
        self.stop = stop


def split_range(first: int, last: int, parts: int) -> list[tuple[int, int]]:
    """Cut ``first..last`` (inclusive) into at most ``parts`` contiguous, non-empty, near-equal ranges."""
    count = last - first + 1
    if count <= 0:
        return []
    parts = max(1, min(parts, count))
    size, extra = divmod(count, parts)
    out = []
    start = first
    for i in range(parts):
        stop = start + size - 1 + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop + 1
    return out


class _Reader(DataSourceReader):
    def __init__(self, options: Options, columns: tuple[str, ...] = tuple(EVENTS_SCHEMA.fieldNames())) -> None:
        self.options = options
        self.columns = columns

    def partitions(self) -> list[InputPartition]:
        opts = self.options
        first, last = asyncio.run(_stream_bounds(opts))
        low = max(opts.from_position, first)
        high = last if opts.to_position is None else min(opts.to_position, last)
        # An empty list makes Spark read one partition with value None: nothing.
        return [_Range(a, b) for a, b in split_range(low, high, opts.partitions)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, _Range):
            return iter(())
        return read_range(self.options, partition.start, partition.stop, self.columns)


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("jetstream")`` available in ``spark`` (idempotent)."""
    # Registering again replaces the source with a warning on stderr, and every session
    # spark_session() returns has it already: a CLI run would print it at its first read.
    try:
        jsession: Any = spark._jsparkSession
        if jsession.sessionState().dataSourceManager().dataSourceExists(FORMAT):
            return
    except Py4JError:  # Spark's internals moved: registering again only costs the warning
        pass
    spark.dataSource.register(JetStreamDataSource)


def read_events(
    spark: SparkSession,
    settings: EventStoreSettings,
    *,
    categories: Sequence[str] | None = None,
    from_position: int = 1,
    to_position: int | None = None,
    partitions: int | None = None,
    batch: int = DEFAULT_BATCH,
    columns: Sequence[str] | None = None,
) -> DataFrame:
    """The events of ``settings``' stream as a DataFrame with :data:`EVENTS_SCHEMA`.

    ``categories`` limits the read (default: all); ``from_position`` /
    ``to_position`` bound it by stream position, inclusive (``to_position``
    defaults to the stream's last position when each action is planned: pass it
    for a repeatable read). ``partitions`` (default: Spark's default
    parallelism) is how many tasks read sequence ranges in parallel, each over
    its own connection. Every event in the range is returned exactly once.
    ``columns`` (default: all) names the event columns to build, in that order:
    a read that needs few columns is cheaper (Spark cannot prune them itself).
    """
    if settings.nats_url is None:
        raise EventSourceError(NO_SERVER)
    preflight(spark, settings)
    register(spark)
    reader = (
        spark.read.format(FORMAT)
        .options(**settings_options(settings))
        .option("from_position", str(from_position))
        .option("partitions", str(partitions or spark.sparkContext.defaultParallelism))
        .option("batch", str(batch))
    )
    if categories:
        reader = reader.option("categories", ",".join(categories))
    if to_position is not None:
        reader = reader.option("to_position", str(to_position))
    if columns is not None:
        types = {f.name: f for f in EVENTS_SCHEMA.fields}
        unknown = [c for c in columns if c not in types]
        if unknown:
            raise EventSourceError(f"Unknown event columns {unknown}; the columns are {EVENTS_SCHEMA.fieldNames()}.")
        reader = reader.schema(StructType([types[c] for c in columns]))
    return reader.load()


def settings_options(settings: EventStoreSettings) -> dict[str, str]:
    """The data source options that say where ``settings``' stream is and how to connect to it (secrets included)."""
    return {
        "url": settings.nats_url or "",
        "stream": settings.stream,
        "subject_prefix": settings.subject_prefix,
        "request_timeout_s": str(settings.request_timeout_s),
        **settings.as_options(),
    }


async def stream_bounds(settings: EventStoreSettings) -> tuple[int, int]:
    """The (first, last) position of ``settings``' stream, asked from the server; (1, 0) when it is empty."""
    if settings.nats_url is None:
        raise EventSourceError(NO_SERVER)
    try:
        async with EventStore.connect(settings, create_stream=False) as store:
            info = await store.info()
    except EventStoreError as exc:
        raise EventSourceError(str(exc)) from exc
    return (info.first_position or 1), info.last_position


async def _stream_bounds(opts: Options) -> tuple[int, int]:
    """The stream's (first, last) sequence; (1, 0) when it is empty."""
    conn = await open_connection(opts)
    what = f"Reading the positions of stream {opts.stream!r}"
    try:
        try:
            _, _, _, data = await conn.request(Subjects(opts.stream).stream_info(), b"", opts.request_timeout_s)
        except (TimeoutError, ServerUnavailableError) as exc:
            raise EventSourceError(f"{what}: no answer from {opts.url} within {opts.request_timeout_s}s ({exc}).") from exc
        info = json.loads(data) if data else {"error": {"description": "JetStream did not answer (no responders)"}}
        if "error" in info:
            raise EventSourceError(
                f"Cannot read stream {opts.stream!r} at {opts.url}: {info['error'].get('description', info['error'])}. "
                "Check the 'stream' option (and that JetStream is enabled)."
            )
        state = info.get("state", {})
        return int(state.get("first_seq") or 1), int(state.get("last_seq") or 0)
    finally:
        conn.close()
