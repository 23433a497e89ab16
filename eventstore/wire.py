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
``Es-Idempotency-Key``      the caller's idempotency key (escaped, see
                            :func:`escape_key`), when the append had one
``Es-Note``                 optional: a short text the appender stored with the
                            commit (escaped, see :func:`escape_key`), handed
                            back to a duplicate append (a command's reply value)
``Es-Previous``             the positions of the entity's previous commits, most
                            recent first, at most :data:`PREVIOUS_COMMITS` of
                            them, ending with ``0`` when they reach back to the
                            entity's start (the first commit has ``0``): the
                            back pointers a load walks (see :mod:`.reading`)
``Es-Tags``                 a DCB commit's tags, per event (see :func:`.dcb.encode_tags`)
==========================  ====================================================

A DCB append (:mod:`.dcb_jetstream`) stores one such commit on ``<prefix>.Dcb.<append id>``, last in an atomic
batch that first holds an empty *index message* on ``<prefix>_tags.<tag>`` per tag, whose ``Es-Commit-Offset``
says how many positions before the commit it is stored and ``Es-Commit-Entity`` names the commit's subject's
last token;
when the append checked that tag, ``Es-Previous`` holds the positions of the tag's previous index messages
(see :mod:`.dcb_index`). Index subjects lie outside ``<prefix>.>``, so no reader of events
sees them.

Header values must reach the reader exactly as written, but nats-py strips
them and turns line breaks into spaces. So idempotency keys are escaped
losslessly (:func:`escape_key`) and correlation and causation ids that could
not survive are refused (:func:`check_metadata`).

Decoding ignores headers it does not know, so a newer writer never breaks an
older reader.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Final
from urllib.parse import unquote

from .errors import EventDecodeError, InvalidArgumentError
from .events import RecordedEvent
from .registry import TypeRegistry
from .streams import StreamId

__all__ = [
    "DeadLetterHeader",
    "Header",
    "MAX_NOTE_BYTES",
    "NATS_HEADER_PREFIX",
    "PREVIOUS_COMMITS",
    "check_idempotency_key",
    "check_metadata",
    "check_note",
    "commit_previous",
    "commit_version",
    "decode_commit",
    "encode_commit",
    "escape_key",
    "header_block_size",
    "msg_id",
    "note_of",
    "parse_header_lines",
    "utc_now_text",
]


class DeadLetterHeader:
    """The headers a reactor's dead letter carries on top of the original commit's ``Es-*`` headers."""

    REACTOR: Final = "Es-Dlq-Reactor"
    REASON: Final = "Es-Dlq-Reason"
    ERROR: Final = "Es-Dlq-Error"
    DELIVERIES: Final = "Es-Dlq-Deliveries"
    POSITION: Final = "Es-Dlq-Position"
    SUBJECT: Final = "Es-Dlq-Subject"
    STREAM: Final = "Es-Dlq-Stream"
    AT: Final = "Es-Dlq-At"


NATS_HEADER_PREFIX: Final = "Nats-"
"""How the names of the headers the server acts on begin (message ids, expectations, batches)."""


class Header:
    """Every header name the event store reads or writes, in one place."""

    MSG_ID: Final = "Nats-Msg-Id"
    EXPECTED_LAST_SUBJECT_SEQUENCE: Final = "Nats-Expected-Last-Subject-Sequence"
    # The subject (or filter) the check above is made on, when not the message's own (nats-server 2.11+).
    EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT: Final = "Nats-Expected-Last-Subject-Sequence-Subject"
    BATCH_ID: Final = "Nats-Batch-Id"
    BATCH_SEQUENCE: Final = "Nats-Batch-Sequence"
    BATCH_COMMIT: Final = "Nats-Batch-Commit"
    STATUS: Final = "Status"
    DESCRIPTION: Final = "Description"
    # Set by the server on direct get replies.
    SEQUENCE: Final = "Nats-Sequence"
    SUBJECT: Final = "Nats-Subject"
    NUM_PENDING: Final = "Nats-Num-Pending"
    LAST_SEQUENCE: Final = "Nats-Last-Sequence"  # in a direct get batch: the message sent before this one
    # Ours.
    TYPE: Final = "Es-Type"
    SCHEMA_VERSION: Final = "Es-Schema-Version"
    EVENT_ID: Final = "Es-Event-Id"
    VERSION: Final = "Es-Version"
    RECORDED_AT: Final = "Es-Recorded-At"
    CORRELATION_ID: Final = "Es-Correlation-Id"
    CAUSATION_ID: Final = "Es-Causation-Id"
    IDEMPOTENCY_KEY: Final = "Es-Idempotency-Key"
    NOTE: Final = "Es-Note"
    PREVIOUS: Final = "Es-Previous"
    TAGS: Final = "Es-Tags"  # a DCB commit's tags, per event
    COMMIT_OFFSET: Final = "Es-Commit-Offset"  # a DCB index message: how far after its commit it is stored
    COMMIT_ENTITY: Final = "Es-Commit-Entity"  # a DCB index message: its commit's entity (the subject's last token)


PREVIOUS_COMMITS: Final = 8
"""How many earlier commits' positions a commit's ``Es-Previous`` holds: a load fetches that many commits per
round trip (at most about 70 header bytes per commit; see "Reading" in docs/concepts/event-store.md for the measurements)."""


# Printable ASCII but '%' (the escape character) passes through escape_key unchanged, so the
# common keys (uuids, "reactor:event-id") keep the message ids they always had.
_KEY_SAFE: Final = frozenset(chr(c) for c in range(0x21, 0x7F)) - {"%"}
_KEY_UNSAFE: Final = re.compile(r"[^\x21-\x24\x26-\x7e]")  # the complement of _KEY_SAFE, scanned in C
# The Unicode categories Cc (the C0 and C1 controls), Cs (surrogates), Zl and Zp: the characters a NATS header
# cannot carry unchanged. The Unicode stability policy fixes Cc and Cs; Zl and Zp are one character each.
_NOT_IN_HEADER: Final = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029]")
# The separator between an append's id and an entity's index in a multi-entity append: escape_key
# writes '%' only before two hex digits, so no escaped key contains it and no two ids collide.
_ENTITY_SEPARATOR: Final = "%:"
_HEADER_START: Final = len(b"NATS/1.0\r\n")


