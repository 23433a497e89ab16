"""Appending: optimistic concurrency checked by the server, deduplication, atomic multi-entity commits.

How an append is made safe:

* **Concurrency.** Each commit carries ``Nats-Expected-Last-Subject-Sequence``:
  the stream position of the entity's last commit as the appender saw it. The
  server rejects the commit (``err_code`` 10071) if anything was written to the
  subject since. The appender keeps the last (version, position) of every
  entity it read or wrote, so an append after a load needs no lookup; on a
  miss it looks the entity's last commit up with one direct get.
* **Back pointers.** Each commit also carries ``Es-Previous``: the positions
  of the entity's previous commits (up to :data:`~.wire.PREVIOUS_COMMITS`),
  built from the previous commit's own pointers when the appender knows them
  (it read or wrote that commit), else just the previous position.
  :meth:`Appender.commits` walks them; it serves loads (see :mod:`.reading`),
  :meth:`Appender.find_append` and the keyed search of a retried append.
* **Atomicity.** One append to one entity is one message (see :mod:`.wire`),
  stored whole or not at all. An append spanning several entities is one
  JetStream atomic batch: every entity's commit is stored, or none is.
* **Idempotency.** Every commit carries a ``Nats-Msg-Id`` derived from the
  append's id (the caller's idempotency key, escaped injectively, or a fresh
  one reused by every resend of this call); a keyed commit also carries the key
  (``Es-Idempotency-Key``). A resent commit that the server already stored is
  recognised in three ways: the server's duplicate acknowledgement; the
  server's "duplicate message id" refusal of an atomic batch; or, when the
  concurrency check fires first (it runs before deduplication), by finding this
  append's id on the commit that follows the expected position or, for a keyed
  append, anywhere on the entity. Either way the caller gets the positions and
  versions of the first write with ``duplicate=True`` and nothing is stored twice,
  and the ``note`` that write stored with its commit (a command's reply value,
  say), so a resend learns what the first call's caller learnt.
* **Every call ends.** Resends after a lost acknowledgement back off
  exponentially with jitter, at most ``append_retries`` of them; an ``ANY``
  append that lost a race retries after a short jittered pause, for at most
  ``10 * request_timeout_s * (append_retries + 1)``. Then a typed error is raised. When no send was
  answered, at most half a ``request_timeout_s`` more asks the server whether it answers at all, to tell a
  lost server (:class:`ServerUnavailableError`) from one whose disk failed (:class:`StorageError`). An atomic
  append the server refuses as incomplete (it lost the staged batch) is resent the same way, and told apart
  the same way when every send was refused.
* **Size.** A commit is checked as sent, header block included, against the
  server's ``max_payload`` before anything is sent: a larger one raises
  :class:`EventTooLargeError` (the server would close the connection on it).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError
from nats.errors import Error as NatsError
from pydantic import BaseModel

from .errors import (
    ConcurrencyError,
    EventStoreClosedError,
    EventStoreError,
    EventTooLargeError,
    HistoryGapError,
    InvalidArgumentError,
    InvalidEventError,
    ServerUnavailableError,
    StorageError,
    StreamConfigError,
    server_unavailable,
    store_closed,
)
from .events import ANY, NO_STREAM, AppendResult, ExpectedVersion, StreamState
from .history import check_history, commit_place
from .jetstream.inbox import Inbox
from .jetstream.api import ErrorCode, Subjects
from .registry import TypeRegistry
from .settings import EventStoreSettings
from .streams import StreamId
from .validation import check_entity_append
from .wire import (
    PREVIOUS_COMMITS,
    Header,
    check_idempotency_key,
    check_metadata,
    check_note,
    commit_previous,
    commit_version,
    encode_commit,
    escape_key,
    header_block_size,
    msg_id,
    note_of,
    utc_now_text,
)

__all__ = ["Appender", "EntityAppend", "MAX_ENTITIES_PER_APPEND"]

MAX_ENTITIES_PER_APPEND = 1000
"""The server refuses atomic batches of more than 1,000 messages (one message per entity)."""

# Answers of a replicated stream's leader that mean "not now": the pre-check of its proposal cannot decide this send
# while another write it concerns is proposed but not yet applied (an earlier send of this very append, or another
# writer's append to the entity); nothing of this send is stored, and a resend once that write lands is answered
# for real (a duplicate ack, or a decided conflict). nats-server's jetstream_batching.go:
# JSStreamDuplicateMessageConflict (the msg id in process), JSStreamWrongLastSequenceConstantErr (the subject in
# process; nats-py's key-value code takes it for a conflict, which it is not yet), and
# JSStreamExpectedLastSeqPerSubjectNotReady.
_NOT_NOW: Final = {ErrorCode.MSG_ID_IN_PROCESS: "its msg id is in process",
                   ErrorCode.SUBJECT_WRITE_IN_PROCESS: "a write to its subject is in process",
                   ErrorCode.LAST_SEQUENCE_UNKNOWN: "the subject's last sequence is not known yet"}
# A scan of the stream between from_position and the last commit costs the server about 0.1 us per message;
# a walk costs a round trip (~0.3 ms) per PREVIOUS_COMMITS commits. So a span this small is always scanned,
# and so is an entity whose last PREVIOUS_COMMITS commits lie within this many messages each (dense: a scan
# reads few other messages per commit). load_scan_vs_chain in benchmarks/bench_aggregates.py measures both.
_SCAN_SPAN: Final = 2000
_SCAN_SPAN_PER_COMMIT: Final = 256
# An ANY append that loses races keeps trying for this many times request_timeout_s * (append_retries + 1):
# every lost race is another writer's progress, so giving up early would fail appends that would succeed.
_RACE_BUDGET_FACTOR = 10


class LeaderWait:
    """Retries of answers that mean "not now" within ``timeout_s`` of the first, with jittered backoff: "no
    responders" (503), or a subject with a write in flight (10164).

    A replicated stream has no leader for a few seconds after its leader is
    lost (an election) or steps down, and JetStream answers nothing for it:
    the client sees a 503. The answer means nobody received the request, so
    sending it again is safe.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waited = 0
        self._since: float | None = None
        self._step = 0.05

    async def again(self) -> bool:
        """Wait before the next try and return True, or return False at once when ``timeout_s`` has passed."""
        now = asyncio.get_running_loop().time()
        if self._since is None:
            self._since = now
        left = self._since + self.timeout_s - now
        if left <= 0:
            return False
        self.waited += 1
        await asyncio.sleep(min(left, random.uniform(self._step / 2, self._step)))
        self._step = min(self._step * 2, 1.0)
        return True


