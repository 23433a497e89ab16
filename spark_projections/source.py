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
  connection and reads its range with an ephemeral ordered pull consumer, the
  protocol of the event store's :class:`~eventstore.OrderedPull` (in order,
  delivery sequence checked on every message, a fresh consumer after a gap, a
  deleted consumer, missed heartbeats or a server restart; the category filter
  is applied by the server, so positions have gaps). An asyncio loop private to
  the task drives it. Each pulled batch becomes one Arrow record batch built
  with vectorised Arrow kernels. Works the same on ``local[*]`` and on a
  cluster whose executors can reach the NATS servers.

Speed: replaying through nats-py message objects costs about 18 us of client
CPU per event (header dicts, one callback, queue and Msg per message), which
caps one partition at some 50k events/s. Here the partition's connection
(:class:`_ReadConnection`) reads the socket 256 KiB at a time and its parser
hands each run of the consumer's messages to a small C scanner
(``spark_projections/_frames.c``, compiled by the install): it checks every
frame (our subscription and consumer, consecutive consumer sequences, the
subject layout, each required ``Es-*`` header once) and cuts out the
subject's category and entity, the header values and the body as Arrow
binary views into the received bytes, without copying them
(:class:`_Frames`). :class:`_Converter` turns a batch of such runs into the
columns with a few Arrow kernels: about 0.85 us of client CPU per event for
four columns, against 3.7 us for the same work in Python. Any frame the
scanner does not take (a status message, an earlier consumer's message,
another writer's header layout, a malformed frame) goes through the Python
framing, which was the whole reader before and is kept, tested, for them
and for installs without a C compiler (about 4x slower).

Spark cannot tell a Python source which columns a query uses, so a reader
that needs few should say so (``columns=`` / ``.schema(...)``). Yielding
Arrow batches rather than row tuples cuts the conversion cost by more than
half (``jetstream_read_eps_p2_rows`` in ``benchmarks/bench_spark.py``).

Where the time goes in a rebuild (``cpu_us_per_event`` in the benchmark):
the nats-server spends about 3.5 us of CPU delivering each message to a
consumer (a direct-get batch costs it some 15 us, a push consumer no less),
the reader about 1.3 us in Spark's Python worker, and Spark's JVM what it
spends on the same events read from Parquet (about 4 us). When the server
shares the executors' cores, the server's CPU sets the gap to a Parquet read.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import itertools
import json
import logging
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, TypeAlias
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from nats import errors
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser
from pydantic import ValidationError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType, TimestampType

from eventstore import (
    AuthenticationError,
    ConnectionSecurity,
    EventDecodeError,
    EventStoreSettings,
    ServerUnavailableError,
    connect_options,
    create_replay_consumer,
)
from eventstore.connection import Connection
from eventstore.security import check_url_credentials, redact_url
from eventstore.streams import validate_category
from spark_projections.errors import SparkProjectionError

try:
    from spark_projections import _frames
except ImportError:  # not built where this was installed (no C compiler): the Python framing does it all
    _frames = None  # type: ignore[assignment]

__all__ = [
    "EVENTS_SCHEMA",
    "FORMAT",
    "EventSourceError",
    "JetStreamDataSource",
    "read_events",
    "register",
    "split_range",
    "stream_bounds",
]

FORMAT = "jetstream"
"""The data source's short name: ``spark.read.format(FORMAT)``."""

EVENTS_SCHEMA = StructType(
    [
        StructField("position", LongType()),
        StructField("index", IntegerType()),
        StructField("stream_id", StringType()),
        StructField("category", StringType()),
        StructField("entity_id", StringType()),
        StructField("version", LongType()),
        StructField("type", StringType()),
        StructField("schema_version", IntegerType()),
        StructField("event_id", StringType()),
        StructField("correlation_id", StringType()),
        StructField("causation_id", StringType()),
        StructField("recorded_at", TimestampType()),
        StructField("payload", StringType()),
    ]
)
"""Columns of an events DataFrame (all nullable, as Spark reports data source columns).

``position`` is the commit's stream sequence and ``index`` the event's place in
it, so ``(position, index)`` is unique and orders events globally; ``stream_id``
is ``"Category/entity-id"``; ``version`` the entity's version after the event;
``recorded_at`` a UTC timestamp; ``payload`` the event's stored JSON.
"""

_DEFAULT_BATCH = 5000
_NS = 1_000_000_000
_GIVE_UP_S = 30.0  # how long a partition retries creating its consumer (server restarting)
_READ_SIZE = 256 * 1024  # bytes per socket read in a bulk read (asyncio reads at most this much at once)



class EventSourceError(SparkProjectionError):
    """The ``jetstream`` data source was misconfigured or could not read the stream."""


# -- options -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    url: str  # for messages: a password or token in it is shown as ***
    servers: tuple[str, ...]
    stream: str
    subject_prefix: str
    categories: tuple[str, ...]
    from_position: int
    to_position: int | None
    partitions: int
    batch: int
    request_timeout_s: float
    security: ConnectionSecurity

    @classmethod
    def parse(cls, options: Any) -> _Options:
        """Validate the reader options (Spark hands them over as a case-insensitive str map)."""
        opts = {str(k).lower(): str(v) for k, v in dict(options).items()}
        url = opts.get("url", "").strip()
        if not url:
            raise EventSourceError(
                "The jetstream data source needs the server URL: .option('url', 'nats://host:4222') "
                "(comma-separate several servers of a cluster)."
            )
        categories = tuple(c.strip() for c in opts.get("categories", "").split(",") if c.strip())
        try:
            for category in categories:
                validate_category(category)
        except Exception as exc:
            raise EventSourceError(f"Option 'categories': {exc}") from None
        from_position = _int_option(opts, "from_position", 1, minimum=1) or 1
        to_position = _int_option(opts, "to_position", None, minimum=0)
        given = {name: value for name, value in opts.items() if name in ConnectionSecurity.model_fields}
        try:
            security = ConnectionSecurity.model_validate(given)
            check_url_credentials(url, security)
        except ValidationError as exc:
            raise EventSourceError(f"Connection options: {_problems(exc)}") from None
        except ValueError as exc:
            raise EventSourceError(f"Connection options: {exc}") from None
        return cls(
            url=redact_url(url),
            servers=tuple(u.strip() for u in url.split(",")),
            stream=opts.get("stream", "EVENTS"),
            subject_prefix=opts.get("subject_prefix", "events"),
            categories=categories,
            from_position=from_position,
            to_position=to_position,
            partitions=_int_option(opts, "partitions", 1, minimum=1) or 1,
            batch=_int_option(opts, "batch", _DEFAULT_BATCH, minimum=1) or _DEFAULT_BATCH,
            request_timeout_s=float(opts.get("request_timeout_s", "5")),
            security=security,
        )

    @property
    def filter_subjects(self) -> list[str]:
        if not self.categories:
            return [f"{self.subject_prefix}.>"]
        return [f"{self.subject_prefix}.{c}.*" for c in self.categories]


def _problems(exc: ValidationError) -> str:
    """What a validation error says, without pydantic's boilerplate."""
    return " ".join(
        str(error["ctx"]["error"]) if "error" in error.get("ctx", {}) else f"{error['loc'][0]}: {error['msg']}."
        for error in exc.errors()
    )


def _int_option(opts: dict[str, str], name: str, default: int | None, *, minimum: int) -> int | None:
    text = opts.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise EventSourceError(f"Option {name!r} must be an integer, not {text!r}.") from None
    if value < minimum:
        raise EventSourceError(f"Option {name!r} must be at least {minimum}, not {value}.")
    return value


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
    must exist on the driver and on every executor). See the README's
    "Connecting to a secured server" for where secrets are safest.

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
        return _Reader(_Options.parse(self.options), _columns(schema))


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
    def __init__(self, options: _Options, columns: tuple[str, ...] = tuple(EVENTS_SCHEMA.fieldNames())) -> None:
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
        return _read_range(self.options, partition.start, partition.stop, self.columns)


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("jetstream")`` available in ``spark`` (idempotent)."""
    spark.dataSource.register(JetStreamDataSource)


def read_events(
    spark: SparkSession,
    settings: EventStoreSettings,
    *,
    categories: Sequence[str] | None = None,
    from_position: int = 1,
    to_position: int | None = None,
    partitions: int | None = None,
    batch: int = _DEFAULT_BATCH,
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
        raise EventSourceError(
            "read_events needs settings.nats_url (or NATS_URL): Spark executors must reach a running server."
        )
    register(spark)
    reader = (
        spark.read.format(FORMAT)
        .options(**_settings_options(settings))
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


def _settings_options(settings: EventStoreSettings) -> dict[str, str]:
    """The data source options that say where ``settings``' stream is and how to connect to it (secrets included)."""
    return {
        "url": settings.nats_url or "",
        "stream": settings.stream,
        "subject_prefix": settings.subject_prefix,
        "request_timeout_s": str(settings.request_timeout_s),
        **settings.as_options(),
    }


