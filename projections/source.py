"""Reading the event store for one projection: whole commits in order, unhandled commits never decoded.

Built on the event store's public :class:`~eventstore.OrderedPull` (the
ordered pull reader under ``read_all`` and ``subscribe``: in order, no gaps,
no duplicates, resumes after server restarts) and
:func:`~eventstore.decode_commit`, with two savings that matter in replays:

* a commit none of whose types the projection handles is skipped from its
  ``Es-Type`` header alone: no event object, no payload decoding;
* stream ids are parsed once per subject and kept across batches (the event
  store re-parses and re-validates them per batch).

Each batch reports its last position even when every commit in it was
skipped, so the checkpoint still moves past them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass

from eventstore import EventStore, Header, OrderedPull, RecordedEvent, StreamId, decode_commit

__all__ = ["EventBatch", "EventSource"]

_MAX_CACHED_STREAMS = 200_000


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of whole commits, in order, and the position of the batch's last commit (handled or not)."""

    events: list[RecordedEvent]
    last_position: int
    skipped: int
    """Events in commits skipped because the projection handles none of their types."""


class EventSource:
    """Batches of one projection's events from ``store`` (see the module docs)."""

    def __init__(self, store: EventStore, categories: Sequence[str] | None, handled: Collection[str]) -> None:
        self._store = store
        self._filters = store.filter_subjects(categories)
        self._handled = frozenset(handled)
        self._streams: dict[str, StreamId] = {}

    async def last_position(self) -> int:
        """The stream's last position."""
        return await self._store.last_position()

    async def batches(
        self,
        from_position: int,
        *,
        to_position: int | None = None,
        live: bool = False,
        batch: int = 1000,
        heartbeat_s: float = 1.0,
    ) -> AsyncIterator[EventBatch]:
        """Commits from ``from_position``: up to ``to_position`` (default: the last at the start), or forever if ``live``."""
        store = self._store
        if not live:
            if to_position is None:
                to_position = await store.last_position()
            if to_position < from_position:
                return
        pull = OrderedPull(
            store.nc, store.settings.stream, start_seq=from_position, stop_seq=None if live else to_position,
            filter_subjects=self._filters, live=live, batch=batch, heartbeat_s=heartbeat_s,
            api_timeout_s=store.settings.request_timeout_s,
        )
        handled = self._handled
        streams = self._streams
        prefix = store.settings.subject_prefix
        registry = store.registry
        type_header = Header.TYPE
        async for stored in pull.batches():
            events: list[RecordedEvent] = []
            skipped = 0
            for seq, msg in stored:
                headers = msg.headers
                types = headers.get(type_header) if headers else None
                if types is not None and types not in handled:
                    names = types.split(",")
                    if not any(name in handled for name in names):
                        skipped += len(names)
                        continue
                stream_id = streams.get(msg.subject)
                if stream_id is None:
                    if len(streams) >= _MAX_CACHED_STREAMS:
                        streams.clear()
                    stream_id = streams[msg.subject] = StreamId.from_subject(msg.subject, prefix)
                events.extend(decode_commit(stream_id, seq, headers, msg.data, registry))
            yield EventBatch(events, stored[-1][0], skipped)