def _lost_reply(msgs: list[Msg]) -> bool:
    """Whether a direct get batch's answer lacks a message: the server names in each message the sequence of
    the one it sent before (``Nats-Last-Sequence``, 0 for the first) and in the closing status the last one."""
    before = "0"
    for msg in msgs:
        headers = msg.headers or {}
        named = headers.get(Header.LAST_SEQUENCE)
        if named is None:
            return False  # a single get, a "no results" status, or a server that does not say
        if named != before:
            return True
        before = headers.get(Header.SEQUENCE, "")
    return False


def _no_responders(msg: Msg) -> bool:
    return not msg.data and bool(msg.headers) and (msg.headers or {}).get(Header.STATUS) == "503"


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
class _Commit:
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
) -> _Commit:
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
    return _Commit(request, subject, commit_msg_id, types, versions, ids, payloads, key, note)


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


def check_commit_size(commit: _Commit, headers: dict[str, str], body: bytes, limit: int) -> None:
    """Refuse, before anything is sent, a commit the server would refuse by closing the connection."""
    header_size = header_block_size(headers)
    if header_size + len(body) > limit:
        raise EventTooLargeError(
            f"The commit of {len(commit.payloads)} event(s) to {commit.request.stream_id} takes "
            f"{header_size + len(body)} bytes as sent ({header_size} of headers, {len(body)} of events), more than "
            f"the server's max_payload of {limit} bytes. Nothing was stored. Keep large blobs out of events and long "
            "values out of correlation ids and keys, split the append, or raise max_payload on the server."
        )


class _Conflict(Exception):
    """The server rejected the append: its concurrency check, or (``duplicate_id``) a batch's known msg id."""

    def __init__(self, duplicate_id: bool = False) -> None:
        super().__init__()
        self.duplicate_id = duplicate_id


_STORAGE_FAILED: Final = (
    "its storage has most likely failed (the disk is full or read-only; its log says \"critical write error\"), and "
    "nats-server stores nothing more on this stream until it is restarted. Free space or make the disk writable, "
    "restart the server, then retry with the same idempotency key."
)


def _what_was_stored(resent: bool) -> str:
    """What a failed append says of its sends: an unanswered earlier send may have been stored."""
    if resent:
        return ("An earlier send went unanswered and may have been stored: retry with the same idempotency key to "
                "find out safely.")
    return "Nothing was stored by this call."


async def _back_off(tries: int) -> None:
    """Exponential back-off with jitter before resend number ``tries``."""
    await asyncio.sleep(0.05 * 2 ** (tries - 1) * random.uniform(0.5, 1.0))


class _Incomplete(Exception):
    """The server refused an atomic batch as incomplete: it lost staged messages (a restart, or a failed write)."""


class _NotNow(Exception):
    """The server cannot decide the send while another write it concerns is in flight (see ``_NOT_NOW``)."""


