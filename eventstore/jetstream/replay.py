"""Reading the stream in order: one state machine for every replay (reads, subscriptions, rebuilds, Spark).

:class:`OrderedReplay` drives an ephemeral, unacknowledged pull consumer over a
:class:`~eventstore.jetstream.transport.BulkConnection`. It keeps two pull
requests of up to ``batch`` messages in flight, checks the consumer's delivery
sequence on every message, and after a gap, a deleted consumer, missed
heartbeats, a server restart or a lost connection it creates a new consumer
(on a new connection if need be) that starts right after the last message it
handed over: the caller sees every message of the range exactly once and in
order. A live read does the same when it has been quiet a while although the
stream's leader has a message for it (on a replicated stream, a consumer whose
replica stopped delivering after a leader change).

It yields *parts*: :class:`Commits` (messages framed in Python, column by
column) or the runs of a native scanner the caller plugs in (``scanner``),
which need only the :class:`NativeRun` interface. What a part becomes is the
caller's business: :mod:`eventstore.reading` decodes them into
``RecordedEvent`` lists, the Spark source into Arrow batches.

The server applies an atomic batch (``append_many``) one message at a time, and
a consumer can deliver the part applied so far. So a live read never ends a
yielded list inside a batch: the messages at its end that belong to a batch
whose commit (its last message, ``Nats-Batch-Commit``) has not arrived are held
back until it does, or a later message does (batches are stored contiguously:
anything after one means it is whole), or, when the commit is on a subject the
filters leave out, until ``heartbeat_s`` passes without a message (applying a
batch takes the server milliseconds).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

from ..errors import (
    AuthenticationError,
    EventStoreClosedError,
    ServerUnavailableError,
    StreamConfigError,
    server_unavailable,
    store_closed,
)
from ..wire import Header
from .api import API_PREFIX, ErrorCode, Subjects
from .transport import BulkConnection, Raw

__all__ = [
    "Commits", "NativeRun", "OrderedReplay", "Parsed", "Part", "Scanner", "leader_has_message",
]

_NS = 1_000_000_000


@dataclass
class Commits:
    """Stored messages as read, column by column: stream sequences, subjects, header blocks, bodies."""

    positions: list[int] = field(default_factory=list)
    subjects: list[bytes] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)

    def extend(self, other: Commits) -> None:
        self.positions += other.positions
        self.subjects += other.subjects
        self.headers += other.headers
        self.bodies += other.bodies

    def position_list(self) -> Sequence[int]:
        return self.positions

    def head(self, keep: int) -> Commits:
        """The first ``keep`` commits."""
        return Commits(self.positions[:keep], self.subjects[:keep], self.headers[:keep], self.bodies[:keep])

    def tail(self, start: int) -> Commits:
        """The commits from ``start`` on."""
        return Commits(self.positions[start:], self.subjects[start:], self.headers[start:], self.bodies[start:])

    def where(self, i: int) -> str:
        """Where commit ``i`` is stored, for error messages."""
        return f"position {self.positions[i]} on {self.subjects[i].decode(errors='replace')}"


@dataclass(slots=True)
class Parsed:
    """A run of the consumer's messages framed natively, header blocks parsed (see :mod:`eventstore.native`)."""

    first_dseq: int
    last_dseq: int
    pending: int
    positions: list[int]
    subjects: list[bytes]
    headers: list[dict[str, str] | None]
    bodies: list[bytes]
    events: list[Any] | None = None
    """Per message, when the scanner decoded events too: the commit's event, or None (then its headers, or, with
    headers None, a commit skipped for its type). A message with headers None is in no atomic batch."""

    def __len__(self) -> int:
        return len(self.positions)

    def position_list(self) -> Sequence[int]:
        return self.positions

    def head(self, keep: int) -> Parsed:
        """The first ``keep`` messages."""
        return Parsed(self.first_dseq, self.first_dseq + keep - 1, self.pending, self.positions[:keep],
                      self.subjects[:keep], self.headers[:keep], self.bodies[:keep],
                      None if self.events is None else self.events[:keep])

    def tail(self, start: int) -> Parsed:
        """The messages from ``start`` on."""
        return Parsed(self.first_dseq + start, self.last_dseq, self.pending, self.positions[start:],
                      self.subjects[start:], self.headers[start:], self.bodies[start:],
                      None if self.events is None else self.events[start:])