def escape_key(key: str) -> str:
    """``key`` as header-safe text, injectively: printable ASCII but ``%`` as is, the rest ``%XX`` UTF-8 bytes."""
    if _KEY_UNSAFE.search(key) is None:
        return key
    # surrogatepass: a lone surrogate is escaped like any other code point, so the mapping stays injective.
    return "".join(
        c if c in _KEY_SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass")) for c in key
    )


def msg_id(append_id: str, index: int | None) -> str:
    """The ``Nats-Msg-Id`` of an append's commit: the id itself, or for entity ``index`` of a multi-entity append
    the id and the index; distinct (escaped id, index) pairs never give the same message id."""
    return append_id if index is None else f"{append_id}{_ENTITY_SEPARATOR}{index}"


def check_idempotency_key(key: object) -> str | None:
    """The key if it can be an idempotency key (None or a non-empty str), else :class:`InvalidArgumentError`."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"idempotency_key must be a non-empty str or None, not {_preview(key)}; nothing was stored.")
    return key


MAX_NOTE_BYTES: Final = 4096
"""The most bytes an append's ``note`` may take as stored (escaped: see :func:`check_note`)."""


def check_note(note: object) -> str | None:
    """The note if an append can store it: None, or a non-empty str whose escaped form (:func:`escape_key`:
    printable ASCII but ``%`` as is, the rest ``%XX``) is at most :data:`MAX_NOTE_BYTES` bytes; else
    :class:`InvalidArgumentError`."""
    if note is None:
        return None
    if not isinstance(note, str) or not note:
        raise InvalidArgumentError(f"note must be a non-empty str or None, not {_preview(note)}; nothing was stored.")
    size = len(escape_key(note))
    if size > MAX_NOTE_BYTES:
        raise InvalidArgumentError(
            f"The note takes {size} bytes as stored, more than {MAX_NOTE_BYTES}; nothing was stored. Keep notes short."
        )
    return note


def note_of(headers: Mapping[str, str] | None) -> str | None:
    """The note stored with the commit with these headers (as given to the append), or None."""
    escaped = (headers or {}).get(Header.NOTE)
    return None if escaped is None else unquote(escaped, errors="surrogatepass")


def check_metadata(name: str, value: object) -> str | None:
    """``value`` if a header carries it exactly (None, or a non-empty str without control characters, line or
    paragraph separators, lone surrogates, or whitespace at either end), else :class:`InvalidArgumentError` naming
    ``name``."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{name} must be a non-empty str or None, not {_preview(value)}; nothing was stored.")
    found = _NOT_IN_HEADER.search(value)
    bad = None if found is None else found.group()
    if bad is not None or value != value.strip():
        what = f"the character {bad!r}" if bad is not None else "whitespace at its start or end"
        raise InvalidArgumentError(
            f"{name} {_preview(value)} contains {what}, which a NATS header cannot carry unchanged; nothing was stored. "
            "Use printable text without surrounding whitespace (e.g. a uuid)."
        )
    return value


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def header_block_size(headers: Mapping[str, str]) -> int:
    """The bytes of the header block nats-py sends for ``headers`` (``NATS/1.0``, each ``Name: value``, the
    blank line). The values must already be what is sent: the ones this module writes or checks are."""
    return _HEADER_START + sum(len(k) + len(v.encode()) + 4 for k, v in headers.items()) + 2


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
    idempotency_key: str | None = None,
    note: str | None = None,
) -> tuple[dict[str, str], bytes]:
    """Lay out one commit as (headers, body); ``idempotency_key`` and ``note`` are the caller's, escaped here."""
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
    if idempotency_key is not None:  # after the fixed layout the Spark reader's fast path expects
        headers[Header.IDEMPOTENCY_KEY] = escape_key(idempotency_key)
    if note is not None:
        headers[Header.NOTE] = escape_key(note)
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