class Appender:
    """Writes commits; one per event store connection. See the module docs for the guarantees."""

    def __init__(
        self, nc: NATS, inbox: Inbox, settings: EventStoreSettings, registry: TypeRegistry, cache_size: int = 100_000
    ) -> None:
        self._nc = nc
        self._inbox = inbox
        self._settings = settings
        self._subjects = Subjects(settings.stream)
        self._registry = registry
        # stream -> (version, position, back pointers of the commit at position, when known)
        self._known: OrderedDict[StreamId, tuple[int, int, tuple[int, ...] | None]] = OrderedDict()
        self._cache_size = cache_size
        # Entities a load of this store found broken (a hole, a forged commit): appends and lookups read them
        # whole again first, so nothing is built on them until the stream is repaired.
        self._broken: OrderedDict[StreamId, None] = OrderedDict()

    # -- entity state cache -------------------------------------------------

    def remember(
        self, stream_id: StreamId, version: int, position: int, previous: tuple[int, ...] | None = None
    ) -> None:
        """Note an entity's (version, position) as just read or written, so the next append skips a lookup;
        ``previous``: the back pointers of the commit at ``position``, so the next commit's extend them."""
        known = self._known.get(stream_id)
        if known is not None and known[1] > position:
            return
        if previous is None and known is not None and known[1] == position:
            previous = known[2]
        self._known[stream_id] = (version, position, previous)
        self._known.move_to_end(stream_id)
        if len(self._known) > self._cache_size:
            self._known.popitem(last=False)

    def mark_broken(self, stream_id: StreamId) -> None:
        """Note that a load found the entity's history broken: forget its state, and until a load from its start
        reads it whole, let :meth:`state` and every append read it whole first (and raise while it is not)."""
        self._known.pop(stream_id, None)
        self._broken[stream_id] = None
        self._broken.move_to_end(stream_id)
        if len(self._broken) > self._cache_size:
            self._broken.popitem(last=False)

    def mark_whole(self, stream_id: StreamId) -> None:
        """Note that a load read the entity whole from its start (undoes :meth:`mark_broken`)."""
        self._broken.pop(stream_id, None)

    async def _recheck(self, stream_id: StreamId) -> None:
        """Raise :class:`HistoryGapError` while an entity a load found broken still is (see :meth:`mark_broken`)."""
        if self._broken and stream_id in self._broken:
            await self.commits(stream_id, what=f"Checking the history of {stream_id}")  # pops it when whole

    async def direct_get(self, payload: dict[str, object], *, what: str) -> list[Msg]:
        """One direct get batch request for the operation ``what``; returns the data messages (not the status).

        Retried while nobody answers (a replicated stream between leaders), and when a message of the answer
        was lost on the way (each names the one sent before it), up to ``request_timeout_s``: an answer short of
        a message is never taken for a shorter history.
        """
        wait = LeaderWait(self._settings.request_timeout_s)
        while True:
            msgs = await self._inbox.request(
                self._subjects.direct_get(),
                json.dumps(payload).encode(),
                self._settings.request_timeout_s,
                what=what,
                many=True,
            )
            if _lost_reply(msgs):
                if await wait.again():
                    continue
                raise ServerUnavailableError(
                    f"{what}: messages of the server's answers were lost on the way for {self._settings.request_timeout_s}s "
                    "(a lossy connection or an overloaded client). Nothing was read; retry, and check the network."
                )
            if not _no_responders(msgs[-1]):
                break
            await self._await_leader(wait, what)
        status = (msgs[-1].headers or {}).get(Header.STATUS, "")
        if status not in ("204", "404"):
            raise ServerUnavailableError(f"{what}: the server answered with status {status}.")
        return msgs[:-1]

    async def state(self, stream_id: StreamId) -> StreamState:
        """The entity's current version and last position, read from the server (0, 0 without events)."""
        await self._recheck(stream_id)
        subject = stream_id.subject(self._settings.subject_prefix)
        msgs = await self.direct_get({"multi_last": [subject], "batch": 1}, what=f"Reading the version of {stream_id}")
        if not msgs:
            return StreamState(stream_id, 0, 0)
        headers = msgs[0].headers or {}
        position = int(headers[Header.SEQUENCE])
        # A foreign message, or a commit that contradicts itself (a forged restart), is nothing to build on.
        _, version, _ = commit_place(stream_id, position, headers)
        state = StreamState(stream_id, version, position)
        self.remember(stream_id, state.version, state.position, commit_previous(headers, stream_id))
        return state

    async def get_each(self, positions: list[int], *, what: str) -> list[Msg | None]:
        """The message at each position (None where there is none): direct gets by sequence, O(1) each on the
        server, all sent before the first reply is awaited."""
        wait = LeaderWait(self._settings.request_timeout_s)
        while True:
            msgs = await self._inbox.request_each(
                self._subjects.direct_get(),
                [b'{"seq":%d}' % p for p in positions],
                self._settings.request_timeout_s,
                what=what,
            )
            if not any(_no_responders(m) for m in msgs):
                break
            await self._await_leader(wait, what)
        found: list[Msg | None] = []
        for msg in msgs:
            status = (msg.headers or {}).get(Header.STATUS)
            if status is not None and status != "404":
                raise ServerUnavailableError(f"{what}: the server answered with status {status}.")
            found.append(None if status else msg)
        return found

    def back_pointers(self, stream_id: StreamId, prev_position: int) -> tuple[int, ...]:
        """The ``Es-Previous`` of a commit that follows the entity's commit at ``prev_position`` (0: none)."""
        if prev_position == 0:
            return (0,)
        known = self._known.get(stream_id)
        if known is not None and known[1] == prev_position and known[2] is not None:
            return (prev_position, *known[2][: PREVIOUS_COMMITS - 1])
        return (prev_position,)

    async def find_append(self, stream_id: StreamId, idempotency_key: str, from_position: int = 1) -> AppendResult | None:
        """The commit an earlier append with exactly ``idempotency_key`` stored on this entity at ``from_position``
        or later, if any."""
        key = check_idempotency_key(idempotency_key)
        if key is None:
            raise InvalidArgumentError("find_append needs an idempotency_key (a non-empty str), not None.")
        found, _ = await self._search(stream_id, escape_key(key), None, from_position)
        if found is None:
            return None
        headers = found.headers or {}
        count = headers[Header.TYPE].count(",") + 1
        last = int(headers[Header.VERSION])
        return AppendResult(stream_id, int(headers[Header.SEQUENCE]), last - count + 1, last, True, note_of(headers))

    async def _search(
        self, stream_id: StreamId, escaped_key: str | None, commit_msg_id: str | None, from_seq: int = 1
    ) -> tuple[Msg | None, int]:
        """The entity's first commit from ``from_seq`` on of the append keyed ``escaped_key`` (or whose msg id is
        ``commit_msg_id``), and the last position searched. Reading the entity remembers its last commit, which
        spares a retry its lookup."""
        last = from_seq - 1
        for msg in await self.commits(stream_id, from_position=from_seq, what=f"Searching {stream_id} for an earlier append"):
            if _is_commit_of(msg, escaped_key, commit_msg_id):
                return msg, last
            last = int((msg.headers or {})[Header.SEQUENCE])
        return None, last

    async def subject_pages(
        self, subject: str, from_seq: int = 1, page: int = 1000, *, what: str
    ) -> AsyncIterator[list[Msg]]:
        """Every message on ``subject`` from ``from_seq`` on, in pages of direct get batches, for the operation ``what``."""
        seq = from_seq
        while True:
            msgs = await self.direct_get({"seq": seq, "next_by_subj": subject, "batch": page}, what=what)
            if msgs:
                yield msgs
            if not msgs or (msgs[-1].headers or {}).get(Header.NUM_PENDING, "0") == "0":
                return
            seq = int((msgs[-1].headers or {})[Header.SEQUENCE]) + 1

    # -- loading an entity ---------------------------------------------------

    async def commits(
        self,
        stream_id: StreamId,
        *,
        from_position: int = 1,
        how: Literal["auto", "chain", "scan"] = "auto",
        what: str | None = None,
    ) -> list[Msg]:
        """The entity's commits from ``from_position`` on, in order, up to its last commit at the call (which is
        remembered for the next append), for the operation ``what`` (default "Reading <entity>").

        ``how`` picks the method (see the module docs of :mod:`.reading`): "auto" scans a short span or a dense
        entity, as the last commit's back pointers tell, and walks the pointers otherwise.
        Checked by :func:`~.history.check_history` before anything is remembered: a back pointer leading off
        the entity, versions that do not run on (from 1, when reading from the start), or pointers that skip a
        commit raise :class:`HistoryGapError` naming the position (the reader retries it through the stream's
        leader); a foreign message raises :class:`EventDecodeError`.
        """
        subject = stream_id.subject(self._settings.subject_prefix)
        what = what or f"Reading {stream_id}"
        last = await self.direct_get({"multi_last": [subject], "batch": 1}, what=what)
        if not last or int((last[0].headers or {})[Header.SEQUENCE]) < from_position:
            return []
        newest = last[0]
        position = int((newest.headers or {})[Header.SEQUENCE])
        previous = commit_previous(newest.headers, stream_id)
        dense = (
            previous is not None
            and len(previous) == PREVIOUS_COMMITS
            and position - previous[-1] <= PREVIOUS_COMMITS * _SCAN_SPAN_PER_COMMIT
        )
        if how == "scan" or (how == "auto" and (position - from_position <= _SCAN_SPAN or dense)):
            found = await self._scan(subject, from_position, newest, what)
        else:
            found = await self._walk(stream_id, subject, from_position, newest, what)
        # Only a whole history is remembered: the next append must never build on one with a hole.
        check_history(stream_id, [(int((m.headers or {})[Header.SEQUENCE]), m.headers) for m in found],
                      due=1 if from_position <= 1 else None)
        if from_position <= 1 and self._broken:
            self.mark_whole(stream_id)
        self.remember(stream_id, commit_version(newest.headers, stream_id), position, previous)
        return found

    async def _walk(self, stream_id: StreamId, subject: str, from_position: int, newest: Msg, what: str) -> list[Msg]:
        """The entity's commits from ``from_position`` up to ``newest`` (inclusive), by their back pointers."""
        walked = [newest]  # newest first
        previous = commit_previous(newest.headers, stream_id)
        while True:
            if previous is None:  # a commit written before back pointers: scan what lies below it
                older = await self._scan(subject, from_position, walked[-1], what)
                return older[:-1] + walked[::-1]
            wanted = [p for p in previous if p >= max(1, from_position)]
            pointing = int((walked[-1].headers or {})[Header.SEQUENCE])
            if wanted:
                got = await self.get_each(wanted, what=what)
                for p, msg in zip(wanted, got):
                    if msg is None or (msg.headers or {}).get(Header.SUBJECT) != subject:
                        # Deleted, not yet on the replica that answered, or a forged pointer: the reader retries
                        # through the stream's leader, which tells them apart.
                        raise HistoryGapError(
                            stream_id, pointing, None,
                            f"the back pointer of the commit there leads to position {p}, which holds no commit of "
                            "that entity",
                        )
                    walked.append(msg)
            if len(wanted) < len(previous):  # reached from_position, or the entity's start (a 0)
                return walked[::-1]
            previous = commit_previous(walked[-1].headers, stream_id)

    async def _scan(self, subject: str, from_position: int, newest: Msg, what: str) -> list[Msg]:
        """The entity's commits from ``from_position`` up to ``newest`` (inclusive), by ``next_by_subj`` batches."""
        stop = int((newest.headers or {})[Header.SEQUENCE])
        found: list[Msg] = []
        async for msgs in self.subject_pages(subject, from_position, what=what):
            for msg in msgs:
                if int((msg.headers or {})[Header.SEQUENCE]) >= stop:
                    return [*found, newest]
                found.append(msg)
        return [*found, newest]

    # -- building commits ---------------------------------------------------

    async def _resolve_previous(self, commit: _Commit) -> None:
        """Find the version and position the commit must follow, raising ConcurrencyError early when known."""
        request = commit.request
        expected = request.expected_version
        if expected is NO_STREAM or expected == 0:
            commit.prev_version, commit.prev_position = 0, 0
            return
        await self._recheck(request.stream_id)
        if isinstance(expected, int) and request.expected_position is not None:
            commit.prev_version, commit.prev_position = expected, request.expected_position
            return
        known = self._known.get(request.stream_id)
        if known is not None and (expected is ANY or known[0] == expected):
            commit.prev_version, commit.prev_position = known[0], known[1]
            return
        state = await self.state(request.stream_id)
        if isinstance(expected, int) and state.version != expected:
            commit.prev_version, commit.prev_position = expected, -1  # position unknown: only "mine?" checks remain
            raise _Conflict
        commit.prev_version, commit.prev_position = state.version, state.position

    # -- the append ---------------------------------------------------------

    async def append(
        self,
        requests: Sequence[EntityAppend],
        *,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> list[AppendResult]:
        """Append every request's events atomically (all entities or none); see the module docs."""
        key, correlation_id, causation_id = check_append(requests, idempotency_key, correlation_id, causation_id, note)
        append_id = escape_key(key) if key is not None else secrets.token_hex(16)
        single = len(requests) == 1
        prefix = self._settings.subject_prefix
        commits = [build_commit(self._registry, prefix, r, msg_id(append_id, None if single else i), key, note)
                   for i, r in enumerate(requests)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._race_budget_s()
        races = 0
        while True:
            try:
                if single:  # no gather: a task per append costs more than the lookup it would overlap
                    await self._resolve_previous(commits[0])
                else:
                    await asyncio.gather(*(self._resolve_previous(c) for c in commits))
                positions, duplicate = await self._publish(commits, correlation_id, causation_id)
                if duplicate:  # the server's duplicate ack: versions come from the stored commits
                    positions = await self._read_stored(commits, positions)
            except _Conflict as conflict:
                stored = await self._find_stored(commits)
                if stored is not None:
                    positions, duplicate = stored, True
                elif conflict.duplicate_id:
                    raise self._reused_key_error(commits) from None
                elif any(c.request.expected_version is ANY for c in commits) and not await self._exact_conflict(commits):
                    # Only ANY entities moved: refresh them (unless a search just did) and try again. Losing a
                    # race is contention, not overload: short jittered pauses spread the writers out.
                    for c in commits:
                        if self._known.get(c.request.stream_id, (0, c.prev_position, None))[1] == c.prev_position:
                            self._known.pop(c.request.stream_id, None)
                    races += 1
                    delay = random.uniform(0, min(0.05, 0.001 * 2**races))
                    if loop.time() + delay > deadline:
                        raise await self._race_lost_error(commits) from None
                    await asyncio.sleep(delay)
                    continue
                else:
                    raise await self._conflict_error(commits) from None
            results = [c.result(p, duplicate) for c, p in zip(commits, positions)]
            for c, r in zip(commits, results):
                self.remember(r.stream_id, r.last_version, r.position, c.previous)
            return results

    async def _publish(
        self, commits: list[_Commit], correlation_id: str | None, causation_id: str | None
    ) -> tuple[list[int], bool]:
        recorded_at = utc_now_text()
        for c in commits:
            c.previous = self.back_pointers(c.request.stream_id, c.prev_position)
        encoded = [c.encode(recorded_at, correlation_id, causation_id) for c in commits]

        def check_size(sent: list[tuple[str, dict[str, str], bytes]]) -> None:
            for c, (_, headers, body) in zip(commits, sent):
                check_commit_size(c, headers, body, self._nc.max_payload)

        async def stored() -> bool:
            return await self._find_stored(commits) is not None

        ack = await self.send(
            [(c.subject, headers, body) for c, (headers, body) in zip(commits, encoded)],
            target=str(commits[-1].request.stream_id), others=f"{len(commits) - 1} other entities",
            check_size=check_size, stored=stored,
        )
        last = int(ack["seq"])
        return [last - len(commits) + 1 + i for i in range(len(commits))], bool(ack.get("duplicate"))

    async def send(
        self,
        messages: list[tuple[str, dict[str, str], bytes]],
        *,
        target: str,
        others: str,
        check_size: Callable[[list[tuple[str, dict[str, str], bytes]]], None],
        stored: Callable[[], Awaitable[bool]],
    ) -> dict[str, Any]:
        """Send (subject, headers, body) messages as one commit (one message, or an atomic batch of them) and
        return the server's acknowledgement, resending as the module docs say.

        ``target`` names what is appended to ("Account/42"), ``others`` what else the batch holds ("2 other
        entities"), both for the errors; ``check_size`` refuses messages too large before the first send;
        ``stored()`` says whether the append is stored (asked to tell a failed disk from a lost server).
        A failed concurrency check raises ``_Conflict``, a msg id the server already stored in a batch
        ``_Conflict(duplicate_id=True)``; other refusals raise typed errors.
        """
        attempts = self._settings.append_retries + 1
        wait = LeaderWait(self._settings.request_timeout_s)
        attempt = unanswered = incomplete = 0
        what = f"Appending to {target}"
        while True:
            if len(messages) > 1:
                batch_id = uuid.uuid4().hex  # a batch id per send: the server refuses reused ones; msg ids dedupe
                for i, (_, headers, _) in enumerate(messages, start=1):
                    headers[Header.BATCH_ID] = batch_id
                    headers[Header.BATCH_SEQUENCE] = str(i)
                messages[-1][1][Header.BATCH_COMMIT] = "1"
            if attempt == 0:
                check_size(messages)  # resends differ only in the batch id, of the same length
            try:
                for subject, headers, body in messages[:-1]:
                    await self._nc.publish(subject, body, headers=headers)
                subject, headers, body = messages[-1]
                (reply,) = await self._inbox.request(
                    subject, body, self._settings.request_timeout_s, headers=headers, what=what,
                )
            except (ConnectionClosedError, EventStoreClosedError) as exc:
                # Closed (by the store, or for good after an outage): waiting cannot help, nothing more may be sent.
                if self._inbox.closed:
                    raise EventStoreClosedError(f"{store_closed(what)} {_what_was_stored(unanswered > 0)}") from exc
                raise ServerUnavailableError(
                    f"{server_unavailable(what, self._settings.request_timeout_s, exc)} {_what_was_stored(unanswered > 0)}"
                ) from exc
            except (NatsError, ServerUnavailableError) as exc:
                unanswered += 1
                if unanswered < attempts:
                    await _back_off(unanswered)
                    attempt += 1
                    continue  # resend: the msg ids make a resend safe
                raise await self._unacknowledged_error(target, stored, attempts) from exc
            if _no_responders(reply):
                # Nobody received it: no leader for the stream just now (an election), or no stream at all.
                await self._await_leader(wait, what, resent=unanswered > 0)
                attempt += 1
                continue
            try:
                return self._parse_ack(reply, target, others, resent=unanswered > 0)
            except _Incomplete:
                incomplete += 1
                if incomplete < attempts:  # a restart lost the staged batch: a resend heals it; a failed disk does not
                    await _back_off(incomplete)
                    attempt += 1
                    continue
                raise await self._incomplete_error(target, others, stored, attempts, resent=unanswered > 0) from None
            except _NotNow as exc:
                if await wait.again():
                    attempt += 1
                    continue
                raise ServerUnavailableError(
                    f"{what}: the server could not decide the append for "
                    f"{self._settings.request_timeout_s}s: {exc} (a write in flight that its stream's replicas have "
                    "not confirmed: an earlier send of this append, or another writer's). "
                    + ("An earlier send of this append may yet be stored: retry with the same idempotency key to find "
                       "out safely." if unanswered else "Nothing was stored by this call. Retry.")
                ) from None

    async def _await_leader(self, wait: LeaderWait, what: str, *, resent: bool = False) -> None:
        """Wait before resending a request nobody answered (503), or raise why there is no point.

        A 503 means no leader for the stream just now (an election, a lost
        quorum) or no stream at all. The stream is asked about at the first 503
        only (briefly: without a meta leader nobody answers): a stream the
        server says does not exist, or that does not cover this store's
        subjects, is :class:`StreamConfigError` at once; otherwise the resends
        back off until ``request_timeout_s`` from the first 503 has passed, then
        :class:`ServerUnavailableError` naming ``what``.
        """
        if wait.waited == 0:
            problem = await self._stream_problem(what, min(1.0, self._settings.request_timeout_s / 4))
            if problem is not None:
                raise problem
        if await wait.again():
            return
        raise ServerUnavailableError(
            f"{what}: stream {self._settings.stream!r} had no leader for {self._settings.request_timeout_s}s (a leader "
            f"election, or too few of its servers are up for a quorum). {_what_was_stored(resent)} Retry; check the "
            "cluster's nodes if it persists."
        )

    async def _stream_problem(self, what: str, timeout_s: float) -> StreamConfigError | None:
        """:class:`StreamConfigError` when the server says the stream does not exist or does not cover this store's
        subjects; None when it exists as needed, or no answer came within ``timeout_s``."""
        stream, prefix = self._settings.stream, self._settings.subject_prefix
        try:
            (reply,) = await self._inbox.request(self._subjects.stream_info(), b"", timeout_s, what=what)
            info = json.loads(reply.data) if reply.data else {}
        except (ServerUnavailableError, ValueError):
            return None
        code = (info.get("error") or {}).get("err_code")
        subjects = (info.get("config") or {}).get("subjects")
        if code == ErrorCode.STREAM_NOT_FOUND:
            return StreamConfigError(
                f"{what}: stream {stream!r} does not exist. Create it with EventStore.ensure_stream() "
                "(EventStore.connect does, unless told not to)."
            )
        if subjects is not None and f"{prefix}.>" not in subjects:
            return StreamConfigError(
                f"{what}: stream {stream!r} does not store subjects {prefix}.> (its subjects: {subjects}). Check "
                "subject_prefix and stream, or create the stream with EventStore.ensure_stream()."
            )
        return None

    async def _unacknowledged_error(
        self, entity: str, stored: Callable[[], Awaitable[bool]], attempts: int
    ) -> ServerUnavailableError:
        """The error of an append no send of which was answered.

        A :class:`StorageError` when the server answers other requests promptly (within half of
        ``request_timeout_s``), the stream has one replica and the append is not stored: nats-server drops, without
        an answer, every write to a stream whose storage failed a write (disk full, read-only), until it restarts.
        (A replicated stream's leader steps down on a write error instead.) Else a :class:`ServerUnavailableError`.
        """
        if not await self._storage_failed(stored):
            return ServerUnavailableError(
                f"The server did not acknowledge the append to {entity} after {attempts} tries. It may or may not be "
                "stored; retry with the same idempotency key to find out safely."
            )
        return StorageError(
            f"The server answers, but did not store the append to {entity} in {attempts} tries: {_STORAGE_FAILED} "
            "The append is not stored so far (a send still queued on an overloaded server could yet be); every "
            "acknowledged event stays stored."
        )

    async def _incomplete_error(
        self, target: str, others: str, stored_now: Callable[[], Awaitable[bool]], attempts: int, *, resent: bool
    ) -> ServerUnavailableError:
        """The error of an atomic append every send of which the server refused as incomplete.

        A :class:`StorageError` when the stream's storage has most likely failed (as for
        :meth:`_unacknowledged_error`): nats-server stages a batch on the stream's disk and refuses its commit when
        it could not. Else a :class:`ServerUnavailableError`: the server lost the staged batch (restarts).
        """
        batch = f"the atomic append to {target} and {others}"
        stored = _what_was_stored(resent)
        if await self._storage_failed(stored_now):
            return StorageError(
                f"The server answers, but refused {batch} as incomplete in {attempts} tries: {_STORAGE_FAILED} "
                f"{stored} Every acknowledged event stays stored."
            )
        return ServerUnavailableError(
            f"The server refused {batch} as incomplete in {attempts} tries: it lost part of the batch before the "
            f"commit (it restarted, or could not stage the batch on its disk). {stored} Retry the append."
        )

    async def _storage_failed(self, stored: Callable[[], Awaitable[bool]]) -> bool:
        """Whether the server answers promptly (within half of ``request_timeout_s``), the stream has one replica
        and the append is not ``stored()``: the signs of a stream whose storage failed a write."""
        timeout_s = self._settings.request_timeout_s
        if not self._nc.is_connected:  # reconnecting: the server is lost, not its disk
            return False
        try:
            async with asyncio.timeout(timeout_s / 2):
                info = await self._nc.jetstream(timeout=timeout_s).stream_info(self._settings.stream)
                return info.config.num_replicas == 1 and not await stored()
        except (EventStoreError, NatsError, asyncio.TimeoutError):
            return False  # unknown: the server is not answering either

    def _parse_ack(self, reply: Msg, target: str, others: str, *, resent: bool) -> dict[str, Any]:
        ack: dict[str, Any] = json.loads(reply.data)
        error = ack.get("error")
        if error is None:
            return ack
        code = error.get("err_code")
        if code == ErrorCode.WRONG_LAST_SEQUENCE:
            raise _Conflict
        if code in _NOT_NOW:
            raise _NotNow(_NOT_NOW[code])
        if code == ErrorCode.BATCH_DUPLICATE_MSG_ID:
            raise _Conflict(duplicate_id=True)
        description = error.get("description", "")
        # Refused as sent; but after an unanswered send, that earlier send may have been stored.
        stored = (
            "This send was refused, but an earlier one went unanswered and may have been stored: retry with the same "
            "idempotency key to find out safely."
            if resent
            else "Nothing was stored."
        )
        if code == ErrorCode.INSUFFICIENT_RESOURCES:
            raise StorageError(
                f"The server refused the append to {target}: JetStream's storage limit is "
                f"reached ({description}). {stored} Every acknowledged event stays stored. Raise max_file_store in the "
                "jetstream block of the server's configuration (by default 75% of the disk's free space when the "
                "server started) or move its store_dir to a bigger disk, and restart the server."
            )
        if code == ErrorCode.STREAM_NOT_FOUND:
            raise StreamConfigError(f"Stream {self._settings.stream!r} does not exist; create it with EventStore.ensure_stream().")
        if code == ErrorCode.STREAM_FULL:
            raise StreamConfigError(
                f"Stream {self._settings.stream!r} is full ({description}): it has a max_msgs or max_bytes limit "
                f"with discard policy new. {stored} Every stored event stays; raise the limit."
            )
        if "maximum" in description or "too large" in description or code == ErrorCode.MESSAGE_TOO_LARGE:
            raise EventTooLargeError(f"The server refused the append as too large: {description}. {stored}")
        if code == ErrorCode.BATCH_INCOMPLETE:
            raise _Incomplete
        if code == ErrorCode.BATCH_TOO_MANY_INFLIGHT:
            raise ServerUnavailableError(
                f"The server refused the atomic append to {target} and {others}: too many atomic batches are in "
                f"flight on the stream. {stored} Retry after a pause."
            )
        if code == ErrorCode.ATOMIC_DISABLED or ("atomic" in description and "disabled" in description):
            raise StreamConfigError(
                f"The server refused an atomic multi-entity append: {description}. The stream needs allow_atomic "
                "(nats-server 2.12 or newer)."
            )
        raise EventStoreError(f"The server refused the append (err_code {code}): {description}. {stored}")

    async def _find_stored(self, commits: list[_Commit]) -> list[int] | None:
        """If this append was already stored (a resend or a retry), the positions of its commits; else None.

        A commit sent with an expected position can only have been stored right
        after it. A keyed append may repeat an earlier call: where its position
        is unknown, or for ``ANY`` (the earlier call may have written before the
        position now known), the entity's commits are searched, each only once
        per call; an unkeyed append's id is this call's own, so it is nowhere
        else. Finding the key on some entities but not on others means it was
        used for another append: refused.
        """
        found: list[Msg | None] = []
        for c in commits:
            msg = None
            escaped = None if c.key is None else escape_key(c.key)
            if escaped is not None and (c.prev_position < 0 or c.request.expected_version is ANY):
                # Covers the commit after the expected position: the search resumes before it.
                msg, c.searched_to = await self._search(c.request.stream_id, escaped, c.msg_id, c.searched_to + 1)
            elif c.prev_position >= 0:
                msgs = await self.direct_get(
                    {"seq": c.prev_position + 1, "next_by_subj": c.subject, "batch": 1},
                    what=f"Checking the append to {c.request.stream_id}",
                )
                if msgs and _is_commit_of(msgs[0], escaped, c.msg_id):
                    msg = msgs[0]
            found.append(msg)
        if all(m is None for m in found):
            return None
        if any(m is None for m in found):
            raise self._reused_key_error(commits)
        return [self._adopt_stored(c, m) for c, m in zip(commits, found) if m is not None]

    async def _read_stored(self, commits: list[_Commit], positions: list[int]) -> list[int]:
        """Adopt the versions of commits the server reported as duplicates (stored by an earlier call)."""
        for c, position in zip(commits, positions):
            msgs = await self.direct_get(
                {"seq": position, "next_by_subj": c.subject, "batch": 1}, what=f"Reading the append to {c.request.stream_id}"
            )
            if not msgs or int((msgs[0].headers or {}).get(Header.SEQUENCE, -1)) != position or not _is_commit_of(
                msgs[0], None, c.msg_id
            ):
                raise self._reused_key_error(commits)
            self._adopt_stored(c, msgs[0])
        return positions

    @staticmethod
    def _reused_key_error(commits: list[_Commit]) -> InvalidEventError:
        entities = ", ".join(str(c.request.stream_id) for c in commits)
        return InvalidEventError(
            f"The idempotency key {commits[0].key!r:.60} was already used by another append (to other entities than "
            f"{entities}, or not to all of them); nothing was stored. Use one key per append."
        )

    @staticmethod
    def _adopt_stored(c: _Commit, msg: Msg) -> int:
        """Make the commit describe the stored message (a retry may differ in its event count); its position."""
        headers = msg.headers or {}
        c.stored_count = headers[Header.TYPE].count(",") + 1
        c.prev_version = int(headers[Header.VERSION]) - c.stored_count
        c.previous = commit_previous(headers, c.request.stream_id)
        c.stored_note = note_of(headers)
        return int(headers[Header.SEQUENCE])

    async def _exact_conflict(self, commits: list[_Commit]) -> bool:
        for c in commits:
            if c.request.expected_version is not ANY:
                state = await self.state(c.request.stream_id)
                if state.version != c.prev_version or state.position != c.prev_position:
                    return True
        return False

    def _race_budget_s(self) -> float:
        return _RACE_BUDGET_FACTOR * self._settings.request_timeout_s * (self._settings.append_retries + 1)

    async def _race_lost_error(self, commits: list[_Commit]) -> ConcurrencyError:
        c = next(c for c in commits if c.request.expected_version is ANY)
        state = await self.state(c.request.stream_id)
        error = ConcurrencyError(c.request.stream_id, ANY, state.version)
        error.add_note(f"Other writers kept appending to {c.request.stream_id} for {self._race_budget_s()}s of retries.")
        return error

    async def _conflict_error(self, commits: list[_Commit]) -> ConcurrencyError:
        for c in commits:
            expected = c.request.expected_version
            state = await self.state(c.request.stream_id)
            expected_version = 0 if expected is NO_STREAM else expected
            if expected is not ANY and state.version != expected_version:
                return ConcurrencyError(c.request.stream_id, expected, state.version)
        first = commits[0]
        return ConcurrencyError(first.request.stream_id, first.request.expected_version, None)


def _is_commit_of(msg: Msg, escaped_key: str | None, commit_msg_id: str | None) -> bool:
    """Whether ``msg`` is a commit of the append keyed ``escaped_key`` (by its key header, or its msg id for a
    single-entity commit), or has the msg id ``commit_msg_id``; ids compare exactly."""
    headers = msg.headers or {}
    stored_id = headers.get(Header.MSG_ID)
    if commit_msg_id is not None and stored_id == commit_msg_id:
        return True
    if escaped_key is None:
        return False
    return headers.get(Header.IDEMPOTENCY_KEY, stored_id) == escaped_key