class NativeRun(Protocol):
    """A run of consecutive messages of the current consumer, framed by a native scanner."""

    first_dseq: int
    last_dseq: int
    pending: int

    def __len__(self) -> int: ...

    def position_list(self) -> Sequence[int]: ...

    def head(self, keep: int) -> NativeRun: ...


Part: TypeAlias = "Commits | Parsed | NativeRun"
"""What a yielded list holds: commits framed in Python, or a native scanner's runs."""

Scanner = Callable[[bytes, int, bytes, bytes], "tuple[int, NativeRun | None]"]
"""``scanner(data, pos, sid, ack_prefix)``: frame the run of the consumer's messages at ``data[pos:]`` (see
:class:`~eventstore.jetstream.transport.Receiver`)."""


async def _api(conn: BulkConnection, subject: str, body: bytes, timeout_s: float, what: str) -> dict[str, object]:
    """A JetStream API request over ``conn`` and its JSON answer; no answer is :class:`ServerUnavailableError`."""
    try:
        _, _, headers, data = await conn.request(subject, body, timeout_s)
    except TimeoutError as exc:
        raise server_unavailable(what, timeout_s, exc) from exc
    if not data:
        # No responders (a "503" status): JetStream is off, or the stream has no leader just now.
        raise ServerUnavailableError(f"{what}: JetStream did not answer ({headers[9:12].decode(errors='replace')}).")
    answer: dict[str, object] = json.loads(data)
    return answer


async def leader_has_message(
    conn: BulkConnection,
    stream: str,
    from_seq: int,
    filter_subjects: Sequence[str],
    *,
    timeout_s: float,
    api_prefix: str = API_PREFIX,
    must_answer: str | None = None,
) -> int | None:
    """The sequence of the first message at or after ``from_seq`` on one of ``filter_subjects`` (all subjects when
    empty), as the stream's leader knows it; None when there is none, or nobody answered within ``timeout_s``.

    A message get (not a direct get) is answered by the leader: on a replicated
    stream a follower's copy, and a consumer placed on it, may lag. With
    ``must_answer`` (the operation, e.g. "Reading stream 'events'"), no answer
    raises :class:`ServerUnavailableError` naming it instead of counting as none.
    """
    found: list[int] = []
    subject = Subjects(stream, api_prefix).msg_get()
    for filter_subject in filter_subjects or [">"]:
        body = json.dumps({"seq": from_seq, "next_by_subj": filter_subject}).encode()
        try:
            answer = await _api(conn, subject, body, timeout_s, must_answer or "Asking the stream leader")
        except (ServerUnavailableError, ValueError):
            if must_answer:
                raise
            continue  # no leader just now, or a lost connection: unknown, not an error
        error = answer.get("error")
        if must_answer and isinstance(error, dict) and error.get("code") != 404:
            raise ServerUnavailableError(f"{must_answer}: JetStream answered {error.get('description')!r}.")
        message = answer.get("message")
        seq = message.get("seq") if isinstance(message, dict) else None
        if isinstance(seq, int):
            found.append(seq)
    return min(found, default=None)


class _Arrivals:
    """The replay's subscription: what arrived since the reader last looked, in order (a transport Receiver)."""

    __slots__ = ("parts", "statuses", "scan", "event", "last_activity", "error")

    def __init__(self) -> None:
        self.parts: list[NativeRun | list[Raw]] = []
        self.statuses: list[bytes] = []
        self.scan: Callable[[bytes, int], tuple[int, object | None]] | None = None
        self.event = asyncio.Event()
        self.last_activity = time.monotonic()
        self.error: Exception | None = None

    def __bool__(self) -> bool:
        return bool(self.parts or self.statuses)

    def add(self, rows: list[Raw]) -> None:
        data = [row for row in rows if row[1]]
        if len(data) < len(rows):  # status messages (no reply subject) among them; 100 (a heartbeat) says only
            self.statuses += [row[2] for row in rows if not row[1] and row[2][9:12] != b"100"]  # "alive"
        if data:
            last = self.parts[-1] if self.parts else None
            if isinstance(last, list):
                last += data
            else:
                self.parts.append(data)

    def add_run(self, run: object) -> None:
        self.parts.append(run)  # type: ignore[arg-type] # a NativeRun: the scanner is the reader's own

    def wake(self) -> None:
        self.last_activity = time.monotonic()
        if self:
            self.event.set()

    def lost(self, error: Exception) -> None:
        self.error = error
        self.event.set()

    def take(self) -> tuple[list[NativeRun | list[Raw]], list[bytes]]:
        taken = (self.parts, self.statuses)
        self.parts, self.statuses = [], []
        return taken


