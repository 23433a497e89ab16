"""The dead-letter stream of reactors: where events go that a reactor gave up on.

Every event store stream ``<STREAM>`` gets one dead-letter stream
``<STREAM>_DLQ`` (created on first use, idempotently) on the subjects
``<prefix>_dlq.<reactor name>``, so one reactor's dead letters can be read
alone. A dead letter is the original commit, unchanged (body and ``Es-*``
headers, so it decodes like any stored commit), plus the headers of
:class:`DeadLetterHeader` saying which reactor gave up, why, after how many
deliveries, and where the commit is in the event stream.

A dead letter is published with ``Nats-Msg-Id`` ``<reactor>:<position>``, so
the same commit dead-lettered twice by one reactor within the stream's
duplicate window (a worker and the max-deliveries advisory racing, or a retry
after a lost acknowledgement) is stored once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from eventstore import EventStore, EventStoreError, EventStoreSettings, Header, RecordedEvent, StreamConfigError, StreamId
from eventstore.errors import map_nats_error
from eventstore.jetstream import ErrorCode, ride_out_jetstream
from eventstore.wire import NATS_HEADER_PREFIX, DeadLetterHeader, decode_commit, utc_now_text

from .errors import DeadLetterStreamError

__all__ = [
    "DeadLetterHeader",
    "DeadLetterReason",
    "ReactorDeadLetter",
    "dead_letter_stream",
    "dead_letter_subject",
    "delete_dead_letter",
    "drop_reactor_dead_letters",
    "ensure_dead_letter_stream",
    "publish_dead_letter",
    "read_reactor_dead_letters",
]

_MAX_ERROR_TEXT = 1000

log = logging.getLogger("jetsourcing.reactors")


class DeadLetterReason(str, Enum):
    """Why a reactor gave up on an event."""

    POISON = "poison"
    """The handler raised :class:`~projections.reactors.PoisonEvent`: retrying cannot help."""
    MAX_DELIVER = "max_deliver"
    """The event failed on each of the reactor's ``max_deliver`` deliveries."""
    UNDECODABLE = "undecodable"
    """The stored commit could not be decoded into events (it was not written by jetsourcing)."""


def dead_letter_stream(settings: EventStoreSettings) -> str:
    """The name of the dead-letter stream of the event store configured by ``settings``."""
    return f"{settings.stream}_DLQ"


def dead_letter_subject(settings: EventStoreSettings, reactor: str | None = None) -> str:
    """The subject of ``reactor``'s dead letters (the wildcard of every reactor's when None)."""
    return f"{settings.subject_prefix}_dlq.{reactor if reactor else '>'}"


@dataclass(frozen=True, slots=True)
class ReactorDeadLetter:
    """One event commit a reactor gave up on, as stored in the dead-letter stream.

    ``events`` are the commit's events decoded with the store's registry (empty
    when the commit itself is undecodable; ``data`` and ``headers`` then hold
    it raw). ``position`` and ``subject`` say where the commit is in the event
    stream; ``dlq_position`` where the dead letter is in the dead-letter stream.
    """

    reactor: str
    reason: DeadLetterReason
    error: str
    deliveries: int
    position: int
    subject: str
    dead_lettered_at: datetime
    dlq_position: int
    events: tuple[RecordedEvent, ...] = ()
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    data: bytes = field(default=b"", repr=False)


def _header_text(text: str) -> str:
    # Header values cannot hold line breaks; keep the text on one line and bounded.
    flat = " ".join(text.split())
    return flat if len(flat) <= _MAX_ERROR_TEXT else flat[: _MAX_ERROR_TEXT - 3] + "..."


async def ensure_dead_letter_stream(
    store: EventStore, *, long_running: bool = False, stop: asyncio.Event | None = None
) -> str:
    """Create the dead-letter stream if it does not exist (safe to call from many workers at once); return its name.

    An existing stream is never changed; it must take the dead-letter subjects.
    A server that does not answer, or answers "not now" (an election), raises
    :class:`~eventstore.ServerUnavailableError` within a few ``request_timeout_s``;
    with ``long_running`` (a worker's start) the call is retried instead, for as
    long as the outage policy says (``outage_limit_s``) or until ``stop`` is set.
    """
    settings = store.settings
    name = dead_letter_stream(settings)
    return await ride_out_jetstream(
        lambda: _ensure_dead_letter_stream(store, name), what=f"Creating the dead-letter stream {name!r}", logger=log,
        timeout_s=settings.request_timeout_s, requests=4,  # at most two reads and two creates
        limit_s=settings.outage_limit_s if long_running else 0.0, stop=stop,
    )


async def _ensure_dead_letter_stream(store: EventStore, name: str) -> str:
    """One attempt of :func:`ensure_dead_letter_stream`; a silent or electing server's errors pass through."""
    settings = store.settings
    subjects = [dead_letter_subject(settings)]
    js = store.nc.jetstream(timeout=settings.request_timeout_s)
    for _ in range(2):
        try:
            with map_nats_error(f"Reading the dead-letter stream {name!r}", settings.request_timeout_s):
                info = await js.stream_info(name)
        except NotFoundError:
            config = StreamConfig(
                name=name,
                description=f"Events the reactors of stream {settings.stream} gave up on.",
                subjects=subjects,
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                discard=DiscardPolicy.OLD,
                duplicate_window=settings.duplicate_window_s,
                num_replicas=settings.replicas,
                allow_direct=True,
            )
            try:
                with map_nats_error(f"Creating the dead-letter stream {name!r}", settings.request_timeout_s):
                    await js.add_stream(config)
                return name
            except APIError as exc:
                if exc.err_code == ErrorCode.STREAM_NAME_IN_USE:
                    continue  # another worker created it just now
                raise DeadLetterStreamError(f"Could not create the dead-letter stream {name!r}: {exc}") from exc
        except APIError as exc:
            raise DeadLetterStreamError(f"Could not read the dead-letter stream {name!r}: {exc}") from exc
        if subjects[0] not in (info.config.subjects or []):
            raise DeadLetterStreamError(
                f"Stream {name!r} exists but does not take the subjects {subjects[0]!r}, so it cannot hold dead "
                "letters. Delete or rename that stream, or use another event store stream name."
            )
        return name
    raise DeadLetterStreamError(f"Could not create or find the dead-letter stream {name!r}.")


