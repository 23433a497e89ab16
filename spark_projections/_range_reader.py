"""One partition's read: its own NATS connection, a wire-level parser, and the ordered pull of its range.

:class:`ReadConnection` is the event store's connection with *routed*
subscriptions: :class:`FastParser` hands each run of the consumer's messages to
the native scanner (or frames it in Python) straight into the subscription's
:class:`Inbox`, from socket reads taken whole (:class:`ChunkReader`).
:class:`RangePull` drives the consumer over the range and checks what arrives.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import gc
import json
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, SupportsIndex

import pyarrow as pa
from nats import errors
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from eventstore import (
    AuthenticationError,
    ServerUnavailableError,
    connect_options,
    create_replay_consumer,
    delete_consumer,
    delete_consumer_later,
)
from eventstore.connection import Connection
from eventstore.consumer import leader_has_message
from spark_projections._batches import EVENTS_SCHEMA, NATIVE, Commits, Converter, Frames, Part
from spark_projections._options import Options
from spark_projections.errors import EventSourceError

_NS = 1_000_000_000
_GIVE_UP_S = 30.0  # how long a partition retries creating its consumer (server restarting)
_READ_SIZE = 256 * 1024  # bytes per socket read in a bulk read (asyncio reads at most this much at once)


async def open_connection(opts: Options, *, native: bool = True) -> ReadConnection:
    nc = ReadConnection(native=native)
    try:
        await nc.open(
            list(opts.servers),
            deadline_s=opts.request_timeout_s,
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


async def pull(opts: Options, start: int, stop: int, *, native: bool = True) -> AsyncGenerator[list[Part], None]:
    """The range's commits in batches; ``native=False`` frames every message in Python."""
    nc = await open_connection(opts, native=native)
    try:
        async for parts in RangePull(nc, opts, start, stop).batches():
            yield parts
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