# -- reading one partition ----------------------------------------------------------------


async def _connect(opts: _Options, *, native: bool = True) -> _ReadConnection:
    nc = _ReadConnection(native=native)
    try:
        await nc.open(
            list(opts.servers),
            name="jetsourcing-spark",
            connect_timeout=max(1, round(opts.request_timeout_s)),
            max_reconnect_attempts=max(1, int(opts.request_timeout_s / 0.2)),
            reconnect_time_wait=0.2,
            allow_reconnect=True,
            **connect_options(opts.security),
        )
    except AuthenticationError as exc:
        raise EventSourceError(str(exc)) from exc  # it names the server and what to fix
    except Exception as exc:  # noqa: BLE001 - nats-py raises several unrelated types here
        raise EventSourceError(f"Could not connect to NATS at {opts.url}: {exc or type(exc).__name__}.") from exc
    return nc


async def stream_bounds(settings: EventStoreSettings) -> tuple[int, int]:
    """The (first, last) position of ``settings``' stream, asked from the server; (1, 0) when it is empty."""
    if settings.nats_url is None:
        raise EventSourceError("stream_bounds needs settings.nats_url (or NATS_URL).")
    return await _stream_bounds(_Options.parse(_settings_options(settings)))


async def _stream_bounds(opts: _Options) -> tuple[int, int]:
    """The stream's (first, last) sequence; (1, 0) when it is empty."""
    nc = await _connect(opts)
    try:
        reply = await nc.request(f"$JS.API.STREAM.INFO.{opts.stream}", b"", timeout=opts.request_timeout_s)
        info = json.loads(reply.data)
        if "error" in info:
            raise EventSourceError(
                f"Cannot read stream {opts.stream!r} at {opts.url}: {info['error'].get('description', info['error'])}. "
                "Check the 'stream' option (and that JetStream is enabled)."
            )
        state = info.get("state", {})
        return int(state.get("first_seq") or 1), int(state.get("last_seq") or 0)
    finally:
        await nc.close()


def _read_range(
    opts: _Options, start: int, stop: int, columns: Sequence[str] = tuple(EVENTS_SCHEMA.fieldNames())
) -> Iterator[pa.RecordBatch]:
    """Yield the events of sequences ``start..stop`` as Arrow batches of ``columns``."""
    converter = _Converter(opts.subject_prefix, columns)
    for parts in _range_parts(opts, start, stop):
        yield from converter.convert_parts(parts)


def _range_parts(opts: _Options, start: int, stop: int, *, native: bool = True) -> Iterator[list[_Part]]:
    """:func:`_pull`'s batches for synchronous callers (Spark's ``read()``), driving a private event loop."""
    loop = asyncio.new_event_loop()
    pulled = _pull(opts, start, stop, native=native)
    # A read allocates millions of short-lived acyclic objects: collecting every 700
    # allocations (the default) costs about 10% of it for nothing.
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], 100_000), thresholds[1], thresholds[2])
    try:
        while True:
            try:
                yield loop.run_until_complete(pulled.__anext__())
            except StopAsyncIteration:
                break
    finally:
        gc.set_threshold(*thresholds)
        loop.run_until_complete(pulled.aclose())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _pull(opts: _Options, start: int, stop: int, *, native: bool = True) -> AsyncGenerator[list[_Part], None]:
    """The range's commits in batches; ``native=False`` frames every message in Python."""
    nc = await _connect(opts, native=native)
    try:
        async for parts in _RangePull(nc, opts, start, stop).batches():
            yield parts
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


@dataclass
class _Commits:
    """Stored commits as read, column by column: stream sequences, subjects, header blocks, bodies."""

    positions: list[int] = field(default_factory=list)
    subjects: list[bytes] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)

    def extend(self, other: _Commits) -> None:
        self.positions += other.positions
        self.subjects += other.subjects
        self.headers += other.headers
        self.bodies += other.bodies

    def position_list(self) -> Sequence[int]:
        return self.positions

    def head(self, keep: int) -> _Commits:
        """The first ``keep`` commits."""
        return _Commits(self.positions[:keep], self.subjects[:keep], self.headers[:keep], self.bodies[:keep])

    def where(self, i: int) -> str:
        """Where commit ``i`` is stored, for error messages."""
        return f"position {self.positions[i]} on {self.subjects[i].decode(errors='replace')}"


