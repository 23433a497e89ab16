"""DCB on JetStream: tagged events in one commit, an index message per tag, conditions checked by the server.

An append of tagged events is one JetStream atomic batch (see docs/concepts/dcb.md for the design and its costs):

1. last in the batch, the **commit**: the events, on ``<prefix>.Dcb.<append id>`` in the wire format of every commit (so
   ``read_all``, projections and Spark read DCB events as events of the entity ``Dcb/<append id>``), with
   ``Es-Tags``; it carries ``Nats-Expected-Last-Subject-Sequence: 0`` on its own subject, so an append id is
   stored once, however late a resend comes (the append id derives from the idempotency key);
2. before it, an empty **index message** on ``<prefix>_tags.<tag>`` per distinct tag of the append's events
   (``Es-Commit-Offset`` says how many positions before the commit): outside ``<prefix>.>``, so no reader of
   events sees it, and the commit, carrying the batch's commit header, reads as a whole batch;
3. the **checks** of the condition: for each checked tag (one per query item, :func:`~.dcb.check_tags`) a
   ``Nats-Expected-Last-Subject-Sequence`` of that tag's subject, with
   ``Nats-Expected-Last-Subject-Sequence-Subject`` when it rides on another message: on the tag's own index
   message when the append writes it (the server refuses a check of a subject the batch wrote before it), else on
   an index message without a check of its own, else on an empty carrier message. The expected value is the
   subject's last index message of a commit at or before ``after``; the server compares it in the batch's
   commit, under the stream's lock, with every write to the subject since. A checked tag's own index message
   also points back to that message (``Es-Previous``, see :mod:`.dcb_index`): reads walk those pointers.

Only literal subjects are checked: a clustered stream's leader guards writes in flight per literal subject, so a
wildcard filter could pass while an overlapping write is proposed but not yet applied.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from .commit import MAX_ENTITIES_PER_APPEND, check_commit_size
from .dcb import DCB_CATEGORY, AppendCondition, DcbCommit, DcbLog, Query, QueryResult, SequencedEvent, TaggedEvent, decode_tags
from .dcb_index import INDEX_POINTERS, IndexMessages, IndexReads, Last, index_floor, index_messages, pointers, scan
from .errors import (
    AppendConditionError,
    EventDecodeError,
    InvalidEventError,
    StreamConfigError,
    map_nats_error,
)
from .events import AppendResult
from .jetstream.api import Subjects
from .jetstream.direct import retry_while_lagging
from .sending import Conflict
from .streams import StreamId, encode_entity_id
from .wire import Header, decode_commit, note_of

if TYPE_CHECKING:
    from .store import EventStore

__all__ = ["JetStreamDcb", "index_subject"]

_GET_CHUNK = 512  # commits fetched per direct get (nats-server answers at most 1024 subjects' last messages)


def index_subject(prefix: str, tag: str) -> str:
    """The subject of ``tag``'s index messages under the subject prefix ``prefix``."""
    return f"{prefix}_tags.{encode_entity_id(tag)}"


def _carrier_subject(prefix: str) -> str:
    # Two tokens below <prefix>_tags: no tag's subject (one token) is ever this one.
    return f"{prefix}_tags._.check"