_BATCH_ID = re.compile(rb"\r\n" + re.escape(Header.BATCH_ID.encode()) + rb":[ \t]*([^\r]*)")
_BATCH_COMMIT = b"\r\n" + Header.BATCH_COMMIT.encode() + b":"


def _batch(part: Commits | Parsed, i: int) -> tuple[str | bytes | None, bool]:
    """The atomic batch message ``i`` of ``part`` belongs to (None: none), and whether it is the batch's commit."""
    if isinstance(part, Parsed):
        headers = part.headers[i]
        if headers is None:
            return None, False  # decoded by the scanner, which leaves every batch message to Python
        return headers.get(Header.BATCH_ID), Header.BATCH_COMMIT in headers
    block = part.headers[i]
    found = _BATCH_ID.search(block)
    return (None if found is None else found.group(1)), _BATCH_COMMIT in block


def _append(out: list[Part], part: Part) -> None:
    """Add ``part`` to ``out``, extending the last part when both are :class:`Commits` (one list per batch read)."""
    last = out[-1] if out else None
    if isinstance(last, Commits) and isinstance(part, Commits):
        last.extend(part)
    else:
        out.append(part)


def _split_unfinished_batch(parts: list[Part]) -> tuple[list[Part], list[Part]]:
    """``parts`` up to the end of the last whole atomic batch, and the messages after it of a batch whose commit
    message is not among them (none when the last message is not in a batch, or is its commit)."""
    last = parts[-1]
    if not isinstance(last, Commits | Parsed):
        return parts, []  # the Spark scanner's runs are read by bounded reads only
    batch, commit = _batch(last, len(last) - 1)
    if batch is None or commit:
        return parts, []
    # Walk back over the messages of that batch, across parts.
    p, cut = len(parts) - 1, len(last) - 1
    while True:
        part = parts[p]
        assert isinstance(part, Commits | Parsed)
        while cut > 0 and _batch(part, cut - 1)[0] == batch:
            cut -= 1
        if cut > 0 or p == 0 or not isinstance(parts[p - 1], Commits | Parsed):
            break
        previous = parts[p - 1]
        assert isinstance(previous, Commits | Parsed)
        if _batch(previous, len(previous) - 1)[0] != batch:
            break
        p, cut = p - 1, len(previous)
    part = parts[p]
    assert isinstance(part, Commits | Parsed)
    kept = parts[:p] + ([part.head(cut)] if cut else [])
    held = [part.tail(cut), *parts[p + 1 :]]
    return kept, held


