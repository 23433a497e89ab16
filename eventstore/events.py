"""Value objects: what an append expects, what it returns, and what reading yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING

from pydantic import BaseModel

from .streams import StreamId

if TYPE_CHECKING:
    from .registry import TypeRegistry

__all__ = ["ANY", "NO_STREAM", "AppendResult", "ExpectedVersion", "RecordedEvent", "StreamState"]


class _Expect(Enum):
    NO_STREAM = "no stream"
    ANY = "any"

    def __str__(self) -> str:
        return self.value


NO_STREAM = _Expect.NO_STREAM
"""Expected version: the entity has no events yet (the same as version 0)."""
ANY = _Expect.ANY
"""Expected version: append whatever the entity's version is (versions stay gap-free)."""

ExpectedVersion = int | _Expect
"""An exact version (0 = no events yet), :data:`NO_STREAM` or :data:`ANY`."""


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """One stored event, as every reader returns it.

    ``position`` is the JetStream stream sequence of the commit that holds the
    event: the global order. The events of one append to one entity share a
    commit, so they share ``position`` and differ in ``index`` (0, 1, ...);
    ``(position, index)`` is unique and totally ordered. Checkpoints store
    positions and always cover whole commits.

    ``data`` is decoded (and upcast) on first access only, so readers that skip
    an event by its ``type`` never pay for its payload.
    """

    position: int
    index: int
    stream_id: StreamId
    version: int
    type: str
    schema_version: int
    event_id: str
    payload: bytes
    recorded_at_text: str
    correlation_id: str | None = None
    causation_id: str | None = None
    registry: "TypeRegistry | None" = field(default=None, repr=False, compare=False)
    _data: list[BaseModel] = field(default_factory=list, repr=False, compare=False)

    @property
    def data(self) -> BaseModel:
        """The event as its registered, current pydantic model (upcast when stored with an older schema)."""
        if not self._data:
            if self.registry is None:
                raise LookupError("This RecordedEvent was read without a type registry; use .payload instead.")
            self._data.append(self.registry.decode(self.type, self.schema_version, self.payload))
        return self._data[0]

    @property
    def recorded_at(self) -> datetime:
        """When the event was appended (UTC, set by the appending client)."""
        return datetime.fromisoformat(self.recorded_at_text)

    @property
    def metadata(self) -> dict[str, str]:
        """Correlation and causation ids, where present."""
        meta = {}
        if self.correlation_id:
            meta["correlation_id"] = self.correlation_id
        if self.causation_id:
            meta["causation_id"] = self.causation_id
        return meta


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What an append stored: the commit's position and the entity's versions it wrote.

    ``duplicate`` is True when this call was a retry of an append that was
    already stored (same idempotency key): nothing new was stored and the
    positions are those of the first write.
    """

    stream_id: StreamId
    position: int
    first_version: int
    last_version: int
    duplicate: bool = False

    @property
    def count(self) -> int:
        """How many events the append stored."""
        return self.last_version - self.first_version + 1


@dataclass(frozen=True, slots=True)
class StreamState:
    """An entity's current version and the position of its last commit (0, 0 when it has no events)."""

    stream_id: StreamId
    version: int
    position: int