async def publish_dead_letter(
    nc: NATS,
    settings: EventStoreSettings,
    *,
    reactor: str,
    reason: DeadLetterReason,
    error: str,
    deliveries: int,
    position: int,
    subject: str,
    headers: Mapping[str, str] | None,
    data: bytes,
) -> bool:
    """Store one dead letter and wait for the server's acknowledgement; return False if it was a duplicate.

    The original commit's own ``Nats-*`` headers (message id, expected
    sequences) are dropped: they would make the server deduplicate or reject
    the dead letter.
    """
    out = {k: v for k, v in (headers or {}).items() if not k.startswith(NATS_HEADER_PREFIX)}
    out.update(
        {
            Header.MSG_ID: f"{reactor}:{position}",
            DeadLetterHeader.REACTOR: reactor,
            DeadLetterHeader.REASON: reason.value,
            DeadLetterHeader.ERROR: _header_text(error) or "-",
            DeadLetterHeader.DELIVERIES: str(deliveries),
            DeadLetterHeader.POSITION: str(position),
            DeadLetterHeader.SUBJECT: subject,
            DeadLetterHeader.STREAM: settings.stream,
            DeadLetterHeader.AT: utc_now_text(),
        }
    )
    target = dead_letter_subject(settings, reactor)
    try:
        reply = await nc.request(target, data, timeout=settings.request_timeout_s, headers=out)
        ack = json.loads(reply.data)
    except (NatsError, asyncio.TimeoutError, ValueError) as exc:
        raise DeadLetterStreamError(
            f"Could not store the dead letter of position {position} for reactor {reactor!r} on {target!r}: {exc}"
        ) from exc
    if "error" in ack:
        raise DeadLetterStreamError(
            f"The server refused the dead letter of position {position} for reactor {reactor!r}: "
            f"{ack['error'].get('description', ack['error'])}"
        )
    return not ack.get("duplicate", False)


async def read_reactor_dead_letters(store: EventStore, reactor: str | None = None) -> list[ReactorDeadLetter]:
    """Every dead letter (of ``reactor``, or of every reactor), oldest first; empty when there is no dead-letter stream."""
    settings = store.settings
    name = dead_letter_stream(settings)
    letters: list[ReactorDeadLetter] = []
    pages = store.read_messages(name, filter_subjects=[dead_letter_subject(settings, reactor)])
    try:
        async for page in pages:
            letters += [_letter(store, seq, headers, data) for seq, _, headers, data in page]
    except StreamConfigError:
        return []  # no dead-letter stream: nothing was ever dead-lettered
    return letters


def _letter(store: EventStore, seq: int, headers: dict[str, str], data: bytes) -> ReactorDeadLetter:
    """The dead letter stored at ``seq`` of the dead-letter stream."""
    position = int(headers.get(DeadLetterHeader.POSITION, "0"))
    subject = headers.get(DeadLetterHeader.SUBJECT, "")
    events: tuple[RecordedEvent, ...] = ()
    try:
        stream_id = StreamId.from_subject(subject, store.settings.subject_prefix)
        events = tuple(decode_commit(stream_id, position, headers, data, store.registry))
    except EventStoreError:
        pass  # an undecodable commit: the raw headers and data are kept
    return ReactorDeadLetter(
        reactor=headers.get(DeadLetterHeader.REACTOR, ""),
        reason=DeadLetterReason(headers.get(DeadLetterHeader.REASON, DeadLetterReason.MAX_DELIVER.value)),
        error=headers.get(DeadLetterHeader.ERROR, ""),
        deliveries=int(headers.get(DeadLetterHeader.DELIVERIES, "0")),
        position=position,
        subject=subject,
        dead_lettered_at=datetime.fromisoformat(headers[DeadLetterHeader.AT]),
        dlq_position=seq,
        events=events,
        headers=headers,
        data=data,
    )


async def drop_reactor_dead_letters(store: EventStore, reactor: str, position: int | None) -> int:
    """Delete ``reactor``'s dead letters of the commit at stream ``position`` (every one when None) from the
    dead-letter stream, as handled by hand; returns how many there were."""
    letters = [d for d in await read_reactor_dead_letters(store, reactor) if position is None or d.position == position]
    for letter in letters:
        await delete_dead_letter(store, letter)
    return len(letters)


async def delete_dead_letter(store: EventStore, letter: ReactorDeadLetter) -> None:
    """Delete one dead letter from the dead-letter stream."""
    js = store.nc.jetstream(timeout=store.settings.request_timeout_s)
    try:
        await js.delete_msg(dead_letter_stream(store.settings), letter.dlq_position)
    except (NatsError, asyncio.TimeoutError) as exc:
        raise DeadLetterStreamError(
            f"Could not delete the dead letter of position {letter.position} for reactor {letter.reactor!r}: {exc}"
        ) from exc