def commit_previous(headers: Mapping[str, str] | None, where: object) -> tuple[int, ...] | None:
    """The positions of the entity's commits before the stored commit with these headers, most recent first,
    ending with 0 when they reach the entity's start; None for a commit that carries no back pointer (written
    before ``Es-Previous`` existed, or by another writer).

    ``Es-Previous`` is preferred; else a ``Nats-Expected-Last-Subject-Sequence`` header, which the server
    verified when it stored the commit, is the one previous position. A malformed pointer (not strictly
    decreasing positions below the commit's own) raises :class:`EventDecodeError` naming the position and
    ``where``.
    """
    headers = headers or {}
    text = headers.get(Header.PREVIOUS)
    if text is None:
        text = headers.get(Header.EXPECTED_LAST_SUBJECT_SEQUENCE)
        if text is None:
            return None
    position = headers.get(Header.SEQUENCE, "?")
    try:
        previous = tuple(int(p) for p in text.split(","))
    except ValueError:
        previous = ()
    bound = int(position) if position.isdigit() else None
    if not previous or previous[-1] < 0 or any(a <= b for a, b in zip(previous, previous[1:])) or (
        bound is not None and previous[0] >= bound
    ):
        raise EventDecodeError(
            f"Message at position {position} on {where} has a malformed back pointer {text[:60]!r}: it was not "
            "written by jetsourcing, or was altered. Keep foreign messages off the event subjects."
        )
    return previous


_TYPE, _VERSION, _SCHEMA_VERSION, _EVENT_ID = Header.TYPE, Header.VERSION, Header.SCHEMA_VERSION, Header.EVENT_ID
_RECORDED_AT, _CORRELATION_ID, _CAUSATION_ID = Header.RECORDED_AT, Header.CORRELATION_ID, Header.CAUSATION_ID
_IDEMPOTENCY_KEY = Header.IDEMPOTENCY_KEY
_new_event = tuple.__new__


def decode_commit(
    stream_id: StreamId,
    position: int,
    headers: Mapping[str, str] | None,
    body: bytes,
    registry: TypeRegistry | None,
) -> list[RecordedEvent]:
    """Split one stored commit back into its events, in order."""
    # Every replay runs this once per commit: the names are bound once, and the tuples are built directly
    # (RecordedEvent is a named tuple; its generated __new__ costs twice as much for the same result).
    types = headers.get(_TYPE) if headers else None
    if types is None:
        raise EventDecodeError(
            f"Message at position {position} on {stream_id} has no {Header.TYPE} header: it was not "
            "written by jetsourcing. Keep foreign messages off the event subjects."
        )
    assert headers is not None
    try:
        last_version = int(headers[_VERSION])
        recorded_at = headers[_RECORDED_AT]
        correlation_id = headers.get(_CORRELATION_ID)
        causation_id = headers.get(_CAUSATION_ID)
        escaped_key = headers.get(_IDEMPOTENCY_KEY)
        key = None if escaped_key is None else unquote(escaped_key, errors="surrogatepass")
        if "," not in types:
            return [
                _new_event(
                    RecordedEvent,
                    (position, 0, stream_id, last_version, types, int(headers[_SCHEMA_VERSION]),
                     headers[_EVENT_ID], body, recorded_at, correlation_id, causation_id, registry, [], key),
                )
            ]
        type_list = types.split(",")
        schemas = headers[_SCHEMA_VERSION].split(",")
        ids = headers[_EVENT_ID].split(",")
        payloads = body.split(b"\n")
        count = len(type_list)
        if not (len(schemas) == len(ids) == len(payloads) == count):
            raise ValueError("header lists and body lines differ in length")
        first = last_version - count + 1
        return [
            _new_event(
                RecordedEvent,
                (position, i, stream_id, first + i, type_list[i], int(schemas[i]), ids[i], payloads[i],
                 recorded_at, correlation_id, causation_id, registry, [], key),
            )
            for i in range(count)
        ]
    except KeyError as exc:
        raise EventDecodeError(
            f"Malformed commit at position {position} on {stream_id}: it has no {exc} header, so it was not written "
            "by jetsourcing. Keep foreign messages off the event subjects."
        ) from exc
    except ValueError as exc:
        raise EventDecodeError(f"Malformed commit at position {position} on {stream_id}: {exc}") from exc


_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() strips


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """Parse a NATS header block (``Name: Value\\r\\n`` lines) exactly as nats-py does, faster."""
    if raw.isascii():
        # The common case (a direct get reply carries a dozen headers): one decode for the whole block.
        fields: dict[str, str] = {}
        for text in raw.decode("ascii").split("\r\n"):
            label, colon, content = text.partition(":")
            label = label.strip(_ASCII_SPACE)
            if colon and (not label or label.split() == [label]):  # as nats-py: no whitespace inside
                fields[label] = content.strip(_ASCII_SPACE)
        return fields
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        # str.split() splits on exactly the characters str.isspace() accepts,
        # so this drops names with whitespace inside, as nats-py does.
        if key and key.split() != [key]:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out
