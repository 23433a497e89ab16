"""DCB in memory, for domain tests: :class:`InMemoryDcb` keeps the contract of :class:`~.dcb_jetstream.JetStreamDcb`.

It stores each append as one commit of the in-memory store (so its ``read_all`` sees DCB events as the real
store's readers do), checks arguments with the same checks, and checks a condition exactly as the server does:
through one tag per query item (:func:`~.dcb.check_tags`), so a test sees the same conflicts, false ones included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .commit import check_commit_size
from .dcb import AppendCondition, DcbCommit, DcbLog, Query, QueryResult, SequencedEvent, TaggedEvent
from .errors import AppendConditionError
from .events import AppendResult
from .streams import StreamId

if TYPE_CHECKING:
    from .memory import InMemoryEventStore

__all__ = ["InMemoryDcb"]


class InMemoryDcb(DcbLog):
    """Reads by query and conditional appends of tagged events on an :class:`~eventstore.InMemoryEventStore`
    (``store.dcb``); see the module docs."""

    def __init__(self, store: "InMemoryEventStore") -> None:
        super().__init__(store.registry, store.settings.subject_prefix)
        self._store = store
        self._tags: dict[int, list[frozenset[str]]] = {}  # commit position -> each event's tags
        self._by_tag: dict[str, list[int]] = {}  # tag -> positions of the commits holding it, ascending
        self._results: dict[StreamId, AppendResult] = {}

    async def _read(self, query: Query, after: int, limit: int | None) -> QueryResult:
        head = await self._store.last_position()
        events: list[SequencedEvent] = []
        for position in sorted(p for p in self._tags if p > after):
            for recorded, tags in zip(self._store.events_at(position), self._tags[position]):
                if query.matches(recorded.type, tags):
                    events.append(SequencedEvent(position, recorded.index, tags, recorded))
            if limit is not None and len(events) >= limit:
                return QueryResult(events[:limit], events[limit - 1].position)
        return QueryResult(events, head)

    async def _append(
        self, prepared: DcbCommit, events: Sequence[TaggedEvent], condition: AppendCondition | None
    ) -> AppendResult:
        stream_id = prepared.stream_id
        stored = self._results.get(stream_id)
        if stored is not None:
            return stored
        check_commit_size(prepared.commit, prepared.headers, prepared.body, self._store.max_payload)
        if condition is not None:
            firsts = [p for t in prepared.checked for p in self._by_tag.get(t, []) if p > condition.after]
            if firsts:
                raise AppendConditionError(condition.after, min(firsts), prepared.checked)
        position = self._store.record(stream_id, prepared.headers, prepared.body)
        self._tags[position] = [e.tags for e in events]
        for tag in sorted({t for e in events for t in e.tags}):
            self._by_tag.setdefault(tag, []).append(position)
        if prepared.commit.key is not None:
            self._results[stream_id] = AppendResult(stream_id, position, 1, len(events), True, prepared.commit.note)
        return AppendResult(stream_id, position, 1, len(events), False, None)

    async def _find(self, stream_id: StreamId) -> AppendResult | None:
        return self._results.get(stream_id)