class OrderedReplay:
    """Yields the messages of ``stream`` from ``start_seq`` on, in sequence order, in lists of parts.

    ``connect`` opens (or returns the open) :class:`BulkConnection`; it is
    called again after the connection is lost. ``filter_subjects`` limits the
    read to matching subjects (the positions then have gaps). ``stop_seq`` ends
    the read after that sequence, or, with ``live=False``, the read ends once no
    matching message is pending (as the stream's leader confirms). With
    ``live=True`` it follows new messages forever, surviving server restarts
    (``give_up_s`` bounds how long a broken server is retried: by default
    ``api_timeout_s`` for a read that ends, forever for a live one). Errors are
    :class:`ServerUnavailableError` naming the operation ``what``.
    ``scanner``, when given, frames runs of the consumer's messages natively.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[BulkConnection]],
        stream: str,
        *,
        start_seq: int = 1,
        filter_subjects: Sequence[str] | None = None,
        stop_seq: int | None = None,
        live: bool = False,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
        api_timeout_s: float = 5.0,
        give_up_s: float | None = None,
        api_prefix: str = API_PREFIX,
        what: str | None = None,
        scanner: Scanner | None = None,
    ) -> None:
        self._connect = connect
        self._stream = stream
        self._api = Subjects(stream, api_prefix)
        self._what = what or f"Reading stream {stream!r}"
        self.next_seq = max(1, start_seq)
        self._filters = list(filter_subjects or [])
        self._stop = stop_seq
        self._live = live
        self._batch = batch
        self._heartbeat_s = heartbeat_s
        self._api_timeout_s = api_timeout_s
        self._give_up_s = give_up_s if give_up_s is not None else (None if live else api_timeout_s)
        self._stall_s = max(heartbeat_s * 5, 2.0)
        self._scanner = scanner
        self._conn: BulkConnection | None = None
        self._sid = b""
        self._subject = ""
        self._arrivals = _Arrivals()
        self._consumer = b""
        self._ack_prefix = b""
        self._last_dseq = 0
        self._pending: int | None = None
        self._requests: deque[int] = deque()
        self._reset = False
        self._last_data = time.monotonic()  # when the consumer last delivered (or was created, or the leader asked)
        self._held: list[Part] = []  # the end of an atomic batch not yet seen whole (live reads)
        self._held_since = 0.0

    # -- the loop --------------------------------------------------------------------------------------------------

    async def batches(self) -> AsyncIterator[list[Part]]:
        """Yield lists of parts, in sequence order, until the read is finished (never for a live read)."""
        arrivals = self._arrivals
        # Hand over big lists when reading a backlog: every list costs its consumer a few fixed calls.
        least = max(1, self._batch // 2)
        out: list[Part] = []
        held = 0
        try:
            await self._create_consumer()
            while True:
                for part in self._drain():
                    _append(out, part)
                    held += len(part)
                if self._finished():
                    if self._stop is None or self.next_seq > self._stop or await self._nothing_left():
                        if out:
                            yield out
                        return
                    self._pending = None  # the consumer's replica lags the stream's leader: wait for it
                if not out and self._held and time.monotonic() - self._held_since >= self._heartbeat_s:
                    out = self._ready([], flush=True)  # quiet for heartbeat_s: whole, its commit filtered out
                    yield out
                    out = []
                    self._resumed()
                    continue
                if out and (held >= least or self._pending == 0 or self._reset):
                    ready = self._ready(out)
                    out, held = [], 0
                    if ready:
                        yield ready
                        self._resumed()
                    continue
                if isinstance(arrivals.error, AuthenticationError):
                    raise arrivals.error  # refused for want of a permission: asking again cannot help
                if self._reset or time.monotonic() - arrivals.last_activity > self._heartbeat_s * 3 or arrivals.error:
                    await self._create_consumer()
                    continue
                try:
                    while len(self._requests) < 2 and self._request_size() > 0:
                        self._request_more()
                except ServerUnavailableError:
                    self._requests.clear()  # the connection is gone: the staleness check starts anew
                arrivals.event.clear()
                if not arrivals and arrivals.error is None:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
                    try:
                        async with asyncio.timeout(self._heartbeat_s):
                            await arrivals.event.wait()
                    except TimeoutError:
                        ready = self._ready(out) if out else []  # a slow trickle is handed over
                        out, held = [], 0
                        if ready:
                            yield ready
                            self._resumed()
                        if not ready and self._live and time.monotonic() - self._last_data > self._stall_s:
                            self._reset = await self._stalled()
        except EventStoreClosedError as exc:  # never retried: said in terms of this read
            raise store_closed(self._what) from exc
        finally:
            self.close()

    def _ready(self, out: list[Part], *, flush: bool = False) -> list[Part]:
        """What may be handed over of ``out``: for a live read, not the end of an unfinished atomic batch."""
        if self._held:
            merged, self._held = self._held, []
            for part in out:
                _append(merged, part)
            out = merged
        if self._live and out and not flush:
            out, self._held = _split_unfinished_batch(out)
            self._held_since = time.monotonic()
        return out

    def _resumed(self) -> None:
        # While the caller held a list, this loop did not run: that pause must not count as missed heartbeats.
        self._arrivals.last_activity = max(self._arrivals.last_activity, time.monotonic())

    def _finished(self) -> bool:
        if self._stop is not None and self.next_seq > self._stop:
            return True
        return not self._live and self._pending == 0

    # -- what arrived ----------------------------------------------------------------------------------------------

    def _drain(self) -> list[Part]:
        """What arrived, checked and cut at the range's end, in order; it stops at a gap (the consumer is reset)."""
        parts, statuses = self._arrivals.take()
        for status in statuses:
            self._on_status(status)
        out: list[Part] = []
        for part in parts:
            if self._reset:
                break
            drained: Part
            if isinstance(part, list):
                drained = self._drain_rows(part)
            else:
                # The scanner checked the consumer and that the run's sequences follow each other.
                self._settle(len(part))
                if part.first_dseq != self._last_dseq + 1:
                    self._reset = True  # a gap: continue from the last message handed over
                    break
                self._last_dseq = part.last_dseq
                self._pending = part.pending
                drained = part
            if not len(drained):
                continue
            self._last_data = time.monotonic()
            positions = drained.position_list()
            if self._stop is not None and positions[-1] > self._stop:
                keep = bisect.bisect_right(positions, self._stop)
                self.next_seq = self._stop + 1
                if keep:
                    out.append(drained.head(keep))
                break
            self.next_seq = positions[-1] + 1
            out.append(drained)
        return out

    def _drain_rows(self, rows: list[Raw]) -> Commits:
        subjects, replies, headers, bodies = (list(column) for column in zip(*rows))
        count = len(replies)
        # Every reply is "$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<timestamp>.
        # <pending>": with our consumer's prefix cut off, five numbers each, split in one go.
        joined = b"\n".join(replies)  # data messages all have a reply
        prefix = self._ack_prefix
        numbers = joined.replace(prefix, b"").replace(b"\n", b".").split(b".")
        last = self._last_dseq
        if (
            prefix
            and joined.count(prefix) == count
            and len(numbers) == 5 * count
            # Every consumer sequence, not only the ends: 1, 3, 3 has the right ends but a gap and a repeat.
            and list(map(int, numbers[2::5])) == list(range(last + 1, last + count + 1))
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

    # -- the consumer ------------------------------------------------------------------------------------------------

    def _request_size(self) -> int:
        if self._stop is None:
            return self._batch
        # Never ask for more than the range can still hold: a consumer would otherwise stream messages
        # past the range's end only for them to be dropped.
        room = self._stop - self.next_seq + 1 - sum(self._requests)
        return min(self._batch, room)

    def _request_more(self) -> None:
        assert self._conn is not None
        size = self._request_size()
        expires_s = max(self._heartbeat_s * 5, 2.0)
        body = {"batch": size, "expires": int(expires_s * _NS), "idle_heartbeat": int(self._heartbeat_s * _NS)}
        self._requests.append(size)
        self._conn.publish(self._api.consumer_next(self._consumer.decode()), json.dumps(body).encode(), self._subject)

    async def _connection(self, deadline: float | None) -> BulkConnection:
        """The open connection, subscribed; a new one when it was lost."""
        if self._conn is not None and not self._conn.closed and not self._conn.suspect:
            return self._conn
        delay = 0.05
        while True:
            try:
                conn = await self._connect()  # checks a suspect connection before handing it out again
                if conn is self._conn and self._sid:
                    return conn  # it answered: the subscription (and the consumer delivering to it) stand
                self._drop_subscription()
                self._subject = conn.new_inbox()
                self._sid = conn.subscribe(self._subject, self._arrivals)
                self._conn = conn
                self._arrivals.error = None
                return conn
            except ServerUnavailableError as exc:
                if isinstance(exc, AuthenticationError) or deadline is not None and time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _create_consumer(self) -> None:
        """Delete the current consumer and create one that starts at ``next_seq``, retrying with backoff while the
        server is down or restarting, for up to ``give_up_s``.

        A new name per try: on a cluster the meta leader may have placed an
        unanswered try's consumer on a replica that is down, and a retry under
        that name would wait for that replica. Short: the name is in the reply
        subject of every message the consumer delivers.
        """
        self._delete_consumer()
        config: dict[str, object] = {
            "deliver_policy": "by_start_sequence",
            "opt_start_seq": self.next_seq,
            "ack_policy": "none",
            "replay_policy": "instant",
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": 60 * _NS,
        }
        if len(self._filters) == 1:
            config["filter_subject"] = self._filters[0]
        elif self._filters:
            config["filter_subjects"] = self._filters
        deadline = None if self._give_up_s is None else time.monotonic() + self._give_up_s
        delay = 0.05
        # At least two tries fit in api_timeout_s (the one after an unanswered one goes elsewhere, see above).
        try_s = max(1.0, self._api_timeout_s / 2)
        while True:
            name = secrets.token_urlsafe(9)
            timeout_s = try_s if deadline is None else min(try_s, max(0.05, deadline - time.monotonic()))
            conn: BulkConnection | None = None
            try:
                conn = await self._connection(deadline)
                body = json.dumps({"stream_name": self._stream, "config": {**config, "name": name}}).encode()
                info = await _api(conn, self._api.consumer_create(name), body, timeout_s, self._what)
                error = info.get("error")
                if isinstance(error, dict) and error.get("err_code") == ErrorCode.STREAM_NOT_FOUND:
                    raise StreamConfigError(
                        f"{self._what}: there is no stream {self._stream!r} on the server. Create it (EventStore.connect() "
                        "or store.ensure_stream() do), or check the stream setting."
                    )
                if error is not None:
                    raise ServerUnavailableError(
                        f"{self._what}: JetStream refused the consumer: {info['error']}. Check that the stream exists."
                    )
                break
            except AuthenticationError:
                raise  # refused credentials or a missing permission: asking again cannot help
            except (ServerUnavailableError, ValueError) as exc:
                if conn is not None and not conn.closed:
                    conn.publish(self._api.consumer_delete(name), b"")  # if the unanswered try created it
                if deadline is not None and time.monotonic() + delay > deadline:
                    if isinstance(exc, ServerUnavailableError):
                        raise
                    raise server_unavailable(self._what, self._api_timeout_s, exc) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        self._consumer = name.encode()
        self._ack_prefix = self._api.ack_prefix(name).encode()
        self._last_dseq = 0
        pending = info.get("num_pending")
        self._pending = pending if isinstance(pending, int) else None
        self._requests.clear()
        self._arrivals.take()  # whatever is left belongs to the old consumer
        if self._scanner is not None:
            scanner, sid, prefix = self._scanner, self._sid, self._ack_prefix
            self._arrivals.scan = lambda data, pos: scanner(data, pos, sid, prefix)
        self._reset = False
        self._arrivals.last_activity = self._last_data = time.monotonic()

    def _delete_consumer(self) -> None:
        self._arrivals.scan = None  # the scanner would take an old consumer's messages as this one's
        if self._consumer and self._conn is not None and not self._conn.closed:
            self._conn.publish(self._api.consumer_delete(self._consumer.decode()), b"")  # it also expires by itself
        self._consumer = self._ack_prefix = b""

    async def _nothing_left(self) -> bool:
        """Whether no matching message lies between ``next_seq`` and ``stop_seq``, as the stream's leader knows.

        On a replicated stream nats-server places a one-replica consumer on any
        current peer of the stream, whose copy may lag the leader's: "nothing
        pending" there does not end a read that must reach ``stop_seq``.
        """
        assert self._stop is not None
        conn = await self._connection(time.monotonic() + self._api_timeout_s)
        seq = await leader_has_message(
            conn, self._stream, self.next_seq, self._filters, timeout_s=self._api_timeout_s,
            api_prefix=self._api.prefix, must_answer=self._what,
        )
        return seq is None or seq > self._stop

    async def _stalled(self) -> bool:
        """Whether the stream's leader has a message for this read that the consumer has not delivered.

        A live read on a replicated stream can go quiet while its consumer still
        sends heartbeats: after a leader change the consumer (placed on one
        replica) may stop delivering. Asked after ``_stall_s`` of quiet, at most
        once per ``_stall_s`` (an idle subscriber costs one message get then).
        """
        self._last_data = time.monotonic()
        if self._conn is None or self._conn.closed:
            return True
        seq = await leader_has_message(
            self._conn, self._stream, self.next_seq, self._filters, timeout_s=self._api_timeout_s,
            api_prefix=self._api.prefix,
        )
        return seq is not None and seq >= self.next_seq  # not delivered while the leader was asked

    def _drop_subscription(self) -> None:
        if self._conn is not None and self._sid:
            self._conn.unsubscribe(self._sid)
        self._sid = b""

    def close(self) -> None:
        """Delete the consumer and drop the subscription (the connection stays open for others)."""
        self._delete_consumer()
        self._drop_subscription()
