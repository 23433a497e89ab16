"""What aggregates need of an event store: :class:`EventLog`, kept by :class:`~eventstore.EventStore` (JetStream)
and :class:`~eventstore.InMemoryEventStore` (domain tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from pydantic import BaseModel

from .commit import EntityAppend
from .events import AppendResult, ExpectedVersion, RecordedEvent, StreamState
from .registry import TypeRegistry
from .settings import EventStoreSettings
from .streams import StreamId

__all__ = ["EventLog"]


class EventLog(Protocol):
    """Appends with optimistic concurrency and idempotency keys, and reads by entity and in global order.

    Both implementations pass one contract suite (``tests/eventstore/test_event_log_contract.py``).
    """

    registry: TypeRegistry
    settings: EventStoreSettings

    async def append(
        self,
        stream_id: StreamId,
        events: Sequence[BaseModel],
        expected_version: ExpectedVersion = ...,
        *,
        expected_position: int | None = None,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> AppendResult: ...

    async def append_many(
        self,
        requests: Sequence[EntityAppend],
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> list[AppendResult]: ...

    async def find_append(
        self, stream_id: StreamId, idempotency_key: str, *, from_position: int = 1
    ) -> AppendResult | None: ...

    def remember(self, stream_id: StreamId, version: int, position: int) -> None: ...

    async def read(
        self,
        stream_id: StreamId,
        *,
        from_version: int = 1,
        to_version: int | None = None,
        from_position: int = 1,
        consistent: bool = False,
    ) -> list[RecordedEvent]: ...

    def read_all(
        self,
        *,
        from_position: int = 1,
        to_position: int | None = None,
        categories: Sequence[str] | None = None,
        batch: int = 1000,
    ) -> AsyncIterator[list[RecordedEvent]]: ...

    async def state(self, stream_id: StreamId) -> StreamState: ...

    async def version(self, stream_id: StreamId) -> int: ...

    async def last_position(self) -> int: ...

    async def close(self) -> None: ...
