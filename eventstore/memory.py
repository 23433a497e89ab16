"""An event store in memory, for domain tests only: the same appends and reads as :class:`EventStore`, no server.

:class:`InMemoryEventStore` runs what aggregates, repositories and
given/when/then scenarios need (:class:`~eventstore.log.EventLog`) without a
nats-server, so a domain test suite runs in milliseconds. It checks every
argument with the real store's own checks, encodes each commit into the real
wire format (so an event that would not survive storage, or a commit larger
than ``max_payload``, is refused the same way) and reads events back through
the real decoder. The contract suite in ``tests/eventstore`` runs against both.

It is not an event store for production: nothing is durable, no other
process sees it, there are no subscriptions, consumers, projections or
snapshots, and an idempotency key is remembered for the store's lifetime
(the real store guarantees it within its duplicate window).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

from pydantic import BaseModel

from .commit import EntityAppend, build_commit, check_append, check_commit_size
from .dcb_memory import InMemoryDcb
from .errors import ConcurrencyError, InvalidEventError
from .events import ANY, NO_STREAM, AppendResult, ExpectedVersion, RecordedEvent, StreamState
from .registry import TypeRegistry
from .settings import EventStoreSettings
from .streams import StreamId
from .validation import check_find_append, check_read, check_read_all, check_remember, check_stream_id
from .wire import decode_commit, escape_key, msg_id, utc_now_text

__all__ = ["InMemoryEventStore"]

_DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""nats-server's default ``max_payload``: the largest commit the real store can send to a default server."""


