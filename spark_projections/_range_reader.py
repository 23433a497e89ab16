"""One partition's read: its own bulk-read connection and the event store's ordered replay of its range.

The replay (:class:`eventstore.jetstream.OrderedReplay`) hands each run of the
consumer's messages to the native scanner (``spark_projections/_frames.c``:
Arrow binary views into the received bytes) where it was built, and frames the
rest in Python; :mod:`spark_projections._batches` turns both into Arrow.

A lost server is waited out under the outage policy (:func:`eventstore.ride_out`):
the replay reconnects by itself for a few seconds; past that, each failure is
logged by state and the range goes on, over a new replay, after the last
position already handed over, so every event of the range is yielded once. A
batch read gives up after :data:`BATCH_OUTAGE_LIMIT_S`; a streaming read after
its ``outage_limit_s`` (None: never).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence

import pyarrow as pa

from eventstore import AuthenticationError, ServerUnavailableError, ride_out
from eventstore.jetstream import BulkConnection, NativeRun, OrderedReplay, SharedConnection
from eventstore.jetstream import Part as ReplayPart
from spark_projections._batches import EVENTS_SCHEMA, NATIVE, Converter, Frames, Part
from spark_projections._options import Options
from spark_projections._outage import gave_up, is_outage, worker_logger
from spark_projections.errors import EventSourceError

BATCH_OUTAGE_LIMIT_S = 30.0
"""How long a batch read (``spark.read``: rebuild, update) waits out a lost server before it fails."""


async def open_connection(opts: Options) -> BulkConnection:
    """A bulk-read connection to the source's servers, or :class:`EventSourceError` saying what failed."""
    try:
        return await BulkConnection.open(
            list(opts.servers), opts.security, deadline_s=opts.request_timeout_s, name="jetsourcing-spark"
        )
    except (AuthenticationError, ServerUnavailableError) as exc:
        raise EventSourceError(str(exc)) from exc  # it names the server and what to fix
    except ValueError as exc:  # a credentials file that cannot be read here
        raise EventSourceError(f"Could not connect to NATS at {opts.url}: {exc}") from exc

def read_range(
    opts: Options,
    start: int,
    stop: int,
    columns: Sequence[str] = tuple(EVENTS_SCHEMA.fieldNames()),
    *,
    outage_limit_s: float | None = BATCH_OUTAGE_LIMIT_S,
) -> Iterator[pa.RecordBatch]:
    """Yield the events of sequences ``start..stop`` as Arrow batches of ``columns``, each once, waiting out an
    outage for ``outage_limit_s`` (None: for ever)."""
    converter = Converter(opts.subject_prefix, columns)
    for parts in range_parts(opts, start, stop, outage_limit_s=outage_limit_s):
        yield from converter.convert_parts(parts)


def range_parts(
    opts: Options, start: int, stop: int, *, native: bool = True, outage_limit_s: float | None = BATCH_OUTAGE_LIMIT_S
) -> Iterator[list[Part]]:
    """:func:`pull`'s batches for synchronous callers (Spark's ``read()``), driving a private event loop."""
    loop = asyncio.new_event_loop()
    pulled = pull(opts, start, stop, native=native, outage_limit_s=outage_limit_s)
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


def range_replay(opts: Options, start: int, stop: int, connections: SharedConnection, *, native: bool = True) -> OrderedReplay:
    """The ordered replay of sequences ``start..stop`` over ``connections``; ``native=False`` frames in Python."""
    subject_prefix = (opts.subject_prefix + ".").encode()  # event subjects: <prefix>.<Category>.<entity>

    def scan(data: bytes, pos: int, sid: bytes, ack_prefix: bytes) -> tuple[int, NativeRun | None]:
        return Frames.scan(data, pos, sid, ack_prefix, subject_prefix)

    return OrderedReplay(
        connections.get, opts.stream, start_seq=start, stop_seq=stop, filter_subjects=opts.filter_subjects,
        # Its own retries cover a short loss; pull() waits out a longer one, logged, under the policy.
        batch=opts.batch, api_timeout_s=opts.request_timeout_s, give_up_s=opts.request_timeout_s,
        what=f"Reading positions {start}..{stop} of stream {opts.stream!r} at {opts.url}",
        scanner=scan if native and NATIVE else None,
    )


def connections(opts: Options) -> SharedConnection:
    """Where a partition's replay opens its bulk-read connection (again after a loss)."""
    return SharedConnection(lambda: list(opts.servers), opts.security, opts.request_timeout_s, "jetsourcing-spark")


async def pull(
    opts: Options, start: int, stop: int, *, native: bool = True, outage_limit_s: float | None = BATCH_OUTAGE_LIMIT_S
) -> AsyncGenerator[list[Part], None]:
    """The range's commits in batches, each once; ``native=False`` frames every message in Python. An outage is
    waited out for ``outage_limit_s`` (None: for ever) after the last batch handed over."""
    shared = connections(opts)
    what = f"Reading positions {start}..{stop} of stream {opts.stream!r} at {opts.url}"
    first = start  # where the replay (again, after an outage) starts: after the last position handed over
    batches: AsyncIterator[list[ReplayPart]] | None = None

    async def next_batch() -> list[ReplayPart]:
        nonlocal batches
        replay = batches
        if replay is None:
            replay = batches = range_replay(opts, first, stop, shared, native=native).batches()
        try:
            return await anext(replay)
        except Exception:
            batches = None  # a replay that raised is over; the next try starts another
            raise

    try:
        while first <= stop:
            try:
                parts = await ride_out(next_batch, what=what, logger=worker_logger(), transient=is_outage,
                                       limit_s=outage_limit_s)
            except StopAsyncIteration:
                return
            except (AuthenticationError, ServerUnavailableError, ValueError) as exc:
                if outage_limit_s is not None and is_outage(exc):
                    raise gave_up(exc, outage_limit_s) from exc
                raise EventSourceError(f"{exc} (server {opts.url})") from exc
            first = parts[-1].position_list()[-1] + 1
            yield parts  # type: ignore[misc] # the runs are the scanner's Frames
    finally:
        if isinstance(batches, AsyncGenerator):
            await batches.aclose()
        shared.close()