# Columns of the native scanner's views, in its order (see _frames.c).
(_SUBJECT, _TYPE_COLUMN, _SCHEMA_COLUMN, _EVENT_ID_COLUMN, _VERSION_COLUMN, _RECORDED_COLUMN, _CORRELATION_COLUMN,
 _CAUSATION_COLUMN, _PAYLOAD, _CATEGORY, _ENTITY) = range(11)
_VIEW = 16  # bytes of one Arrow binary view


class _Frames:
    """Commits framed by the native scanner: Arrow binary views into the bytes they arrived in.

    ``spark_projections/_frames.c`` checks each frame (our subscription and
    consumer, consecutive consumer sequences, the five required ``Es-*``
    headers once each) and cuts out the subject, the header values and the
    body without copying them; the Python path handles any other frame.
    """

    __slots__ = ("data", "count", "first_dseq", "last_dseq", "pending", "several", "positions", "views", "present")
    # present: (correlation, causation) bytes, 1 where a commit has that optional header

    def __init__(
        self, data: bytes, count: int, first_dseq: int, last_dseq: int, pending: int, several: bool,
        positions: bytes, views: tuple[bytes, ...], present: tuple[bytes, bytes],
    ) -> None:
        self.data = data
        self.count = count
        self.first_dseq = first_dseq
        self.last_dseq = last_dseq
        self.pending = pending
        self.several = several  # some commit holds several events
        self.positions = positions
        self.views = views  # per column (see the constants above), 16 bytes per commit
        self.present = present

    @classmethod
    def scan(
        cls, data: bytes, pos: int, sid: bytes, ack_prefix: bytes, subject_prefix: bytes
    ) -> tuple[int, _Frames | None]:
        """Frame the run of our messages at ``data[pos:]``: (where it ends, the frames, or None when there are none)."""
        end, count, first, last, pending, several, positions, views, correlation, causation = _frames.scan(
            data, pos, sid, ack_prefix, subject_prefix
        )
        if not count:
            return pos, None
        return end, cls(data, count, first, last, pending, bool(several), positions, views, (correlation, causation))

    def __len__(self) -> int:
        return self.count

    def head(self, keep: int) -> _Frames:
        """The first ``keep`` commits."""
        return _Frames(self.data, keep, self.first_dseq, self.first_dseq + keep - 1, self.pending,
                       self.several, self.positions, self.views, self.present)

    def position_list(self) -> Sequence[int]:
        return memoryview(self.positions).cast("q")[: self.count]

    def view_bytes(self, c: int) -> memoryview:
        """The binary views of column ``c`` (see the constants above), 16 bytes per commit."""
        return memoryview(self.views[c])[: self.count * _VIEW]

    def where(self, i: int) -> str:
        """Where commit ``i`` is stored, for error messages."""
        subject = _views_column([self], _SUBJECT)[i].as_py()
        return f"position {self.position_list()[i]} on {subject.decode(errors='replace')}"