class InMemoryEventStore:
    """Appends and reads of :class:`~eventstore.EventStore`, held in this process's memory (see the module docs).

    Use it only in tests: ``async with InMemoryEventStore() as store:`` gives a
    store a :class:`~aggregates.Repository`, an :class:`~aggregates.Application`
    or :func:`~aggregates.scenario` accepts like the real one.
    """

    def __init__(
        self,
        *,
        registry: TypeRegistry | None = None,
        settings: EventStoreSettings | None = None,
        max_payload: int = _DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self.registry = registry if registry is not None else TypeRegistry()
        self.settings = settings if settings is not None else EventStoreSettings()
        self.max_payload = max_payload
        self._commits: list[list[RecordedEvent]] = []  # by position - 1
        self._entities: dict[StreamId, list[int]] = {}  # an entity's commit positions, in order
        self._keys: dict[str, tuple[frozenset[StreamId], list[AppendResult], str | None]] = {}
        self._dcb: InMemoryDcb | None = None

    # -- writing ------------------------------------------------------------

    async def append(
        self,
        stream_id: StreamId,
        events: Sequence[BaseModel],
        expected_version: ExpectedVersion = ANY,
        *,
        expected_position: int | None = None,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> AppendResult:
        """:meth:`EventStore.append <eventstore.EventStore.append>`, in memory."""
        request = EntityAppend(stream_id, events, expected_version, expected_position)
        results = await self.append_many(
            [request], idempotency_key=idempotency_key, correlation_id=correlation_id, causation_id=causation_id,
            note=note,
        )
        return results[0]

    async def append_many(
        self,
        requests: Sequence[EntityAppend],
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> list[AppendResult]:
        """:meth:`EventStore.append_many <eventstore.EventStore.append_many>`, in memory: all entities or none."""
        key, correlation, causation = check_append(requests, idempotency_key, correlation_id, causation_id, note)
        if key is not None and key in self._keys:
            entities, results, stored_note = self._keys[key]
            if entities == frozenset(r.stream_id for r in requests):
                return [
                    AppendResult(r.stream_id, r.position, r.first_version, r.last_version, True, stored_note)
                    for r in results
                ]
            raise InvalidEventError(
                f"The idempotency key {key!r:.60} was already used by another append (to other entities than "
                f"{', '.join(str(r.stream_id) for r in requests)}, or not to all of them); nothing was stored. "
                "Use one key per append."
            )
        append_id = escape_key(key) if key is not None else secrets.token_hex(16)
        single = len(requests) == 1
        prefix = self.settings.subject_prefix
        commits = [build_commit(self.registry, prefix, r, msg_id(append_id, None if single else i), key, note)
                   for i, r in enumerate(requests)]
        for commit in commits:
            commit.prev_version, commit.prev_position = self._check_expected(commit.request)
        recorded_at = utc_now_text()
        encoded = [c.encode(recorded_at, correlation, causation) for c in commits]
        for commit, (headers, body) in zip(commits, encoded):
            check_commit_size(commit, headers, body, self.max_payload)
        results = [commit.result(self.record(commit.request.stream_id, headers, body), False)
                   for commit, (headers, body) in zip(commits, encoded)]
        if key is not None:
            self._keys[key] = (frozenset(r.stream_id for r in requests), results, note)
        return results

    def events_at(self, position: int) -> list[RecordedEvent]:
        """The events of the commit at ``position`` (1 to :meth:`last_position`)."""
        return self._commits[position - 1]

    def record(self, stream_id: StreamId, headers: dict[str, str], body: bytes) -> int:
        """Store one encoded commit of ``stream_id`` at the next position (read back through the real decoder);
        its position. For the stores built on this one (:class:`~eventstore.dcb_memory.InMemoryDcb`)."""
        position = len(self._commits) + 1
        self._commits.append(decode_commit(stream_id, position, headers, body, self.registry))
        self._entities.setdefault(stream_id, []).append(position)
        return position

    @property
    def dcb(self) -> "InMemoryDcb":
        """Reads by query and conditional appends of tagged events (:class:`~eventstore.dcb.DcbLog`), in
        memory, on this store's positions: ``read_all`` sees DCB events as the real store's readers do."""
        if self._dcb is None:
            self._dcb = InMemoryDcb(self)
        return self._dcb

    def _check_expected(self, request: EntityAppend) -> tuple[int, int]:
        """The entity's (version, position), if it is where ``request`` expects it; else ConcurrencyError."""
        state = self._state(request.stream_id)
        expected = request.expected_version
        if expected is ANY:
            return state.version, state.position
        wanted = 0 if expected is NO_STREAM else expected
        if state.version != wanted or (
            request.expected_position is not None and state.position != request.expected_position
        ):
            raise ConcurrencyError(request.stream_id, expected, state.version)
        return state.version, state.position

    async def find_append(
        self, stream_id: StreamId, idempotency_key: str, *, from_position: int = 1
    ) -> AppendResult | None:
        """What an earlier append with ``idempotency_key`` stored on ``stream_id`` at ``from_position`` or later
        (``duplicate=True``, with its note), or None."""
        check_find_append(stream_id, idempotency_key, from_position)
        _, results, note = self._keys.get(idempotency_key, (frozenset(), [], None))
        found = next((r for r in results if r.stream_id == stream_id and r.position >= from_position), None)
        return None if found is None else AppendResult(stream_id, found.position, found.first_version,
                                                       found.last_version, True, note)

    def remember(self, stream_id: StreamId, version: int, position: int) -> None:
        """Checked like the real store's; there is nothing to save a lookup on."""
        check_remember(stream_id, version, position)

    # -- reading ------------------------------------------------------------

    async def read(
        self,
        stream_id: StreamId,
        *,
        from_version: int = 1,
        to_version: int | None = None,
        from_position: int = 1,
        consistent: bool = False,
    ) -> list[RecordedEvent]:
        """One entity's events, in version order (empty if it has none)."""
        check_read(stream_id, from_version, to_version, from_position, consistent)
        return [
            event
            for position in self._entities.get(stream_id, [])
            if position >= from_position
            for event in self._commits[position - 1]
            if event.version >= from_version and (to_version is None or event.version <= to_version)
        ]

    def read_all(
        self,
        *,
        from_position: int = 1,
        to_position: int | None = None,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
    ) -> AsyncIterator[list[RecordedEvent]]:
        """Every event (of ``categories``, or all) in global order, in batches of whole commits, up to the last
        position when iteration starts."""
        check_read_all(from_position, to_position, categories, batch)
        return self._read_all(from_position, to_position, categories, batch)

    async def _read_all(
        self, from_position: int, to_position: int | None, categories: Sequence[str] | None, batch: int
    ) -> AsyncIterator[list[RecordedEvent]]:
        last = len(self._commits) if to_position is None else min(to_position, len(self._commits))
        wanted = None if categories is None else set(categories)
        out: list[RecordedEvent] = []
        for commit in self._commits[from_position - 1:last]:
            if wanted is None or commit[0].stream_id.category in wanted:
                out.extend(commit)
            if len(out) >= batch:
                yield out
                out = []
        if out:
            yield out

    def _state(self, stream_id: StreamId) -> StreamState:
        positions = self._entities.get(stream_id)
        if not positions:
            return StreamState(stream_id, 0, 0)
        return StreamState(stream_id, self._commits[positions[-1] - 1][-1].version, positions[-1])

    async def state(self, stream_id: StreamId) -> StreamState:
        """An entity's current version and the position of its last commit."""
        check_stream_id("stream_id", stream_id)
        return self._state(stream_id)

    async def version(self, stream_id: StreamId) -> int:
        """An entity's current version (its number of events; 0 if it has none)."""
        return (await self.state(stream_id)).version

    async def last_position(self) -> int:
        """The last position (0 when empty)."""
        return len(self._commits)

    async def close(self) -> None:
        """Nothing to close; the events stay readable."""

    async def __aenter__(self) -> "InMemoryEventStore":
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