class RangePull:
    """Every message of stream sequences ``start..stop`` matching the filters, in order, exactly once.

    The same protocol as the event store's :class:`~eventstore.OrderedPull`
    (an ephemeral, unacknowledged consumer; two pull requests in flight; the
    consumer's delivery sequence checked on every message; after a gap, a
    deleted consumer, missed heartbeats or a lost connection, a new consumer
    starting right after the last message handed over), but it takes whole
    chunks of raw messages from its :class:`Inbox` and checks their reply
    subjects with a few bytes operations per chunk. Bounded reads only.
    """

    def __init__(self, nc: ReadConnection, opts: Options, start: int, stop: int) -> None:
        self._nc = nc
        self._opts = opts
        self.next_seq = start
        self._stop = stop
        self._wake = asyncio.Event()
        self._inbox = Inbox(self._arrived, opts.subject_prefix)
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

    async def batches(self) -> AsyncIterator[list[Part]]:
        """Yield the commits of the range in order, in batches of about ``batch`` commits or more."""
        nc = self._nc
        sub = await nc.subscribe(nc.new_inbox())  # no callback: the connection routes to self._inbox
        nc.route(sub._id, self._inbox)
        self._subject = sub.subject
        try:
            await self._create_consumer()
            # Hand over big batches: every batch costs a few fixed Arrow and Spark calls.
            least = max(1, self._opts.batch // 2)
            out: list[Part] = []
            held = 0
            while True:
                for part in self._drain():
                    out.append(part)
                    held += len(part)
                if self._finished():
                    if self.next_seq <= self._stop and await self._leader_has_more():
                        self._pending = None  # the consumer's replica lags the stream's leader: wait for it
                    else:
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
                await delete_consumer(nc, self._opts.stream, self._consumer.decode())
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _resumed(self) -> None:
        # While the caller held a batch, this loop did not run and nothing could arrive:
        # that pause must not count as missed heartbeats.
        self._last_activity = max(self._last_activity, time.monotonic())

    def _drain(self) -> list[Part]:
        """What arrived, checked and cut at the range's end, in order; empty after a gap (the consumer is reset)."""
        parts, statuses = self._inbox.take()
        for status in statuses:
            self._on_status(status)
        out: list[Part] = []
        for part in parts:
            if self._reset:
                break
            if isinstance(part, Frames):
                # The scanner checked the consumer and that the run's sequences follow each other.
                self._settle(part.count)
                if part.first_dseq != self._last_dseq + 1:
                    self._reset = True  # a gap: continue from the last message handed over
                    break
                self._last_dseq = part.last_dseq
                self._pending = part.pending
                positions = part.position_list()
                drained: Part = part
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

    def _drain_rows(self, rows: list[Raw]) -> Commits:
        subjects, replies, headers, bodies = (list(column) for column in zip(*rows))
        count = len(replies)
        # Every reply is "$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.
        # <pending>": with our consumer's prefix cut off, five numbers each, split in one go.
        joined = b"\n".join(replies)
        prefix = self._inbox.ack_prefix
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
            commits = Commits(list(map(int, numbers[1::5])), subjects, headers, bodies)
        else:
            commits = self._drain_one_by_one(subjects, replies, headers, bodies)
        self._settle(count)
        return commits

    def _drain_one_by_one(
        self, subjects: list[bytes], replies: list[bytes], headers: list[bytes], bodies: list[bytes]
    ) -> Commits:
        """The careful path: another reply layout, a late message of an old consumer, or a gap."""
        out = Commits()
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

    async def _leader_has_more(self) -> bool:
        """Whether the stream's leader has a message of the range the consumer says is not pending.

        On a replicated stream the server places the one-replica consumer on any
        replica, whose copy may lag the leader's: its "nothing pending" would
        end the range short.
        """
        seq = await leader_has_message(
            self._nc, self._opts.stream, self.next_seq, self._opts.filter_subjects,
            timeout_s=self._opts.request_timeout_s,
        )
        return seq is not None and seq <= self._stop

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
            delete_consumer_later(self._nc, self._opts.stream, name)
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


Raw = tuple[bytes, "bytes | None", bytes, bytes]
"""A message off the wire: (subject, reply subject or None, header block, body)."""


class Inbox:
    """Where a routed subscription's messages go, in arrival order: data messages in parts, status messages apart.

    A part is a run of natively framed commits (:class:`Frames`) or a list
    of raw messages framed in Python. ``ack_prefix`` is the reply-subject
    prefix of the current consumer's messages, which the native scanner takes.
    """

    __slots__ = ("parts", "statuses", "arrived", "ack_prefix", "subject_prefix")

    def __init__(self, arrived: Callable[[], None], subject_prefix: str = "") -> None:
        self.arrived = arrived
        self.parts: list[Frames | list[Raw]] = []
        self.statuses: list[bytes] = []
        self.ack_prefix = b""
        self.subject_prefix = (subject_prefix + ".").encode()  # event subjects: <prefix>.<Category>.<entity>

    def __bool__(self) -> bool:
        return bool(self.parts or self.statuses)

    def add(self, rows: list[Raw]) -> None:
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

    def add_frames(self, frames: Frames) -> None:
        """Take a natively framed run (the caller wakes the reader)."""
        self.parts.append(frames)

    def take(self) -> tuple[list[Frames | list[Raw]], list[bytes]]:
        """Everything received so far (and forget it)."""
        taken = (self.parts, self.statuses)
        self.parts, self.statuses = [], []
        return taken


class FastParser(Parser):
    """nats-py's protocol parser with a fast path for messages of routed subscriptions.

    MSG/HMSG control lines are read with a byte search and a split, and
    messages of a routed subscription go straight into its :class:`Inbox` as
    raw bytes, with one wake-up call per chunk read from the socket. Other
    messages go through nats-py as usual; any other protocol line (PING, INFO,
    -ERR, ...) goes to the original parser.
    """

    async def parse(self, data: bytes = b"") -> None:
        if self.state != AWAITING_CONTROL_LINE:
            await super().parse(data)
            return
        buf: bytearray = self.buf
        received: dict[Inbox, list[Raw]] = {}
        view, pos = data, 0
        if buf:
            # A read mostly ends inside a message: copy that one message together and frame
            # the rest of the read in place, rather than copying the whole read behind it.
            taken = completing(buf, data)
            if taken == _WHOLE_READ:
                buf += data  # all of it belongs to a message bigger than a read
                return
            if taken < 0:
                view = bytes(buf) + data  # the message needs more than this read (or is not one)
            else:
                head = bytes(buf) + data[:taken]
                end, _ = await self._frame(head, 0, received)
                view, pos = (data, taken) if end == len(head) else (head[end:] + data[taken:], 0)
        pos, foreign = await self._frame(view, pos, received)
        buf[:] = view[pos:]  # what the next chunk completes (usually less than one message)
        for inbox, got in received.items():
            inbox.add(got)  # also wakes the reader for natively framed runs
        if buf and (foreign or not (buf.startswith(b"HMSG ") or buf.startswith(b"MSG "))):
            await super().parse()

    async def _frame(self, view: bytes, pos: int, received: dict[Inbox, list[Raw]]) -> tuple[int, bool]:
        """Frame the complete messages of ``view[pos:]`` into ``received`` (or nats-py).

        Returns where it stopped, and whether that is a control line of another
        layout than the server's, for the original parser to take (or report).
        """
        size = len(view)
        routes = self.nc._routes
        native = self.nc.native
        find = view.find
        rows: list[Raw] = []
        routed_sid = None
        while pos < size:
            if native:
                framed = None
                for sid_bytes, box in routes.items():
                    if box.ack_prefix:
                        pos, framed = Frames.scan(view, pos, sid_bytes or b"", box.ack_prefix, box.subject_prefix)
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
                    return pos, True
                if not (header_len.isdigit() and total_len.isdigit()):
                    return pos, True
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
                    return pos, True
                if not total_len.isdigit():
                    return pos, True
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
        return pos, False


_WHOLE_READ = -2


def completing(buf: bytearray, data: bytes) -> int:
    """How many bytes of ``data`` complete the message begun in ``buf``.

    :data:`_WHOLE_READ` when the message needs all of ``data`` and more; -1 when
    it cannot tell (an incomplete control line) or ``buf`` holds no message.
    """
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
    if taken > len(data):
        return _WHOLE_READ
    return taken if taken >= 0 else -1


class ChunkReader(asyncio.StreamReader):
    """An asyncio stream reader that keeps the socket's reads as they came, for one reader that takes them all.

    ``asyncio.StreamReader`` copies every read into its buffer, and again out
    of it; a bulk read takes the bytes objects the socket returned instead
    (:meth:`take`). Installed on a connection's reader by changing its class
    (see :meth:`ReadConnection._read_loop`), so the rest behaves as before.
    """

    _chunks: list[bytes]
    _held: int

    @classmethod
    def install(cls, reader: asyncio.StreamReader) -> ChunkReader:
        reader.__class__ = cls
        assert isinstance(reader, ChunkReader)
        reader._chunks, reader._held = [], 0
        return reader

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        state: Any = self  # asyncio's private flow-control fields, which typeshed does not declare
        assert not state._eof, "feed_data after feed_eof"
        chunk = data if type(data) is bytes else bytes(data)
        if not chunk:
            return
        self._chunks.append(chunk)
        self._held += len(chunk)
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


class ReadConnection(Connection):
    """The event store's NATS connection with routed subscriptions, for one task's bulk read.

    A routed subscription's messages go, unparsed, into an :class:`Inbox`
    (see :class:`FastParser`); everything else behaves as in nats-py.
    """

    def __init__(self, *, native: bool = True) -> None:
        super().__init__()
        self._routes: dict[bytes | None, Inbox] = {}
        self._ps = FastParser(self)
        self.native = native and NATIVE

    def route(self, sid: int, inbox: Inbox) -> None:
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
        no copies unless several reads wait at once (:class:`ChunkReader`). The stream reader's limit (32 KiB,
        set by nats-py) is raised to match, or it would stop reading the socket
        at 64 KiB buffered.
        """
        reader = getattr(self._transport, "_io_reader", None)
        chunks: ChunkReader | None = None
        if isinstance(reader, asyncio.StreamReader):
            reader._limit = max(reader._limit, _READ_SIZE)  # type: ignore[attr-defined] # private in typeshed
            if isinstance(reader, ChunkReader):  # this loop ran on it before
                chunks = reader
            elif type(reader) is asyncio.StreamReader:  # not another transport's own reader
                chunks = ChunkReader.install(reader)
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