def _views_column(runs: Sequence[_Frames], c: int) -> pa.Array:
    """Column ``c`` of several runs as one binary-view array over their received bytes (no copy of the values)."""
    views = bytearray(b"".join(run.view_bytes(c) for run in runs))
    if len(runs) > 1:
        # Each run's views point into its own bytes (buffer 0): renumber them to buffer i for run i.
        table = np.frombuffer(views, dtype=np.int32).reshape(-1, 4)
        run_of_row = np.repeat(np.arange(len(runs), dtype=np.int32), [run.count for run in runs])
        outlined = table[:, 0] > 12  # longer values live in the buffer; shorter ones inside the view
        table[outlined, 2] = run_of_row[outlined]
    buffers = [None, pa.py_buffer(views), *(pa.py_buffer(run.data) for run in runs)]
    return pa.Array.from_buffers(pa.binary_view(), len(views) // _VIEW, buffers)


def _present(runs: Sequence[_Frames], which: int) -> pa.Array:
    """Whether each commit of ``runs`` has the optional header ``which`` (0 correlation, 1 causation id)."""
    return pa.array(np.frombuffer(b"".join(run.present[which][: run.count] for run in runs), dtype=np.bool_))


def _where_in(runs: Sequence[_Frames], i: int) -> str:
    """:meth:`_Frames.where` for commit ``i`` of several runs taken together."""
    if i < 0:
        i += sum(run.count for run in runs)
    for run in runs:
        if i < run.count:
            return run.where(i)
        i -= run.count
    raise IndexError(i)


_Part: TypeAlias = _Commits | _Frames
"""What a drained batch holds: commits framed in Python (lists) or natively (views)."""


# Header values as the writer lays them out ("Name: value" lines after "NATS/1.0").
def _header_re(name: str) -> re.Pattern[bytes]:
    return re.compile(rb"\r\n" + re.escape(name.encode()) + rb":[ \t]*([^\r]*)")


_TYPE = _header_re("Es-Type")
_SCHEMA_VERSION = _header_re("Es-Schema-Version")
_EVENT_ID = _header_re("Es-Event-Id")
_VERSION = _header_re("Es-Version")
_RECORDED_AT = _header_re("Es-Recorded-At")
_CORRELATION_ID = _header_re("Es-Correlation-Id")
_CAUSATION_ID = _header_re("Es-Causation-Id")
_SEPARATOR = b"\r\n\x00"  # between header blocks: no header value can span it
_OTHER_HEADERS = frozenset({"schema_version", "event_id", "version", "recorded_at"})
# The five required headers in the order eventstore.wire.encode_commit writes them: one
# pass over a batch's headers instead of five. Any other layout takes the slower path.
_WRITER_LAYOUT = re.compile(
    rb"\r\nEs-Type: ([^\r]*)\r\nEs-Schema-Version: ([^\r]*)\r\nEs-Event-Id: ([^\r]*)"
    rb"\r\nEs-Version: ([^\r]*)\r\nEs-Recorded-At: ([^\r]*)"
)


_Values: TypeAlias = "Sequence[bytes] | pa.Array"


@dataclass
class _Fields:
    """One batch's commits as per-commit raw values, however they were framed; columns are built when asked for."""

    positions: pa.Array
    several: bool  # some commit holds several events
    types: Callable[[], _Values]
    schemas: Callable[[], _Values]
    event_ids: Callable[[], _Values]
    versions: Callable[[], _Values]
    recorded: Callable[[], _Values]
    bodies: Callable[[], _Values]
    streams: Callable[[], tuple[pa.Array, pa.Array]]  # (category, entity token) columns
    correlation: Callable[[], pa.Array]
    causation: Callable[[], pa.Array]
    where: Callable[[int], str]  # "position N on <subject>" of commit i, for error messages


class _Converter:
    """Turns pulled commits into one Arrow record batch of events, with Arrow kernels wherever possible."""

    def __init__(self, prefix: str, columns: Sequence[str] = tuple(EVENTS_SCHEMA.fieldNames())) -> None:
        self._prefix = prefix + "."
        fields = {f.name: f for f in EVENTS_SCHEMA.fields}
        self._schema = to_arrow_schema(StructType([fields[c] for c in columns]), timezone="UTC")
        self._want = set(columns)

    def convert(self, commits: _Commits) -> pa.RecordBatch:
        """One row per event of ``commits`` (in order), with the converter's columns of :data:`EVENTS_SCHEMA`."""
        count = len(commits)
        blocks = commits.headers
        blob = _SEPARATOR.join(blocks)

        def fields(types: list[bytes], schemas: list[bytes] = [], event_ids: list[bytes] = [],  # noqa: B006
                   versions: list[bytes] = [], recorded: list[bytes] = []) -> _Fields:  # noqa: B006 - never mutated
            return _Fields(
                pa.array(commits.positions, pa.int64()), b"," in b"".join(types), lambda: types, lambda: schemas,
                lambda: event_ids, lambda: versions, lambda: recorded, lambda: commits.bodies,
                lambda: self._split_subjects(commits.subjects, commits.where),
                lambda: _optional(_CORRELATION_ID, b"\r\nEs-Correlation-Id:", blob, blocks),
                lambda: _optional(_CAUSATION_ID, b"\r\nEs-Causation-Id:", blob, blocks),
                commits.where,
            )

        if not self._want & _OTHER_HEADERS:
            # Only the type is wanted: one cheap search, unless some commit holds several events.
            types = _TYPE.findall(blob)
            if len(types) == count and b"," not in b"".join(types):
                return self._build(fields(types), count)
        found = _WRITER_LAYOUT.findall(blob)
        if len(found) == count:
            types, schemas, event_ids, versions, recorded = (list(column) for column in zip(*found))
        else:  # headers in another order (another writer): one search per header
            types = _TYPE.findall(blob)
            schemas = _SCHEMA_VERSION.findall(blob)
            event_ids = _EVENT_ID.findall(blob)
            versions = _VERSION.findall(blob)
            recorded = _RECORDED_AT.findall(blob)
            if not (len(types) == len(schemas) == len(event_ids) == len(versions) == len(recorded) == count):
                _raise_malformed(commits)
        return self._build(fields(types, schemas, event_ids, versions, recorded), count)

    def convert_parts(self, parts: Sequence[_Part]) -> Iterator[pa.RecordBatch]:
        """One batch per run of parts framed the same way (natively, or in Python), in order."""
        for native, run in itertools.groupby(parts, key=lambda part: isinstance(part, _Frames)):
            if native:
                yield self.convert_frames([part for part in run if isinstance(part, _Frames)])
            else:
                commits = _Commits()
                for part in run:
                    if isinstance(part, _Commits):
                        commits.extend(part)
                yield self.convert(commits)

    def convert_frames(self, runs: Sequence[_Frames]) -> pa.RecordBatch:
        """The same batch from natively framed commits (their header values are already cut out)."""

        def column(c: int) -> Callable[[], pa.Array]:
            return lambda: _views_column(runs, c)

        def optional(c: int) -> Callable[[], pa.Array]:
            def build() -> pa.Array:
                present = _present(runs, c - _CORRELATION_COLUMN)
                if not pc.any(present).as_py():
                    return pa.nulls(len(present), pa.string())
                return pc.if_else(present, _text(_views_column(runs, c)), pa.scalar(None, pa.string()))

            return build

        joined = b"".join(memoryview(run.positions)[: run.count * 8] for run in runs)
        positions = pa.Array.from_buffers(pa.int64(), len(joined) // 8, [None, pa.py_buffer(joined)])
        return self._build(
            _Fields(
                positions, any(run.several for run in runs), column(_TYPE_COLUMN), column(_SCHEMA_COLUMN),
                column(_EVENT_ID_COLUMN), column(_VERSION_COLUMN), column(_RECORDED_COLUMN), column(_PAYLOAD),
                lambda: (_views_column(runs, _CATEGORY), _views_column(runs, _ENTITY)),
                optional(_CORRELATION_COLUMN), optional(_CAUSATION_COLUMN), lambda i: _where_in(runs, i),
            ),
            len(positions),
        )

    def _build(self, fields: _Fields, count: int) -> pa.RecordBatch:
        want = self._want
        columns: dict[str, pa.Array] = {"position": fields.positions}
        several = fields.several
        if want & {"stream_id", "category", "entity_id"}:
            categories, tokens = fields.streams()
            if want & {"stream_id", "entity_id"}:
                columns["entity_id"] = _unescape(_text(tokens))
            if want & {"stream_id", "category"}:
                columns["category"] = _text(categories)
            if "stream_id" in want:
                columns["stream_id"] = pc.binary_join_element_wise(columns["category"], columns["entity_id"], "/")
        if "version" in want or several:
            columns["last_version"] = _ints(fields.versions(), pa.int64(), fields.where)
        if "correlation_id" in want:
            columns["correlation_id"] = fields.correlation()
        if "causation_id" in want:
            columns["causation_id"] = fields.causation()
        if "recorded_at" in want:
            columns["recorded_at"] = _timestamps(fields.recorded(), fields.where)
        if several:
            return self._batch(_expand(columns, fields), count)
        # One event per commit (the common case): every column is per commit already.
        if "type" in want:
            columns["type"] = _text(fields.types())
        if "schema_version" in want:
            columns["schema_version"] = _ints(fields.schemas(), pa.int32(), fields.where)
        if "event_id" in want:
            columns["event_id"] = _text(fields.event_ids())
        if "payload" in want:
            columns["payload"] = _text(fields.bodies())
        return self._batch(columns, count)

    def _batch(self, columns: dict[str, pa.Array], count: int) -> pa.RecordBatch:
        if "version" in self._want and "version" not in columns:
            columns["version"] = columns["last_version"]
        if "index" in self._want and "index" not in columns:
            columns["index"] = pa.repeat(pa.scalar(0, pa.int32()), count)
        return pa.RecordBatch.from_arrays([columns[f.name] for f in self._schema], schema=self._schema)

    def _split_subjects(self, raw: Sequence[bytes], where: Callable[[int], str]) -> tuple[pa.Array, pa.Array]:
        """(category, entity token) columns from ``<prefix>.<Category>.<entity token>`` subjects."""
        subjects = _text(raw)
        prefix = self._prefix
        parts = pc.split_pattern(pc.utf8_slice_codeunits(subjects, len(prefix)), pattern=".", max_splits=1)
        valid = pc.and_(pc.starts_with(subjects, prefix), pc.equal(pc.list_value_length(parts), 2))
        if not pc.all(valid).as_py():
            bad = pc.index(valid, False).as_py()
            raise EventDecodeError(
                f"Subject {subjects[bad].as_py()!r} is not an event subject under {prefix[:-1]!r}."
            )
        return pc.list_element(parts, 0), pc.list_element(parts, 1)


def _unescape(tokens: pa.Array) -> pa.Array:
    """Entity ids from subject tokens: %XX escapes (see eventstore.streams) decoded one by one."""
    escaped = pc.match_substring(tokens, "%")
    if not pc.any(escaped).as_py():
        return tokens
    decoded = [unquote(token) for token in pc.filter(tokens, escaped).to_pylist()]
    return pc.replace_with_mask(tokens, escaped, pa.array(decoded, pa.string()))


def _expand(commit: dict[str, pa.Array], fields: _Fields) -> dict[str, pa.Array]:
    """Columns with one row per event when some commits hold several (lists split by Arrow kernels)."""
    type_lists = pc.split_pattern(_binary(fields.types()), pattern=b",")
    lengths = pc.list_value_length(type_lists)
    split: dict[str, pa.Array] = {}
    for name, values, separator in (("schema versions", fields.schemas(), b","), ("event ids", fields.event_ids(), b","),
                                    ("body lines", fields.bodies(), b"\n")):
        lists = pc.split_pattern(_binary(values), pattern=separator)
        same = pc.equal(pc.list_value_length(lists), lengths)
        if not pc.all(same).as_py():
            bad = pc.index(same, False).as_py()
            raise EventDecodeError(
                f"Malformed commit at {fields.where(bad)}: its {name} do not match its "
                f"{lengths[bad].as_py()} event types."
            )
        split[name] = pc.list_flatten(lists)
    parent = pc.list_parent_indices(type_lists)
    # A commit's events are rows offsets[c] .. offsets[c+1]-1; index = row - offsets[c].
    first_row = pc.take(type_lists.offsets.cast(pa.int64()), parent)
    index = pc.subtract(pa.array(range(len(parent)), pa.int64()), first_row)
    # Es-Version is the version after the commit's last event.
    version = pc.add(pc.subtract(pc.take(commit["last_version"], parent), pc.take(lengths.cast(pa.int64()), parent)),
                     pc.add(index, 1))
    out = {name: pc.take(array, parent) for name, array in commit.items()}
    out.update(
        {
            "index": index.cast(pa.int32()),
            "version": version,
            "type": _text(pc.list_flatten(type_lists)),
            "schema_version": _ints(split["schema versions"], pa.int32(), fields.where),
            "event_id": _text(split["event ids"]),
            "payload": _text(split["body lines"]),
        }
    )
    return out


def _binary(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    """Plain binary (not views: not every kernel takes them) from bytes or an Arrow array."""
    return values.cast(pa.binary()) if isinstance(values, pa.Array) else pa.array(values, pa.binary())


def _text(values: Sequence[bytes | None] | pa.Array) -> pa.Array:
    """UTF-8 text from bytes (the cast validates the encoding)."""
    if isinstance(values, pa.Array):
        return values if values.type == pa.string() else values.cast(pa.string())
    return pa.array(values, pa.binary()).cast(pa.string())


def _ints(values: Sequence[bytes] | pa.Array, arrow_type: pa.DataType, where: Callable[[int], str]) -> pa.Array:
    try:
        return _text(values).cast(arrow_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise EventDecodeError(
            f"A commit between {where(0)} and {where(-1)} carries a malformed version header: {exc}"
        ) from exc


def _timestamps(values: Sequence[bytes] | pa.Array, where: Callable[[int], str]) -> pa.Array:
    try:
        return _text(values).cast(pa.timestamp("us", tz="UTC"))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise EventDecodeError(
            f"A commit between {where(0)} and {where(-1)} carries a malformed Es-Recorded-At header: {exc}"
        ) from exc


def _optional(pattern: re.Pattern[bytes], name: bytes, blob: bytes, blocks: Sequence[bytes]) -> pa.Array:
    if name not in blob:  # a substring test is much cheaper than the regular expression
        return pa.nulls(len(blocks), pa.string())
    values = []
    for block in blocks:
        found = pattern.search(block)
        values.append(found.group(1) if found else None)
    return _text(values)


def _raise_malformed(commits: _Commits) -> None:
    required = ((_TYPE, "Es-Type"), (_SCHEMA_VERSION, "Es-Schema-Version"), (_EVENT_ID, "Es-Event-Id"),
                (_VERSION, "Es-Version"), (_RECORDED_AT, "Es-Recorded-At"))
    for i, headers in enumerate(commits.headers):
        for pattern, name in required:
            if len(pattern.findall(headers)) != 1:
                raise EventDecodeError(
                    f"Message at {commits.where(i)} lacks a single {name} header: it was not written by "
                    "jetsourcing. Keep foreign messages off the event subjects."
                )


# -- the wire-level range reader -----------------------------------------------------------------


class _RangePull:
    """Every message of stream sequences ``start..stop`` matching the filters, in order, exactly once.

    The same protocol as the event store's :class:`~eventstore.OrderedPull`
    (an ephemeral, unacknowledged consumer; two pull requests in flight; the
    consumer's delivery sequence checked on every message; after a gap, a
    deleted consumer, missed heartbeats or a lost connection, a new consumer
    starting right after the last message handed over), but it takes whole
    chunks of raw messages from its :class:`_Inbox` and checks their reply
    subjects with a few bytes operations per chunk. Bounded reads only.
    """

    def __init__(self, nc: _ReadConnection, opts: _Options, start: int, stop: int) -> None:
        self._nc = nc
        self._opts = opts
        self.next_seq = start
        self._stop = stop
        self._wake = asyncio.Event()
        self._inbox = _Inbox(self._arrived, opts.subject_prefix)
        self._consumer = b""
        self._last_dseq = 0
        self._pending: int | None = None
        self._requests: deque[int] = deque()
        self._reset = False
        self._last_activity = time.monotonic()
        self._heartbeat_s = 1.0
        self._subject = ""

    def _arrived(self) -> None:
        self._last_activity = time.monotonic()
        self._wake.set()

    async def batches(self) -> AsyncIterator[list[_Part]]:
        """Yield the commits of the range in order, in batches of about ``batch`` commits or more."""
        nc = self._nc
        sub = await nc.subscribe(nc.new_inbox())  # no callback: the connection routes to self._inbox
        nc.route(sub._id, self._inbox)
        self._subject = sub.subject
        try:
            await self._create_consumer()
            # Hand over big batches: every batch costs a few fixed Arrow and Spark calls.
            least = max(1, self._opts.batch // 2)
            out: list[_Part] = []
            held = 0
            while True:
                for part in self._drain():
                    out.append(part)
                    held += len(part)
                if self._finished():
                    if out:
                        yield out
                    return
                if held >= least:
                    yield out
                    out, held = [], 0
                    self._resumed()
                    continue
                if self._reset or time.monotonic() - self._last_activity > self._heartbeat_s * 3:
                    await self._create_consumer()
                    continue
                try:
                    while len(self._requests) < 2 and self._request_size() > 0:
                        await self._request_more()
                except Exception:  # noqa: BLE001 - disconnected: the staleness check resets the consumer
                    self._requests.clear()
                self._wake.clear()
                if not self._inbox:
                    try:
                        await asyncio.wait_for(self._wake.wait(), self._heartbeat_s)
                    except asyncio.TimeoutError:
                        if out:  # a slow trickle: do not sit on what arrived
                            yield out
                            out, held = [], 0
                            self._resumed()
        finally:
            nc.unroute(sub._id)
            if self._consumer and not nc.is_closed:
                await _quiet_publish(nc, f"$JS.API.CONSUMER.DELETE.{self._opts.stream}.{self._consumer.decode()}")
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _resumed(self) -> None:
        # While the caller held a batch, this loop did not run and nothing could arrive:
        # that pause must not count as missed heartbeats.
        self._last_activity = max(self._last_activity, time.monotonic())

    def _drain(self) -> list[_Part]:
        """What arrived, checked and cut at the range's end, in order; empty after a gap (the consumer is reset)."""
        parts, statuses = self._inbox.take()
        for status in statuses:
            self._on_status(status)
        out: list[_Part] = []
        for part in parts:
            if self._reset:
                break
            if isinstance(part, _Frames):
                # The scanner checked the consumer and that the run's sequences follow each other.
                self._settle(part.count)
                if part.first_dseq != self._last_dseq + 1:
                    self._reset = True  # a gap: continue from the last message handed over
                    break
                self._last_dseq = part.last_dseq
                self._pending = part.pending
                positions = part.position_list()
                drained: _Part = part
            else:
                drained = self._drain_rows(part)
                positions = drained.position_list()
            if not len(drained):
                continue
            if positions[-1] > self._stop:
                keep = bisect.bisect_right(positions, self._stop)
                drained = drained.head(keep)
                self.next_seq = self._stop + 1
                if keep:
                    out.append(drained)
                break
            self.next_seq = positions[-1] + 1
            out.append(drained)
        return out

    def _drain_rows(self, rows: list[_Raw]) -> _Commits:
        subjects, replies, headers, bodies = (list(column) for column in zip(*rows))
        count = len(replies)
        # Every reply is "$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.
        # <pending>": with our consumer's prefix cut off, five numbers each, split in one go.
        joined = b"\n".join(replies)
        prefix = b"$JS.ACK." + self._opts.stream.encode() + b"." + self._consumer + b"."
        numbers = joined.replace(prefix, b"").replace(b"\n", b".").split(b".")
        last = self._last_dseq
        if (
            joined.count(prefix) == count
            and len(numbers) == 5 * count
            and int(numbers[2]) == last + 1
            and int(numbers[-3]) == last + count  # a consumer delivers its sequence in order, without repeats
        ):
            self._last_dseq = last + count
            self._pending = int(numbers[-1])
            commits = _Commits(list(map(int, numbers[1::5])), subjects, headers, bodies)
        else:
            commits = self._drain_one_by_one(subjects, replies, headers, bodies)
        self._settle(count)
        return commits

    def _drain_one_by_one(
        self, subjects: list[bytes], replies: list[bytes], headers: list[bytes], bodies: list[bytes]
    ) -> _Commits:
        """The careful path: another reply layout, a late message of an old consumer, or a gap."""
        out = _Commits()
        for subject, reply, block, body in zip(subjects, replies, headers, bodies):
            # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>, or the v2 form
            # with <domain>.<account hash> after ACK and a random token at the end.
            tokens = reply.split(b".")
            base = 2 if len(tokens) == 9 else 4
            if len(tokens) < base + 7 or tokens[base + 1] != self._consumer:
                continue  # not ours: a previous consumer's late message
            dseq = int(tokens[base + 4])
            if dseq != self._last_dseq + 1:
                self._reset = True  # a gap: continue from the last message handed over
                break
            self._last_dseq = dseq
            self._pending = int(tokens[base + 6])
            out.positions.append(int(tokens[base + 3]))
            out.subjects.append(subject)
            out.headers.append(block)
            out.bodies.append(body)
        return out

    def _settle(self, delivered: int) -> None:
        """Count delivered messages against the pull requests in flight, oldest first."""
        requests = self._requests
        while delivered and requests:
            taken = min(delivered, requests[0])
            delivered -= taken
            requests[0] -= taken
            if requests[0] <= 0:
                requests.popleft()

    def _on_status(self, headers: bytes) -> None:
        # "NATS/1.0 408 Request Timeout\r\n..."; 100 is an idle heartbeat: the consumer is alive.
        line = headers.split(b"\r\n", 1)[0]
        status = line[9:12]
        if status in (b"404", b"408", b"409"):
            if self._requests:
                self._requests.popleft()
            if status == b"409" and (b"Deleted" in line or b"Leadership" in line):
                self._reset = True
        elif status == b"503":  # no responders: the consumer is gone (deleted, or the server restarted)
            self._reset = True

    def _finished(self) -> bool:
        return self.next_seq > self._stop or self._pending == 0

    def _request_size(self) -> int:
        # Never ask for more than the range can still hold: a partition's consumer
        # would otherwise stream the next partition's messages only to drop them.
        room = self._stop - self.next_seq + 1 - sum(self._requests)
        return min(self._opts.batch, room)

    async def _request_more(self) -> None:
        size = self._request_size()
        body = {"batch": size, "expires": int(max(self._heartbeat_s * 5, 2.0) * _NS),
                "idle_heartbeat": int(self._heartbeat_s * _NS)}
        self._requests.append(size)
        await self._nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self._opts.stream}.{self._consumer.decode()}",
            json.dumps(body).encode(), reply=self._subject,
        )

    async def _create_consumer(self) -> None:
        if self._consumer and not self._nc.is_closed:
            # Fire and forget: an inactive consumer also expires by itself.
            name = self._consumer.decode()
            asyncio.ensure_future(_quiet_publish(self._nc, f"$JS.API.CONSUMER.DELETE.{self._opts.stream}.{name}"))
        self._consumer = b""
        self._inbox.ack_prefix = b""  # the native scanner leaves an old consumer's messages to the careful path
        opts = self._opts
        try:
            name, info = await create_replay_consumer(
                self._nc, opts.stream, self.next_seq, opts.filter_subjects,
                api_timeout_s=opts.request_timeout_s, give_up_s=_GIVE_UP_S,
            )
        except ServerUnavailableError as exc:
            raise EventSourceError(f"{exc} (server {opts.url})") from exc
        self._consumer = name.encode()
        self._last_dseq = 0
        pending = info.get("num_pending")
        self._pending = int(pending) if isinstance(pending, int) else None
        self._requests.clear()
        self._inbox.take()  # whatever is left belongs to the old consumer
        self._inbox.ack_prefix = b"$JS.ACK." + opts.stream.encode() + b"." + self._consumer + b"."
        self._reset = False
        self._last_activity = time.monotonic()


async def _quiet_publish(nc: _ReadConnection, subject: str) -> None:
    with contextlib.suppress(Exception):
        await nc.publish(subject, b"")


_Raw = tuple[bytes, "bytes | None", bytes, bytes]
"""A message off the wire: (subject, reply subject or None, header block, body)."""


class _Inbox:
    """Where a routed subscription's messages go, in arrival order: data messages in parts, status messages apart.

    A part is a run of natively framed commits (:class:`_Frames`) or a list
    of raw messages framed in Python. ``ack_prefix`` is the reply-subject
    prefix of the current consumer's messages, which the native scanner takes.
    """

    __slots__ = ("parts", "statuses", "arrived", "ack_prefix", "subject_prefix")

    def __init__(self, arrived: Callable[[], None], subject_prefix: str = "") -> None:
        self.arrived = arrived
        self.parts: list[_Frames | list[_Raw]] = []
        self.statuses: list[bytes] = []
        self.ack_prefix = b""
        self.subject_prefix = (subject_prefix + ".").encode()  # event subjects: <prefix>.<Category>.<entity>

    def __bool__(self) -> bool:
        return bool(self.parts or self.statuses)

    def add(self, rows: list[_Raw]) -> None:
        """Take a chunk's messages (in order) and wake the reader."""
        data = [row for row in rows if row[1]]
        if len(data) < len(rows):  # status messages (no reply subject) among them
            self.statuses += [row[2] for row in rows if not row[1]]
        if data:
            last = self.parts[-1] if self.parts else None
            if isinstance(last, list):
                last += data
            else:
                self.parts.append(data)
        self.arrived()

    def add_frames(self, frames: _Frames) -> None:
        """Take a natively framed run (the caller wakes the reader)."""
        self.parts.append(frames)

    def take(self) -> tuple[list[_Frames | list[_Raw]], list[bytes]]:
        """Everything received so far (and forget it)."""
        taken = (self.parts, self.statuses)
        self.parts, self.statuses = [], []
        return taken


class _FastParser(Parser):
    """nats-py's protocol parser with a fast path for messages of routed subscriptions.

    MSG/HMSG control lines are read with a byte search and a split, and
    messages of a routed subscription go straight into its :class:`_Inbox` as
    raw bytes, with one wake-up call per chunk read from the socket. Other
    messages go through nats-py as usual; any other protocol line (PING, INFO,
    -ERR, ...) goes to the original parser.
    """

    async def parse(self, data: bytes = b"") -> None:
        if self.state != AWAITING_CONTROL_LINE:
            await super().parse(data)
            return
        buf: bytearray = self.buf
        received: dict[_Inbox, list[_Raw]] = {}
        view, pos = data, 0
        if buf:
            # A read mostly ends inside a message: copy that one message together and frame
            # the rest of the read in place, rather than copying the whole read behind it.
            taken = _completing(buf, data)
            if taken < 0:
                view = bytes(buf) + data  # the message needs more than this read (or is not one)
            else:
                head = bytes(buf) + data[:taken]
                end = await self._frame(head, 0, received)
                view, pos = (data, taken) if end == len(head) else (head[end:] + data[taken:], 0)
        pos = await self._frame(view, pos, received)
        buf[:] = view[pos:]  # what the next chunk completes (usually less than one message)
        for inbox, got in received.items():
            inbox.add(got)  # also wakes the reader for natively framed runs
        if buf and not (buf.startswith(b"HMSG ") or buf.startswith(b"MSG ")):
            await super().parse()

    async def _frame(self, view: bytes, pos: int, received: dict[_Inbox, list[_Raw]]) -> int:
        """Frame the complete messages of ``view[pos:]`` into ``received`` (or nats-py); where it stopped."""
        size = len(view)
        routes = self.nc._routes
        native = self.nc.native
        find = view.find
        rows: list[_Raw] = []
        routed_sid = None
        while pos < size:
            if native:
                framed = None
                for sid_bytes, box in routes.items():
                    if box.ack_prefix:
                        pos, framed = _Frames.scan(view, pos, sid_bytes or b"", box.ack_prefix, box.subject_prefix)
                        if framed is not None:
                            # Keep the arrival order: what Python framed before this run goes first.
                            earlier = received.pop(box, None)
                            if earlier:
                                box.add(earlier)
                            routed_sid = None
                            box.add_frames(framed)
                            received.setdefault(box, [])
                            break
                if pos >= size:
                    break
            # HMSG <subject> <sid> [reply-to] <header bytes> <total bytes>\r\n or
            # MSG <subject> <sid> [reply-to] <total bytes>\r\n
            if view.startswith(b"HMSG ", pos):
                eol = find(b"\r\n", pos)
                if eol < 0:
                    break  # an incomplete line
                parts = view[pos + 5 : eol].split(b" ")
                if len(parts) == 5:
                    subject, sid, reply, header_len, total_len = parts
                elif len(parts) == 4:
                    subject, sid, header_len, total_len = parts
                    reply = None
                else:
                    break  # malformed: the original parser reports it
                start = eol + 2
                split = start + int(header_len)
            elif view.startswith(b"MSG ", pos):
                eol = find(b"\r\n", pos)
                if eol < 0:
                    break
                parts = view[pos + 4 : eol].split(b" ")
                if len(parts) == 4:
                    subject, sid, reply, total_len = parts
                elif len(parts) == 3:
                    subject, sid, total_len = parts
                    reply = None
                else:
                    break
                start = split = eol + 2
            else:
                break  # another operation: the original parser's
            end = start + int(total_len)
            if end + 2 > size:
                break  # the message is not complete yet
            pos = end + 2
            if sid != routed_sid:
                inbox = routes.get(sid)
                if inbox is None:
                    routed_sid = None
                    headers = view[start:split] if split > start else None
                    await self.nc._process_msg(int(sid), subject, reply or b"", view[split:end], headers)
                    continue
                routed_sid = sid
                rows = received.setdefault(inbox, [])
            rows.append((subject, reply, view[start:split], view[split:end]))
        return pos


def _completing(buf: bytearray, data: bytes) -> int:
    """How many bytes of ``data`` complete the message begun in ``buf``; -1 if they do not, or it is none."""
    eol = buf.find(b"\r\n")
    if eol < 0:
        more = data.find(b"\r\n", 0, 4096)
        if more < 0:
            return -1
        line, eol = bytes(buf) + data[:more], len(buf) + more
    else:
        line = bytes(buf[:eol])
    op, _, rest = line.partition(b" ")
    parts = rest.split(b" ")
    if op not in (b"HMSG", b"MSG") or not parts[-1].isdigit():
        return -1
    taken = eol + 2 + int(parts[-1]) + 2 - len(buf)
    return taken if 0 <= taken <= len(data) else -1


class _ChunkReader(asyncio.StreamReader):
    """An asyncio stream reader that keeps the socket's reads as they came, for one reader that takes them all.

    ``asyncio.StreamReader`` copies every read into its buffer, and again out
    of it; a bulk read takes the bytes objects the socket returned instead
    (:meth:`take`). Installed on a connection's reader by changing its class
    (see :meth:`_ReadConnection._read_loop`), so the rest behaves as before.
    """

    _chunks: list[bytes]
    _held: int

    @classmethod
    def install(cls, reader: asyncio.StreamReader) -> _ChunkReader:
        reader.__class__ = cls
        assert isinstance(reader, _ChunkReader)
        reader._chunks, reader._held = [], 0
        return reader

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        chunk = data if type(data) is bytes else bytes(data)
        if not chunk:
            return
        self._chunks.append(chunk)
        self._held += len(chunk)
        state: Any = self  # asyncio's private flow-control fields, which typeshed does not declare
        state._wakeup_waiter()
        if state._transport is not None and not state._paused and self._held > 2 * state._limit:
            try:
                state._transport.pause_reading()
            except NotImplementedError:
                state._transport = None
            else:
                state._paused = True

    def at_eof(self) -> bool:
        return super().at_eof() and not self._chunks

    async def take(self) -> bytes:
        """Everything received since the last call (waits for something; empty at the end of the stream)."""
        state: Any = self
        while not (self._chunks or state._buffer):
            if state._exception is not None:
                raise state._exception
            if state._eof:
                return b""
            await state._wait_for_data("take")
        chunks, self._chunks, self._held = self._chunks, [], 0
        if state._buffer:  # what arrived before the install
            chunks.insert(0, bytes(state._buffer))
            state._buffer.clear()
        if state._paused:
            state._paused = False
            state._transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _ReadConnection(Connection):
    """The event store's NATS connection with routed subscriptions, for one task's bulk read.

    A routed subscription's messages go, unparsed, into an :class:`_Inbox`
    (see :class:`_FastParser`); everything else behaves as in nats-py.
    """

    def __init__(self, *, native: bool = True) -> None:
        super().__init__()
        self._routes: dict[bytes | None, _Inbox] = {}
        self._ps = _FastParser(self)
        self.native = native and _frames is not None

    def route(self, sid: int, inbox: _Inbox) -> None:
        """Deliver the messages of subscription ``sid`` into ``inbox``."""
        self._routes[str(sid).encode()] = inbox

    def unroute(self, sid: int) -> None:
        """Stop routing subscription ``sid``."""
        self._routes.pop(str(sid).encode(), None)

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
        # Messages the original parser handled (after a PING or INFO in the same chunk).
        inbox = self._routes.get(str(sid).encode())
        if inbox is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        inbox.add([(subject, reply, headers or b"", data)])

    async def _read_loop(self) -> None:
        """nats-py's read loop, taking whole socket reads (up to 256 KiB) as they came instead of 32 KiB copies.

        A bulk read then costs a quarter of the parser calls and wake-ups, and
        no copies (:class:`_ChunkReader`). The stream reader's limit (32 KiB,
        set by nats-py) is raised to match, or it would stop reading the socket
        at 64 KiB buffered.
        """
        reader = getattr(self._transport, "_io_reader", None)
        chunks: _ChunkReader | None = None
        if isinstance(reader, asyncio.StreamReader):
            reader._limit = max(reader._limit, _READ_SIZE)  # type: ignore[attr-defined] # private in typeshed
            if type(reader) is asyncio.StreamReader:  # not another transport's own reader
                chunks = _ChunkReader.install(reader)
        while True:
            try:
                if self.is_closed or self.is_reconnecting or self._transport is None:
                    break
                if self._transport.at_eof():
                    eof = errors.UnexpectedEOF()
                    await self._error_cb(eof)
                    await self._process_op_err(eof)
                    break
                data = await chunks.take() if chunks is not None else await self._transport.read(_READ_SIZE)
                await self._ps.parse(data)
            except errors.ProtocolError:
                await self._process_op_err(errors.ProtocolError())
                break
            except OSError as exc:
                await self._process_op_err(exc)
                break
            except asyncio.CancelledError:
                break
            except Exception as exc:  # noqa: BLE001 - as nats-py: log and stop reading
                logging.getLogger("nats.aio.client").error("nats: encountered error", exc_info=exc)
                break
