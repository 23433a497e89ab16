"""A commit as it is built for the wire: the caller's request for one entity (:class:`EntityAppend`), its
encoded events (:class:`Commit`), and the checks every event store makes before storing one (its arguments,
its size).

:mod:`.append` sends commits to JetStream; :mod:`.memory` and :mod:`.dcb_memory` keep them in memory. The
layout of the message itself is :mod:`.wire`'s.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from .errors import EventTooLargeError, InvalidArgumentError, InvalidEventError
from .events import ANY, AppendResult, ExpectedVersion
from .registry import TypeRegistry
from .streams import StreamId
from .validation import check_entity_append
from .wire import Header, check_idempotency_key, check_metadata, check_note, encode_commit, escape_key, header_block_size

__all__ = ["Commit", "EntityAppend", "MAX_ENTITIES_PER_APPEND", "build_commit", "check_append", "check_commit_size"]

MAX_ENTITIES_PER_APPEND = 1000
"""The server refuses atomic batches of more than 1,000 messages (one message per entity)."""


@dataclass(frozen=True, slots=True)
class EntityAppend:
    """Events to append to one entity, with the version the caller expects it to be at.

    Checked on construction, so a wrong argument never reaches the server:
    ``stream_id`` a :class:`StreamId`; ``events`` a non-empty sequence of
    pydantic model instances; ``expected_version`` an int >= 0, ``NO_STREAM``
    or ``ANY`` (nothing else, so a mistyped version cannot silently disable the
    concurrency check); ``expected_position`` None, or the position of the
    entity's commit at an exact ``expected_version`` (0 with version 0).
    Raises :class:`InvalidArgumentError` or :class:`InvalidEventError`.
    """

    stream_id: StreamId
    events: Sequence[BaseModel]
    expected_version: ExpectedVersion = ANY
    expected_position: int | None = None

    def __post_init__(self) -> None:
        check_entity_append(self)


@dataclass(slots=True)
class Commit:
    """One entity's part of an append, as it goes on the wire."""

    request: EntityAppend
    subject: str
    msg_id: str
    types: list[str]
    schema_versions: list[int]
    event_ids: list[str]
    payloads: list[bytes]
    key: str | None  # the caller's idempotency key
    note: str | None = None  # the caller's note, stored with the commit
    prev_version: int = 0
    prev_position: int = 0
    stored_count: int | None = None  # set when adopting a commit stored by an earlier call
    stored_note: str | None = None  # the note of that commit
    previous: tuple[int, ...] | None = None  # the back pointers sent (or stored, when adopted)
    searched_to: int = 0  # the entity's commits up to here hold no earlier write of this append

    def encode(self, recorded_at: str, correlation_id: str | None, causation_id: str | None) -> tuple[dict[str, str], bytes]:
        """The commit's headers and body as sent, checked by the server against ``prev_position``."""
        headers, body = encode_commit(
            msg_id=self.msg_id,
            types=self.types,
            schema_versions=self.schema_versions,
            event_ids=self.event_ids,
            payloads=self.payloads,
            last_version=self.prev_version + len(self.payloads),
            recorded_at=recorded_at,
            correlation_id=correlation_id,
            causation_id=causation_id,
            idempotency_key=self.key,
            note=self.note,
        )
        headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(self.prev_position)
        if self.previous is not None:
            headers[Header.PREVIOUS] = ",".join(map(str, self.previous))
        return headers, body

    def result(self, position: int, duplicate: bool) -> AppendResult:
        """What the append stored on this entity, the commit being at ``position``."""
        count = len(self.payloads) if self.stored_count is None else self.stored_count
        return AppendResult(
            self.request.stream_id, position, self.prev_version + 1, self.prev_version + count, duplicate,
            self.stored_note if duplicate else None,
        )


def build_commit(
    registry: TypeRegistry,
    subject_prefix: str,
    request: EntityAppend,
    commit_msg_id: str,
    key: str | None,
    note: str | None = None,
) -> Commit:
    """One entity's part of an append, its events encoded by ``registry`` (and so checked: see
    :meth:`TypeRegistry.encode`). Event ids derive from ``key`` when given, so a retry stores the same ids."""
    if not request.events:
        raise InvalidEventError(f"Nothing to append to {request.stream_id}: the list of events is empty.")
    types, versions, ids, payloads = [], [], [], []
    escaped = None if key is None else escape_key(key)  # encodable, and the same as the key for plain keys
    for i, event in enumerate(request.events):
        if not isinstance(event, BaseModel):
            raise InvalidEventError(
                f"Cannot append {event!r} to {request.stream_id}: events must be instances of registered pydantic models."
            )
        name, version, payload = registry.encode(event, request.stream_id)
        types.append(name)
        versions.append(version)
        ids.append(uuid.uuid5(uuid.NAMESPACE_URL, f"{escaped}/{request.stream_id}/{i}").hex if escaped else secrets.token_hex(16))
        payloads.append(payload)
    subject = request.stream_id.subject(subject_prefix)
    return Commit(request, subject, commit_msg_id, types, versions, ids, payloads, key, note)


def check_append(
    requests: Sequence[EntityAppend],
    idempotency_key: object,
    correlation_id: object,
    causation_id: object,
    note: object = None,
) -> tuple[str | None, str | None, str | None]:
    """Check an append's arguments as every event store does (``note`` by :func:`~.wire.check_note`); return the
    checked key and metadata."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence) or not all(
        isinstance(r, EntityAppend) for r in requests
    ):
        raise InvalidArgumentError(
            f"Invalid requests: {requests!r:.80}; append_many takes a list of EntityAppend, one per entity."
        )
    key = check_idempotency_key(idempotency_key)
    correlation = check_metadata("correlation_id", correlation_id)
    causation = check_metadata("causation_id", causation_id)
    check_note(note)
    if not requests:
        raise InvalidEventError("Nothing to append: no entities were given.")
    if len(requests) > MAX_ENTITIES_PER_APPEND:
        raise InvalidEventError(
            f"One atomic append can span at most {MAX_ENTITIES_PER_APPEND} entities, not {len(requests)}; "
            "split it into several appends."
        )
    seen: set[StreamId] = set()
    for request in requests:
        if request.stream_id in seen:
            raise InvalidEventError(
                f"{request.stream_id} appears twice in one append; put all its events in one EntityAppend."
            )
        seen.add(request.stream_id)
    return key, correlation, causation


def check_commit_size(commit: Commit, headers: dict[str, str], body: bytes, limit: int) -> None:
    """Refuse, before anything is sent, a commit the server would refuse by closing the connection."""
    header_size = header_block_size(headers)
    if header_size + len(body) > limit:
        raise EventTooLargeError(
            f"The commit of {len(commit.payloads)} event(s) to {commit.request.stream_id} takes "
            f"{header_size + len(body)} bytes as sent ({header_size} of headers, {len(body)} of events), more than "
            f"the server's max_payload of {limit} bytes. Nothing was stored. Keep large blobs out of events and long "
            "values out of correlation ids and keys, split the append, or raise max_payload on the server."
        )
