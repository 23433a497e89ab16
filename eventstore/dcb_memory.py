"""DCB in memory, for domain tests: :class:`InMemoryDcb` keeps the contract of :class:`~.dcb_jetstream.JetStreamDcb`.

It stores each append as one commit of the in-memory store (so its ``read_all`` sees DCB events as the real
store's readers do), checks arguments with the same checks, and checks a condition exactly as the server does:
through one tag per query item (:func:`~.dcb.check_tags`), so a test sees the same conflicts, false ones included.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .commit import EntityAppend, build_commit, check_commit_size
from .dcb import (
    AppendCondition,
    Query,
    QueryResult,
    SequencedEvent,
    TaggedEvent,
    batch_messages,
    check_dcb_append,
    check_dcb_read,
    check_find_key,
    check_tags,
    dcb_stream_id,
    encode_tags,
)
from .errors import AppendConditionError
from .events import NO_STREAM, AppendResult
from .streams import StreamId
from .wire import Header, escape_key, msg_id, utc_now_text

if TYPE_CHECKING:
    from .memory import InMemoryEventStore

__all__ = ["InMemoryDcb"]


class InMemoryDcb:
    """Reads by query and conditional appends of tagged events on an :class:`~eventstore.InMemoryEventStore`
    (``store.dcb``); see the module docs."""

    def __init__(self, store: "InMemoryEventStore") -> None:
        self._store = store
        self._tags: dict[int, list[frozenset[str]]] = {}  # commit position -> each event's tags
        self._by_tag: dict[str, list[int]] = {}  # tag -> positions of the commits holding it, ascending
        self._results: dict[StreamId, AppendResult] = {}

    async def ensure_index(self) -> None:
        """Nothing to prepare in memory."""

    async def read(self, query: Query, *, after: int = 0, limit: int | None = None) -> QueryResult:
        """:meth:`JetStreamDcb.read <eventstore.dcb_jetstream.JetStreamDcb.read>`, in memory."""
        check_dcb_read(query, after, limit)
        head = await self._store.last_position()
        events: list[SequencedEvent] = []
        for position in sorted(p for p in self._tags if p > after):
            for recorded, tags in zip(self._store.events_at(position), self._tags[position]):
                if query.matches(recorded.type, tags):
                    events.append(SequencedEvent(position, recorded.index, tags, recorded))
            if limit is not None and len(events) >= limit:
                return QueryResult(events[:limit], events[limit - 1].position)
        return QueryResult(events, head)

    async def append(
        self,
        events: Sequence[TaggedEvent],
        *,
        condition: AppendCondition | None = None,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> AppendResult:
        """:meth:`JetStreamDcb.append <eventstore.dcb_jetstream.JetStreamDcb.append>`, in memory."""
        key, correlation, causation = check_dcb_append(events, condition, idempotency_key, correlation_id,
                                                       causation_id, note)
        append_id = escape_key(key) if key is not None else secrets.token_hex(16)
        stream_id = dcb_stream_id(key, append_id)
        stored = self._results.get(stream_id)
        if stored is not None:
            return stored
        commit = build_commit(self._store.registry, self._store.settings.subject_prefix,
                              EntityAppend(stream_id, [e.event for e in events], NO_STREAM), msg_id(append_id, 0), key, note)
        commit.previous = (0,)
        headers, body = commit.encode(utc_now_text(), correlation, causation)
        headers[Header.TAGS] = encode_tags([e.tags for e in events])
        checked = [] if condition is None else check_tags(condition.query)
        batch_messages(events, checked)  # refuses what the real store refuses
        check_commit_size(commit, headers, body, self._store.max_payload)
        if condition is not None:
            firsts = [p for t in checked for p in self._by_tag.get(t, []) if p > condition.after]
            if firsts:
                raise AppendConditionError(condition.after, min(firsts), checked)
        position = self._store.record(stream_id, headers, body)
        self._tags[position] = [e.tags for e in events]
        for tag in sorted({t for e in events for t in e.tags}):
            self._by_tag.setdefault(tag, []).append(position)
        if key is not None:
            self._results[stream_id] = AppendResult(stream_id, position, 1, len(events), True, note)
        return AppendResult(stream_id, position, 1, len(events), False, None)

    async def find_append(self, idempotency_key: str) -> AppendResult | None:
        """What the DCB append with exactly ``idempotency_key`` stored (``duplicate=True``), or None."""
        key = check_find_key(idempotency_key)
        return self._results.get(dcb_stream_id(key, escape_key(key)))