class JetStreamDcb(DcbLog):
    """Reads by :class:`~.dcb.Query` and conditional appends of :class:`~.dcb.TaggedEvent`, on an
    :class:`~eventstore.EventStore`'s stream (``store.dcb``; the contract and an example: :class:`~.dcb.DcbLog`);
    see the module docs for the layout. The stream must also store ``<prefix>_tags.>``: :meth:`ensure_index`
    adds it.
    """

    def __init__(self, store: "EventStore", cache_size: int = 100_000) -> None:
        super().__init__(store.registry, store.settings.subject_prefix)
        self._store = store
        self._ready = False
        # subject -> (E, C, P, pointers): the subject's last message is E, of the commit at C, at every position in
        # [C, P]; E's verified back pointers, when known (None: unknown).
        self._known: OrderedDict[str, tuple[int, int, int, tuple[int, ...] | None]] = OrderedDict()
        self._cache_size = cache_size
        self.index_reads: IndexReads = "auto"
        """How reads follow a tag's index: "auto" (a scan when short or dense, else the back pointers), or always
        "chain" (the pointers) or "scan"; the others are for tests and benchmarks."""

    # -- the stream -----------------------------------------------------------

    async def ensure_index(self) -> None:
        """Add ``<prefix>_tags.>`` (the index subjects) to the stream's subjects if it lacks them.

        The one change jetsourcing makes to an existing stream, and only when asked: DCB appends need it.
        """
        store = self._store
        config = await store._stream_config_json()
        if config is None:
            raise StreamConfigError(f"Stream {store.settings.stream!r} does not exist; connect the EventStore first.")
        subject = f"{self._prefix}_tags.>"
        if subject not in (config.get("subjects") or []):
            config["subjects"] = [*config.get("subjects", []), subject]
            answer = await store._inbox.api(
                Subjects(store.settings.stream).stream_update(), json.dumps(config).encode(),
                store.settings.request_timeout_s, what=f"Adding {subject} to stream {store.settings.stream!r}",
            )
            error = answer.get("error")
            if error is not None:
                raise StreamConfigError(
                    f"Could not add {subject} to stream {store.settings.stream!r}: {error.get('description')} "
                    f"(err_code {error.get('err_code')}). Add it with the nats CLI (nats stream edit)."
                )
        self._ready = True

    async def _check_ready(self) -> None:
        if self._ready:
            return
        config = await self._store._stream_config_json()
        if config is None or f"{self._prefix}_tags.>" not in (config.get("subjects") or []):
            raise StreamConfigError(
                f"Stream {self._store.settings.stream!r} does not store the DCB index subjects {self._prefix}_tags.>: "
                "call await store.dcb.ensure_index() once (it adds them), or add them with the nats CLI."
            )
        self._ready = True

    def _learn(self, subject: str, last: int, commit: int, through: int, previous: tuple[int, ...] | None) -> None:
        known = self._known.get(subject)
        if known is not None and known[2] >= through:
            return
        self._known[subject] = (last, commit, through, previous)
        self._known.move_to_end(subject)
        if len(self._known) > self._cache_size:
            self._known.popitem(last=False)

    async def _leader_last(self, subject: str, what: str) -> Last:
        """``subject``'s last message as the stream's leader knows it (a message get)."""
        store = self._store
        timeout_s = store.settings.request_timeout_s
        try:
            with map_nats_error(what, timeout_s, closed=lambda: store._inbox.closed):
                msg = await store.nc.jetstream(timeout=timeout_s).get_last_msg(store.settings.stream, subject)
        except NotFoundError:
            return Last(0, 0, {})
        seq, headers = int(msg.seq or 0), dict(msg.headers or {})
        return Last(seq, seq + int(headers.get(Header.COMMIT_OFFSET, "0")), headers)

    # -- reading --------------------------------------------------------------

    async def _read(self, query: Query, after: int, limit: int | None) -> QueryResult:
        """:meth:`~.dcb.DcbLog.read` on the stream. Cost: per query item, the index of its least tag (:mod:`.dcb_index`; for an item without tags, a scan of
        the DCB commits), then the candidate commits by direct gets of many at once: without a ``limit``, each
        round trip's commits are fetched while the index walk goes on. Complete up to the position even on a
        cluster whose replicas lag: each index is read from its last message as the leader knows it.
        """
        what = "Reading a DCB query"
        timeout_s = self._store.settings.request_timeout_s
        direct = self._store._appender.direct
        head = await self._store.last_position()
        subjects: dict[str, bool] = {}  # subject to read -> whether it is an index (else: the commits themselves)
        for item in query.items:
            if item.tags:
                subjects[index_subject(self._prefix, min(item.tags))] = True
            else:
                subjects[f"{self._prefix}.{DCB_CATEGORY}.*"] = False
        lasts = await asyncio.gather(*(self._leader_last(s, what) for s in subjects))
        fetched = _Prefetch(self, after, head)
        try:
            found = await asyncio.gather(*(
                index_messages(direct, subject, last, index_floor(after), timeout_s,
                               fetched.walked if limit is None else None, how=self.index_reads) if is_index
                else scan(direct, subject, after, last.seq, timeout_s)
                for (subject, is_index), last in zip(subjects.items(), lasts)
            ))
            candidates: dict[int, str] = {}  # commit position -> its subject
            for (subject, is_index), msgs in zip(subjects.items(), found):
                seen: tuple[int, int, tuple[int, ...] | None] = (0, 0, (0,))
                for seq, headers in msgs:
                    if is_index:
                        commit, subject_of_commit = self._commit_of(seq, headers)
                        candidates[commit] = subject_of_commit
                        if seen[0] < seq <= head:
                            seen = (seq, commit, pointers(headers, seq))
                    else:
                        candidates[seq] = headers[Header.SUBJECT]
                if is_index and after == 0:  # head is a batch boundary: no later commit has a message up to it
                    self._learn(subject, *seen[:2], head, seen[2])
            got = await fetched.results()
            events: list[SequencedEvent] = []
            ordered = sorted(p for p in candidates if after < p <= head)
            for start in range(0, len(ordered), _GET_CHUNK):
                chunk = ordered[start:start + _GET_CHUNK]
                if any(p not in got for p in chunk):
                    got.update(zip(chunk, await self._get(chunk, [candidates[p] for p in chunk])))
                for position in chunk:
                    for event in self._decode(position, got[position]):
                        if query.matches(event.type, event.tags):
                            events.append(event)
                if limit is not None and len(events) >= limit:
                    events = events[:limit]
                    return QueryResult(events, events[-1].position)
            return QueryResult(events, head)
        finally:
            await fetched.cancel()

    def _commit_of(self, seq: int, headers: Mapping[str, str]) -> tuple[int, str]:
        """The position and subject of the commit the index message at ``seq`` with these headers belongs to."""
        return seq + int(headers[Header.COMMIT_OFFSET]), f"{self._prefix}.{DCB_CATEGORY}.{headers[Header.COMMIT_ENTITY]}"

    async def _get(self, positions: list[int], subjects: list[str]) -> list[Msg]:
        """The commits at ``positions`` on ``subjects`` (each a commit's own), in one direct get: the last message
        of each subject (the only one), as a batch in stream order."""
        async def attempt() -> list[Msg] | None:
            msgs = await self._store._appender.direct.direct_get(
                {"multi_last": subjects, "batch": len(subjects)}, what="Reading DCB events"
            )
            return msgs if [int((m.headers or {})[Header.SEQUENCE]) for m in msgs] == positions else None

        timeout_s = self._store.settings.request_timeout_s
        return await retry_while_lagging(attempt, timeout_s, (
            f"Reading DCB events: a commit the index names was not found within {timeout_s}s (a replica lags, or it "
            "was deleted). Retry."
        ))

    def _decode(self, position: int, msg: Msg) -> list[SequencedEvent]:
        headers = msg.headers or {}
        stream_id = StreamId.from_subject(headers[Header.SUBJECT], self._prefix)
        recorded = decode_commit(stream_id, position, headers, msg.data, self._store.registry)
        try:
            tags = decode_tags(headers.get(Header.TAGS), len(recorded))
        except ValueError as exc:
            raise EventDecodeError(f"Malformed DCB commit at position {position}: {exc}.") from None
        return [SequencedEvent(position, e.index, t, e) for e, t in zip(recorded, tags)]

    # -- appending ------------------------------------------------------------

    async def _append(
        self, prepared: DcbCommit, events: Sequence[TaggedEvent], condition: AppendCondition | None
    ) -> AppendResult:
        """:meth:`~.dcb.DcbLog.append` on the stream: the condition is checked by the server in the same commit."""
        commit, headers, body, checked = prepared
        stream_id = prepared.stream_id
        written = sorted({index_subject(self._prefix, t) for e in events for t in e.tags})
        # The index messages first, the commit last: a reader of the event subjects meets the commit as a whole
        # batch (it carries the batch's commit header), and an append's position ends its batch. No msg ids on
        # the index messages: the commit's deduplicates the whole batch (the server refuses a batch holding a
        # known msg id), and its own check stores it once at any age.
        entity = stream_id.subject(self._prefix).rpartition(".")[2]
        messages = [(subject, {Header.COMMIT_ENTITY: entity}, b"") for subject in written]
        subjects = [index_subject(self._prefix, t) for t in checked]
        expected = await self._expected(subjects, condition.after if condition else 0, checked)
        free = [m for m in messages if m[0] not in expected]
        chains: dict[str, tuple[int, ...]] = {}
        for subject, (value, _, before) in expected.items():
            if subject in written:
                # Checked on its own index message, which points back to the message the check names (and on
                # through that one's pointers, when known): a chain the server verified (see .dcb_index).
                chains[subject] = (0,) if value == 0 else (value, *(before or ())[:INDEX_POINTERS - 1])
                own = messages[written.index(subject)][1]
                own[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(value)
                own[Header.PREVIOUS] = ",".join(map(str, chains[subject]))
                continue
            if not free:
                free.append((_carrier_subject(self._prefix), {}, b""))
                messages.append(free[-1])
            carrier = free.pop(0)[1]
            carrier[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(value)
            carrier[Header.EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT] = subject
        for i, (_, index_headers, _) in enumerate(messages):
            index_headers[Header.COMMIT_OFFSET] = str(len(messages) - i)  # how many positions before the commit
        messages.append((commit.subject, headers, body))

        def check_size(sent: list[tuple[str, dict[str, str], bytes]]) -> None:
            check_commit_size(commit, sent[-1][1], sent[-1][2], self._store.nc.max_payload)

        async def stored() -> bool:
            return await self._find(stream_id) is not None

        try:
            ack = await self._store._appender.sender.send(
                messages, target=str(stream_id), others=f"{len(messages) - 1} index messages",
                check_size=check_size, stored=stored,
            )
        except Conflict as conflict:
            found = await self._find(stream_id)
            if found is not None:
                return found
            if conflict.duplicate_id:
                raise InvalidEventError(
                    f"The idempotency key {commit.key!r:.60} was already used by another append; nothing was stored. "
                    "Use one key per append."
                ) from None
            raise await self._conflict(subjects, condition.after if condition else 0, checked) from None
        position = int(ack["seq"])  # the commit's, the batch's last
        if ack.get("duplicate"):
            found = await self._find(stream_id)
            assert found is not None
            return found
        first = position - len(messages) + 1
        last = position
        for i, subject in enumerate(written):
            self._learn(subject, first + i, position, last, chains.get(subject))
        for subject, (value, at, before) in expected.items():
            if subject not in written:
                self._learn(subject, value, at, last, before)
        return AppendResult(stream_id, position, 1, len(events), False, None)

    async def _expected(
        self, subjects: list[str], after: int, tags: list[str]
    ) -> dict[str, tuple[int, int, tuple[int, ...] | None]]:
        """Each checked subject's last message of a commit at or before ``after``, that commit's position and the
        message's back pointers (None: unknown): remembered, else asked of the leader; :class:`AppendConditionError` at once when the leader already holds
        one of a later commit. (A commit's index messages precede it: one at or before ``after`` may belong to a
        commit after it, when ``after`` does not end a batch.)"""
        expected: dict[str, tuple[int, int, tuple[int, ...] | None]] = {}
        missing: list[str] = []
        for subject in subjects:
            known = self._known.get(subject)
            if after == 0:
                expected[subject] = (0, 0, (0,))
            elif known is not None and known[1] <= after <= known[2]:
                expected[subject] = (known[0], known[1], known[3])
            else:
                missing.append(subject)
        lasts = await asyncio.gather(*(self._leader_last(s, "Checking a DCB append condition") for s in missing))
        for subject, last in zip(missing, lasts):
            if last.commit > after:
                raise await self._conflict(subjects, after, tags)
            expected[subject] = (last.seq, last.commit, pointers(last.headers, last.seq) if last.seq else (0,))
            self._learn(subject, *expected[subject][:2], after, expected[subject][2])
        return expected

    async def _conflict(self, subjects: list[str], after: int, tags: list[str]) -> AppendConditionError:
        """The error naming the first commit after ``after`` holding a checked tag (None if a replica lagging
        behind the leader that refused the append does not hold it yet)."""
        firsts = []
        for subject in subjects:
            # An index message precedes its commit: the first one of a commit after ``after`` lies after the
            # stream's last whole batch before it, at most a batch's length before ``after`` (when ``after`` is
            # not the end of a batch: every position reads and appends return is).
            msgs = await self._store._appender.direct.direct_get(
                {"seq": index_floor(after) + 1, "next_by_subj": subject, "batch": MAX_ENTITIES_PER_APPEND},
                what="Finding a DCB conflict",
            )
            commits = [int((m.headers or {})[Header.SEQUENCE]) + int((m.headers or {}).get(Header.COMMIT_OFFSET, "0"))
                       for m in msgs]
            firsts += [c for c in commits if c > after][:1]
        return AppendConditionError(after, min(firsts) if firsts else None, tags)

    async def _find(self, stream_id: StreamId) -> AppendResult | None:
        """What an earlier send of the append with this commit subject stored, if any (``duplicate=True``)."""
        # Asked of the leader: a replica may not hold the commit yet, and a stored commit is never a conflict.
        store = self._store
        timeout_s = store.settings.request_timeout_s
        try:
            with map_nats_error(f"Checking the DCB append {stream_id}", timeout_s, closed=lambda: store._inbox.closed):
                msg = await store.nc.jetstream(timeout=timeout_s).get_last_msg(
                    store.settings.stream, stream_id.subject(self._prefix))
        except NotFoundError:
            return None
        headers = msg.headers or {}
        count = headers[Header.TYPE].count(",") + 1
        return AppendResult(stream_id, int(msg.seq or 0), 1, count, True, note_of(headers))


class _Prefetch:
    """The commits of index messages found by a read's walk, fetched while the walk goes on (one get per round
    trip's messages, each commit once); positions past the read's ``head`` or not after ``after`` are left out."""

    def __init__(self, dcb: JetStreamDcb, after: int, head: int) -> None:
        self._dcb, self._after, self._head = dcb, after, head
        self._asked: set[int] = set()
        self._gets: list[tuple[list[int], asyncio.Task[list[Msg]]]] = []

    def walked(self, msgs: IndexMessages) -> None:
        """Start fetching the commits of ``msgs`` not asked for yet."""
        commits = dict(self._dcb._commit_of(seq, headers) for seq, headers in msgs)
        positions = sorted(p for p in commits if self._after < p <= self._head and p not in self._asked)
        if positions:
            self._asked.update(positions)
            get = asyncio.ensure_future(self._dcb._get(positions, [commits[p] for p in positions]))
            self._gets.append((positions, get))

    async def results(self) -> dict[int, Msg]:
        """Every fetched commit by position (raises what a get raised)."""
        got: dict[int, Msg] = {}
        for positions, get in self._gets:
            got.update(zip(positions, await get))
        return got

    async def cancel(self) -> None:
        """Stop the gets still running (a read that failed or returned early) and wait for every one to end."""
        gets = [get for _, get in self._gets]
        for get in gets:
            get.cancel()  # nothing for those done
        await asyncio.gather(*gets, return_exceptions=True)  # every outcome retrieved: none is reported as lost
