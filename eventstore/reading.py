"""Reading: one entity's events, every event in global order, and live subscriptions.

* :meth:`Reader.read` loads one entity with JetStream *direct gets*, no
  consumer. It starts from the entity's last commit (``last_by_subj``, O(1) on
  the server) and walks the commits' back pointers (``Es-Previous``, see
  :mod:`.wire`) down to ``from_position``: each round fetches the up to
  :data:`~.wire.PREVIOUS_COMMITS` commits the oldest fetched one points to
  with pipelined gets by sequence (O(1) each). So a load costs about
  ``commits / PREVIOUS_COMMITS`` round trips, whatever the stream's size. When
  the part of the stream to read is short, or the entity's last commits lie
  close together (its commits are dense), one ``next_by_subj`` scan is
  cheaper and is used instead; commits without pointers (written by earlier
  versions) are scanned too. The load is a consistent prefix even with
  concurrent writers: it reads back from one last commit. Direct get may be
  answered by a replica and is not read-after-write coherent on a cluster;
  that is safe before an optimistic append (a stale read only causes a
  conflict and a retry). ``consistent=True`` first asks the stream's leader
  for the entity's last position (a message get, which only the leader
  answers), and reads up to it: with the walk when the replica that answers
  has it, else through an ordered consumer that waits for its replica.
  Whatever the path, what a load returns is checked whole
  (:mod:`.history`): versions run on from 1 (or from the snapshot's commit),
  and each commit's back pointer and server-checked expected sequence name
  the commit read before it. A load that finds a hole (a commit deleted, a
  replica that answered short, a reply lost) is read again through the
  leader's last position and an ordered consumer; a hole still there raises
  :class:`~.errors.HistoryGapError`. A load never returns a history with a
  hole, and never remembers one for the next append.
* :meth:`Reader.replay` (and :meth:`Reader.read_all`, :meth:`Reader.subscribe`
  on it) replays the stream in order with
  :class:`~eventstore.jetstream.replay.OrderedReplay` over the store's bulk-read
  connection, and decodes what it yields here, once for every reader.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Collection, Sequence
from typing import NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from .entity_commits import EntityCommits
from .errors import HistoryGapError, map_nats_error
from .history import check_history
from .jetstream.replay import Commits, NativeRun, OrderedReplay, Parsed, Part, Scanner
from .jetstream.shared import SharedConnection
from .events import RecordedEvent
from .registry import TypeRegistry
from .settings import EventStoreSettings
from .streams import StreamId, filter_subjects
from . import native
from .native import parse_header_lines
from .wire import Header, commit_previous, decode_commit

__all__ = ["Reader", "Replayed", "StoredMessage"]

log = logging.getLogger("jetsourcing.eventstore")

_MAX_CACHED_STREAMS = 100_000


def _parsed_scanner() -> Scanner | None:
    """The native framing of runs into :class:`Parsed` runs with every header dict (no events), where built."""
    frame = native.events
    if frame is None:
        return None

    def scan(data: bytes, pos: int, sid: bytes, ack_prefix: bytes) -> tuple[int, NativeRun | None]:
        end, count, first, last, pending, positions, subjects, headers, bodies, _ = frame(
            data, pos, sid, ack_prefix, {}, None, None, None, None
        )
        return (end, Parsed(first, last, pending, positions, subjects, headers, bodies)) if count else (pos, None)

    return scan


_SCANNER = _parsed_scanner()
_new_event = tuple.__new__


class Replayed(NamedTuple):
    """One batch of a replay: its events, the last position it covers, and how many events it skipped.

    ``last_position`` covers the skipped events too: a checkpoint there never
    replays them. ``skipped`` counts the events left out because their type is
    not among the replay's ``types``.
    """

    events: list[RecordedEvent]
    last_position: int
    skipped: int



class StoredMessage(NamedTuple):
    """One message of a stream as stored: its position (stream sequence), subject, headers and body."""

    position: int
    subject: str
    headers: dict[str, str]
    data: bytes


class Reader:
    """Reads commits back as :class:`RecordedEvent` objects; one per event store connection."""

    def __init__(
        self, nc: NATS, entities: EntityCommits, settings: EventStoreSettings, registry: TypeRegistry,
        replays: SharedConnection,
    ) -> None:
        self._nc = nc
        self._replays = replays
        self._entities = entities
        self._settings = settings
        self._registry = registry
        self._prefix = settings.subject_prefix
        # Subjects seen while replaying, so each entity's StreamId is parsed once.
        self._streams: dict[bytes, StreamId] = {}

    def filter_subjects(self, categories: Sequence[str] | None) -> list[str]:
        """The subject filters for ``categories`` (all events when None)."""
        return filter_subjects(self._prefix, categories)

    def decode(self, seq: int, msg: Msg) -> list[RecordedEvent]:
        """Decode one stream message (from a consumer) into its events."""
        return decode_commit(StreamId.from_subject(msg.subject, self._prefix), seq, msg.headers, msg.data, self._registry)

    async def read(
        self,
        stream_id: StreamId,
        *,
        from_version: int = 1,
        to_version: int | None = None,
        from_position: int = 1,
        consistent: bool = False,
    ) -> list[RecordedEvent]:
        """One entity's events with ``from_version <= version <= to_version``, in order, without a hole.

        ``from_position`` may name a position at or before the first wanted
        commit (a snapshot's position) to skip the entity's older commits.
        What is read is checked (:func:`~.history.check_history`): versions
        run on from 1 (or from the first commit after ``from_position``) up to
        the entity's last commit, each commit pointing back to the one before,
        and the first wanted version is there. A read that finds a hole is
        done again through the stream's leader (a replica may have answered
        short, or a reply was lost); if the hole is still there,
        :class:`HistoryGapError` names the entity and the position.
        """
        try:
            events = await self._load(stream_id, from_position, from_version, consistent)
        except HistoryGapError as exc:
            log.warning("Reading %s found its history broken at position %s (%s); reading it again through the "
                        "stream's leader.", stream_id, exc.position, exc.problem)
            try:
                events = await self._load(stream_id, from_position, from_version, None)
            except HistoryGapError:
                self._entities.mark_broken(stream_id)  # nothing is appended on it until it reads whole
                raise
        if from_version > 1 or to_version is not None:
            high = to_version if to_version is not None else events[-1].version if events else 0
            events = [e for e in events if from_version <= e.version <= high]
        return events

    async def _load(
        self, stream_id: StreamId, from_position: int, from_version: int, consistent: bool | None
    ) -> list[RecordedEvent]:
        """The entity's checked events from ``from_position`` on: by direct gets (``consistent`` False), up to
        the leader's last commit (True), or through an ordered consumer up to it (None)."""
        subject = stream_id.subject(self._prefix)
        events: list[RecordedEvent] = []
        if consistent is False:
            self._decode_commits(stream_id, await self._entities.commits(stream_id, from_position=from_position), events)
            # (commits() checked the history, and remembered the entity's last commit for the next append)
        else:
            # The entity's last position as the stream's leader knows it (a message get), then the usual walk,
            # whose direct gets any replica answers: if that replica lags the leader, an ordered consumer reads
            # up to the leader's position instead (it waits for its own replica to catch up).
            timeout_s = self._settings.request_timeout_s
            try:
                with map_nats_error(f"Reading {stream_id}", timeout_s, closed=self._replays.is_closed):
                    newest = await self._nc.jetstream(timeout=timeout_s).get_last_msg(self._settings.stream, subject)
            except NotFoundError:
                return []
            last = int(newest.seq or 0)
            if last < from_position:
                return []
            msgs = await self._entities.commits(stream_id, from_position=from_position) if consistent else []
            if msgs and int((msgs[-1].headers or {})[Header.SEQUENCE]) >= last:
                self._decode_commits(stream_id, msgs, events)
            else:
                await self._read_ordered(stream_id, subject, from_position, last, events)
        if from_version > 1 and events and events[0].version > from_version:
            # Read from a position at or before the first wanted commit (a snapshot's, or an aggregate's own):
            # the commit holding from_version is missing.
            raise HistoryGapError(
                stream_id, events[0].position, from_version,
                f"the first commit after position {from_position} holds version {events[0].version}, but version "
                f"{from_version} was asked for: it is missing",
            )
        return events

    async def _read_ordered(
        self, stream_id: StreamId, subject: str, from_position: int, last: int, events: list[RecordedEvent]
    ) -> None:
        """The entity's commits from ``from_position`` to ``last`` through an ordered consumer, checked, as events."""
        pull = OrderedReplay(
            self._replays.get, self._settings.stream, start_seq=from_position, stop_seq=last,
            filter_subjects=[subject], api_timeout_s=self._settings.request_timeout_s, what=f"Reading {stream_id}",
            scanner=_SCANNER,
        )
        commits: list[tuple[int, dict[str, str], bytes]] = []
        async for parts in pull.batches():
            for part in parts:
                assert isinstance(part, Commits | Parsed)
                blocks = part.headers if isinstance(part, Parsed) else map(parse_header_lines, part.headers)
                commits += [(seq, headers or {}, body) for seq, headers, body in zip(part.positions, blocks, part.bodies)]
        check_history(stream_id, [(seq, headers) for seq, headers, _ in commits], due=1 if from_position <= 1 else None)
        for seq, headers, body in commits:
            events.extend(decode_commit(stream_id, seq, headers, body, self._registry))
        if from_position <= 1:
            self._entities.mark_whole(stream_id)
        if commits:
            seq, headers, _ = commits[-1]
            self._entities.remember(stream_id, events[-1].version, seq, commit_previous(headers, stream_id))

    def _decode_commits(self, stream_id: StreamId, msgs: list[Msg], events: list[RecordedEvent]) -> None:
        for msg in msgs:
            headers = msg.headers or {}
            events.extend(decode_commit(stream_id, int(headers[Header.SEQUENCE]), headers, msg.data, self._registry))

    def _replay(
        self, start: int, stop: int | None, filters: Sequence[str], *, live: bool = False, batch: int = 1000,
        heartbeat_s: float = 1.0, what: str | None = None, handled: frozenset[str] | None = None,
    ) -> OrderedReplay:
        return OrderedReplay(
            self._replays.get, self._settings.stream, start_seq=start, stop_seq=stop, filter_subjects=filters,
            live=live, batch=batch, heartbeat_s=heartbeat_s, api_timeout_s=self._settings.request_timeout_s, what=what,
            # A live read follows the outage policy; a read that ends gives up after one request timeout.
            give_up_s=self._settings.outage_limit_s if live else None, scanner=self._events_scanner(handled),
        )

    def _stream_of(self, subject: bytes) -> StreamId:
        """The entity a replayed subject names, parsed once per subject (kept for the next batches)."""
        streams = self._streams
        if len(streams) >= _MAX_CACHED_STREAMS:
            streams.clear()
        stream_id = streams[subject] = StreamId.from_subject(subject.decode(), self._prefix)
        return stream_id

    def _events_scanner(self, handled: frozenset[str] | None) -> Scanner | None:
        """The native framing of a replay's runs into events (``handled``: the types to decode, None for all)."""
        frame = native.events
        if frame is None:
            return None
        streams, make, registry = self._streams, self._stream_of, self._registry

        def new_event(fields: tuple[object, ...]) -> RecordedEvent:
            return _new_event(RecordedEvent, fields)

        def scan(data: bytes, pos: int, sid: bytes, ack_prefix: bytes) -> tuple[int, NativeRun | None]:
            end, count, first, last, pending, positions, subjects, headers, bodies, events = frame(
                data, pos, sid, ack_prefix, streams, make, registry, new_event, handled
            )
            if not count:
                return pos, None
            return end, Parsed(first, last, pending, positions, subjects, headers, bodies, events)

        return scan

    async def replay(
        self,
        *,
        from_position: int = 1,
        to_position: int | None = None,
        categories: Sequence[str] | None = None,
        live: bool = False,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
        types: Collection[str] | None = None,
    ) -> AsyncIterator[Replayed]:
        """The stream's events from ``from_position`` in order, in batches, each event exactly once.

        Up to ``to_position`` (default: the last position at the start), or
        forever when ``live``. With ``types``, events of other types are
        skipped undecoded (counted in :attr:`Replayed.skipped`).
        """
        if not live:
            if to_position is None:
                to_position = await self.last_position()
            if to_position < from_position:
                return
        what = None if live else f"Reading the stream from position {from_position}"
        handled = None if types is None else frozenset(types)
        pull = self._replay(from_position, None if live else to_position, self.filter_subjects(categories), live=live,
                            batch=batch, heartbeat_s=heartbeat_s, what=what, handled=handled)
        async for parts in pull.batches():
            events, skipped = self._decode(parts, handled)
            yield Replayed(events, parts[-1].position_list()[-1], skipped)

    async def read_messages(
        self, stream: str, *, to_position: int, filter_subjects: Sequence[str] = ()
    ) -> AsyncIterator[list[StoredMessage]]:
        """The messages of another stream on this server (a dead-letter stream, say), in order, up to ``to_position``."""
        pull = OrderedReplay(
            self._replays.get, stream, stop_seq=to_position, filter_subjects=filter_subjects,
            api_timeout_s=self._settings.request_timeout_s, what=f"Reading stream {stream!r}", scanner=_SCANNER,
        )
        async for parts in pull.batches():
            out: list[StoredMessage] = []
            for part in parts:
                assert isinstance(part, Commits | Parsed)
                blocks = part.headers if isinstance(part, Parsed) else map(parse_header_lines, part.headers)
                out += [
                    StoredMessage(seq, subject.decode(), headers or {}, body)
                    for seq, subject, headers, body in zip(part.positions, part.subjects, blocks, part.bodies)
                ]
            yield out

    async def read_all(
        self,
        *,
        from_position: int = 1,
        to_position: int | None = None,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Every event from ``from_position`` to ``to_position`` (default: the last at the start), in batches."""
        async for replayed in self.replay(
            from_position=from_position, to_position=to_position, categories=categories, batch=batch
        ):
            yield replayed.events

    async def subscribe(
        self,
        *,
        from_position: int = 1,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Catch up from ``from_position``, then follow new events live, forever, in batches.

        Survives server restarts and lost connections: it resumes right after
        the last event it yielded, with no gap and no duplicate.
        """
        async for replayed in self.replay(
            from_position=from_position, categories=categories, live=True, batch=batch, heartbeat_s=heartbeat_s
        ):
            yield replayed.events

    def _decode(self, parts: list[Part], handled: frozenset[str] | None) -> tuple[list[RecordedEvent], int]:
        """The events of ``parts``, and how many were skipped for their type."""
        out: list[RecordedEvent] = []
        skipped = 0
        for part in parts:
            assert isinstance(part, Commits | Parsed)  # the runs of this reader's scanners are Parsed
            if isinstance(part, Parsed):
                # With events, the scanner decoded the plain commits and skipped those of other types (None with
                # headers None); every other commit keeps its header dict.
                events = part.events or [None] * len(part)
                for seq, subject, headers, body, event in zip(part.positions, part.subjects, part.headers,
                                                              part.bodies, events):
                    if event is not None:
                        out.append(event)
                    elif headers is None:
                        skipped += 1
                    else:
                        skipped += self._decode_one(seq, subject, headers, body, handled, out)
            else:
                for seq, subject, block, body in zip(part.positions, part.subjects, part.headers, part.bodies):
                    skipped += self._decode_one(seq, subject, parse_header_lines(block), body, handled, out)
        return out, skipped

    def _decode_one(
        self, seq: int, subject: bytes, headers: dict[str, str], body: bytes, handled: frozenset[str] | None,
        out: list[RecordedEvent],
    ) -> int:
        """Add the events of one commit to ``out``; the number of events skipped for their type (0 or all)."""
        if handled is not None:
            types = headers.get(Header.TYPE)
            if types is not None and types not in handled:
                names = types.split(",")
                if not any(name in handled for name in names):
                    return len(names)
        stream_id = self._streams.get(subject) or self._stream_of(subject)
        out.extend(decode_commit(stream_id, seq, headers, body, self._registry))
        return 0

    async def last_position(self) -> int:
        """The stream's last position (0 when empty), as the stream leader knows it; never inside an atomic batch.

        The server applies an atomic batch (``append_many``) one message at a time, and stream info (like consumer
        delivery) can see a prefix of it: a read cut there would show part of the batch. Its "message get" is
        isolated from batch commits, so the position of the last message it returns is a batch boundary.
        """
        timeout_s = self._settings.request_timeout_s
        stream = self._settings.stream
        js = self._nc.jetstream(timeout=timeout_s)
        with map_nats_error(f"Reading the last position of stream {stream!r}", timeout_s, closed=self._replays.is_closed):
            for _ in range(2):
                try:
                    return int((await js.get_last_msg(stream, ">")).seq or 0)
                except NotFoundError:
                    # No last message: the stream is empty, or its last message was deleted.
                    last = int((await js.stream_info(stream)).state.last_seq or 0)
                    if last == 0:
                        return 0
                    # Not empty now: a first write (maybe a batch) landed since, unless the last message is gone.
        return last
