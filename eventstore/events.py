"""Value objects: what an append expects, what it returns, and what reading yields."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from pydantic import BaseModel

from .errors import EventDecodeError
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


class RecordedEvent(NamedTuple):
    """One stored event, as every reader returns it (immutable).

    ``position`` is the JetStream stream sequence of the commit that holds the
    event: the global order. The events of one append to one entity share a
    commit, so they share ``position`` and differ in ``index`` (0, 1, ...);
    ``(position, index)`` is unique and totally ordered. Checkpoints store
    positions and always cover whole commits.

    ``data`` is decoded (and upcast) on first access only, so readers that skip
    an event by its ``type`` never pay for its payload. (A named tuple rather
    than a frozen dataclass: replays build millions of these, and a tuple is
    built six times faster.) Equality ignores the registry and the decode cache.

    ``idempotency_key`` is the key the storing append was given (None without
    one), read back exactly as written by the event store's readers (the Spark
    reader does not carry it); equality ignores it too.
    """

    position: int
    index: int  # type: ignore[assignment]  # shadows tuple.index, on purpose: the public name
    stream_id: StreamId
    version: int
    type: str
    schema_version: int
    event_id: str
    payload: bytes
    recorded_at_text: str
    correlation_id: str | None = None
    causation_id: str | None = None
    registry: "TypeRegistry | None" = None
    decoded: list[BaseModel] | None = None  # a one-item cache for .data; readers pass a fresh list
    idempotency_key: str | None = None  # the key of the append that stored it, exactly as given

    @property
    def data(self) -> BaseModel:
        """The event as its registered, current pydantic model (upcast when stored with an older schema)."""
        if self.decoded:
            return self.decoded[0]
        if self.registry is None:
            raise LookupError("This RecordedEvent was read without a type registry; use .payload instead.")
        data = self.registry.decode(self.type, self.schema_version, self.payload)
        if self.decoded is not None:
            self.decoded.append(data)
        return data

    @property
    def recorded_at(self) -> datetime:
        """When the event was appended (UTC, set by the appending client).

        Raises :class:`~eventstore.EventDecodeError` naming the position when the stored ``Es-Recorded-At`` is
        not an RFC 3339 time (a commit jetsourcing did not write)."""
        try:
            return datetime.fromisoformat(self.recorded_at_text)
        except ValueError:
            raise EventDecodeError(
                f"The event at position {self.position} on {self.stream_id} has no valid Es-Recorded-At header "
                f"({self.recorded_at_text[:40]!r}): it was not written by jetsourcing. Keep foreign messages off "
                "the event subjects."
            ) from None

    @property
    def metadata(self) -> dict[str, str]:
        """Correlation and causation ids, where present."""
        meta = {}
        if self.correlation_id:
            meta["correlation_id"] = self.correlation_id
        if self.causation_id:
            meta["causation_id"] = self.causation_id
        return meta

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordedEvent):
            return self[:11] == other[:11]
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self[:11])

    def __repr__(self) -> str:
        return (
            f"RecordedEvent(position={self.position}, index={self.index}, stream_id={self.stream_id}, "
            f"version={self.version}, type={self.type!r}, schema_version={self.schema_version}, "
            f"event_id={self.event_id!r}, payload={self.payload!r})"
        )


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What an append stored: the commit's position and the entity's versions it wrote.

    ``duplicate`` is True when this call was a retry of an append that was
    already stored (same idempotency key): nothing new was stored and the
    positions are those of the first write. ``note`` is then the note that
    first write stored (None when it had none); a new write's is None (the
    caller holds its own).
    """

    stream_id: StreamId
    position: int
    first_version: int
    last_version: int
    duplicate: bool = False
    note: str | None = None

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
