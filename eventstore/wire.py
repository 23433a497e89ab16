"""The wire format: how a commit of events is laid out in one JetStream message.

One message holds one *commit*: the 1..n events of one append to one entity,
on that entity's subject. The body is the events' JSON payloads joined by a
newline (compact JSON never contains a raw newline), so a one-event commit's
body is exactly the event's JSON. Headers:

==========================  ====================================================
``Nats-Msg-Id``             the append's id: stable across retries, so the server
                            deduplicates a resent commit
``Es-Type``                 event type names, comma-separated, one per event
``Es-Schema-Version``       schema versions, comma-separated, one per event
``Es-Event-Id``             event ids, comma-separated, one per event
``Es-Version``              the entity's version after the commit's last event;
                            event i of n has version ``Es-Version - n + 1 + i``
``Es-Recorded-At``          RFC 3339 UTC time the commit was appended
``Es-Correlation-Id``       optional, for every event of the commit
``Es-Causation-Id``         optional, for every event of the commit
==========================  ====================================================

Decoding ignores headers it does not know, so a newer writer never breaks an
older reader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Final

from .errors import EventDecodeError
from .events import RecordedEvent
from .registry import TypeRegistry
from .streams import StreamId

__all__ = ["Header", "commit_version", "decode_commit", "encode_commit", "utc_now_text"]


class Header:
    """Every header name the event store reads or writes, in one place."""

    MSG_ID: Final = "Nats-Msg-Id"
    EXPECTED_LAST_SUBJECT_SEQUENCE: Final = "Nats-Expected-Last-Subject-Sequence"
    BATCH_ID: Final = "Nats-Batch-Id"
    BATCH_SEQUENCE: Final = "Nats-Batch-Sequence"
    BATCH_COMMIT: Final = "Nats-Batch-Commit"
    STATUS: Final = "Status"
    DESCRIPTION: Final = "Description"
    # Set by the server on direct get replies.
    SEQUENCE: Final = "Nats-Sequence"
    SUBJECT: Final = "Nats-Subject"
    NUM_PENDING: Final = "Nats-Num-Pending"
    # Ours.
    TYPE: Final = "Es-Type"
    SCHEMA_VERSION: Final = "Es-Schema-Version"
    EVENT_ID: Final = "Es-Event-Id"
    VERSION: Final = "Es-Version"
    RECORDED_AT: Final = "Es-Recorded-At"
    CORRELATION_ID: Final = "Es-Correlation-Id"
    CAUSATION_ID: Final = "Es-Causation-Id"


def utc_now_text() -> str:
    """The current UTC time as RFC 3339 text with microseconds."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def encode_commit(
    *,
    msg_id: str,
    types: Sequence[str],
    schema_versions: Sequence[int],
    event_ids: Sequence[str],
    payloads: Sequence[bytes],
    last_version: int,
    recorded_at: str,
    correlation_id: str | None = None,
    causation_id: str | None = None,
) -> tuple[dict[str, str], bytes]:
    """Lay out one commit as (headers, body)."""
    headers = {
        Header.MSG_ID: msg_id,
        Header.TYPE: ",".join(types),
        Header.SCHEMA_VERSION: ",".join(map(str, schema_versions)),
        Header.EVENT_ID: ",".join(event_ids),
        Header.VERSION: str(last_version),
        Header.RECORDED_AT: recorded_at,
    }
    if correlation_id:
        headers[Header.CORRELATION_ID] = correlation_id
    if causation_id:
        headers[Header.CAUSATION_ID] = causation_id
    return headers, b"\n".join(payloads)


def commit_version(headers: Mapping[str, str] | None, where: object) -> int:
    """The entity's version after the stored commit with these headers (a direct get reply's).

    Raises :class:`EventDecodeError` naming the position and ``where`` (the
    entity or subject) when the message was not written by jetsourcing.
    """
    headers = headers or {}
    try:
        return int(headers[Header.VERSION])
    except (KeyError, ValueError):
        raise EventDecodeError(
            f"Message at position {headers.get(Header.SEQUENCE, '?')} on {where} has no valid {Header.VERSION} "
            "header: it was not written by jetsourcing, so the entity's version is unknown. Keep foreign "
            "messages off the event subjects."
        ) from None


def decode_commit(
    stream_id: StreamId,
    position: int,
    headers: Mapping[str, str] | None,
    body: bytes,
    registry: TypeRegistry | None,
) -> list[RecordedEvent]:
    """Split one stored commit back into its events, in order."""
    if not headers or Header.TYPE not in headers:
        raise EventDecodeError(
            f"Message at position {position} on {stream_id} has no {Header.TYPE} header: it was not "
            "written by jetsourcing. Keep foreign messages off the event subjects."
        )
    try:
        types = headers[Header.TYPE]
        last_version = int(headers[Header.VERSION])
        recorded_at = headers.get(Header.RECORDED_AT, "")
        correlation_id = headers.get(Header.CORRELATION_ID)
        causation_id = headers.get(Header.CAUSATION_ID)
        if "," not in types:
            return [
                RecordedEvent(
                    position, 0, stream_id, last_version, types, int(headers[Header.SCHEMA_VERSION]),
                    headers[Header.EVENT_ID], body, recorded_at, correlation_id, causation_id, registry, [],
                )
            ]
        type_list = types.split(",")
        schemas = headers[Header.SCHEMA_VERSION].split(",")
        ids = headers[Header.EVENT_ID].split(",")
        payloads = body.split(b"\n")
        count = len(type_list)
        if not (len(schemas) == len(ids) == len(payloads) == count):
            raise ValueError("header lists and body lines differ in length")
        first = last_version - count + 1
        return [
            RecordedEvent(
                position, i, stream_id, first + i, type_list[i], int(schemas[i]), ids[i], payloads[i],
                recorded_at, correlation_id, causation_id, registry, [],
            )
            for i in range(count)
        ]
    except (KeyError, ValueError) as exc:
        raise EventDecodeError(f"Malformed commit at position {position} on {stream_id}: {exc}") from exc
