"""One partition's read: its own bulk-read connection and the event store's ordered replay of its range.

The replay (:class:`eventstore.jetstream.OrderedReplay`) hands each run of the
consumer's messages to the native scanner (``spark_projections/_frames.c``:
Arrow binary views into the received bytes) where it was built, and frames the
rest in Python; :mod:`spark_projections._batches` turns both into Arrow.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator, Iterator, Sequence

import pyarrow as pa

from eventstore import AuthenticationError, ServerUnavailableError
from eventstore.jetstream import BulkConnection, NativeRun, OrderedReplay, SharedConnection
from spark_projections._batches import EVENTS_SCHEMA, NATIVE, Converter, Frames, Part
from spark_projections._options import Options
from spark_projections.errors import EventSourceError

_GIVE_UP_S = 30.0  # how long a partition retries creating its consumer (server restarting)


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
    opts: Options, start: int, stop: int, columns: Sequence[str] = tuple(EVENTS_SCHEMA.fieldNames())
) -> Iterator[pa.RecordBatch]:
    """Yield the events of sequences ``start..stop`` as Arrow batches of ``columns``."""
    converter = Converter(opts.subject_prefix, columns)
    for parts in range_parts(opts, start, stop):
        yield from converter.convert_parts(parts)


def range_parts(opts: Options, start: int, stop: int, *, native: bool = True) -> Iterator[list[Part]]:
    """:func:`pull`'s batches for synchronous callers (Spark's ``read()``), driving a private event loop."""
    loop = asyncio.new_event_loop()
    pulled = pull(opts, start, stop, native=native)
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
        batch=opts.batch, api_timeout_s=opts.request_timeout_s, give_up_s=_GIVE_UP_S,
        what=f"Reading positions {start}..{stop} of stream {opts.stream!r} at {opts.url}",
        scanner=scan if native and NATIVE else None,
    )


def connections(opts: Options) -> SharedConnection:
    """Where a partition's replay opens its bulk-read connection (again after a loss)."""
    return SharedConnection(lambda: list(opts.servers), opts.security, opts.request_timeout_s, "jetsourcing-spark")


async def pull(opts: Options, start: int, stop: int, *, native: bool = True) -> AsyncGenerator[list[Part], None]:
    """The range's commits in batches; ``native=False`` frames every message in Python."""
    shared = connections(opts)
    try:
        async for parts in range_replay(opts, start, stop, shared, native=native).batches():
            yield parts  # type: ignore[misc] # the runs are the scanner's Frames
    except (AuthenticationError, ServerUnavailableError, ValueError) as exc:
        raise EventSourceError(f"{exc} (server {opts.url})") from exc
    finally:
        shared.close()
