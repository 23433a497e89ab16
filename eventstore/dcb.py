"""Dynamic consistency boundaries (dcb.events): tagged events, queries, append conditions.

A DCB event carries a type and a set of **tags** (``"course:c1"``). A
:class:`Query` selects events: its items are OR-ed; within a
:class:`QueryItem` the types are OR-ed and the tags AND-ed (an item without
types matches every type, one without tags every event of its types). An
:class:`AppendCondition` makes an append fail when an event matching its
query was stored after the position ``after``.

The value objects, and what both stores share (:class:`DcbLog`: the checks of the
arguments, the commit of an append) live here; the JetStream store is
:mod:`.dcb_jetstream`, the in-memory one :mod:`.dcb_memory`. How a
condition is checked by the server, and why that is never narrower than the
query, is in docs/concepts/dcb.md and :func:`check_tags`.
"""

from __future__ import annotations

import secrets
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from pydantic import BaseModel

from .commit import Commit, EntityAppend, build_commit
from .errors import InvalidArgumentError, InvalidEventError, InvalidStreamIdError, UncheckableQueryError
from .events import NO_STREAM, AppendResult, RecordedEvent
from .registry import TypeRegistry
from .streams import StreamId, decode_entity_id, encode_entity_id
from .validation import check_int
from .wire import Header, check_idempotency_key, check_metadata, check_note, escape_key, msg_id, utc_now_text

__all__ = [
    "AppendCondition",
    "DCB_CATEGORY",
    "DcbCommit",
    "DcbLog",
    "MAX_TAGS_PER_EVENT",
    "Query",
    "QueryItem",
    "QueryResult",
    "SequencedEvent",
    "TaggedEvent",
    "batch_messages",
    "check_tags",
    "dcb_stream_id",
    "decode_tags",
    "encode_tags",
]

DCB_CATEGORY: Final = "Dcb"
"""The category of the commits DCB appends store: every reader of the stream (``read_all``, projections, Spark)
sees DCB events as events of entities ``Dcb/<append id>``, one entity per append."""

MAX_TAGS_PER_EVENT: Final = 32
"""The most tags one event may carry (each costs an index message per append: see docs/concepts/dcb.md)."""

_MAX_TAG_LENGTH: Final = 256
_MAX_BATCH: Final = 1000  # nats-server's limit on the messages of one atomic batch


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _names(name: str, values: object) -> frozenset[str]:
    """``values`` (an iterable of str, not one str) as a frozenset, each checked by ``_check_name``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgumentError(
            f"Invalid {name}: {_shown(values)}; give a list of strings (e.g. [\"course:c1\"]), not one string."
        )
    return frozenset(_check_name(name, value) for value in values)


def _check_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"Invalid {name}: {_shown(value)} is not a non-empty str.")
    if name == "types":
        return value
    try:
        encode_entity_id(value)  # a tag becomes a subject token: the entity ids' rules and escaping
    except InvalidStreamIdError:
        why = (f"it has {len(value)} characters, at most {_MAX_TAG_LENGTH} are allowed" if len(value) > _MAX_TAG_LENGTH
               else "it holds a control character or a lone surrogate, which cannot be stored")
        raise InvalidArgumentError(
            f"Invalid tag {_shown(value)}: {why}. A tag is any other text (e.g. \"course:c1\")."
        ) from None
    return value


@dataclass(frozen=True, slots=True, init=False)
class TaggedEvent:
    """An event to append and its tags (checked on construction: :class:`InvalidArgumentError`).

    ``event`` is an instance of a registered pydantic model; ``tags`` an
    iterable of at most :data:`MAX_TAGS_PER_EVENT` non-empty strings (any
    printable text up to 256 characters, e.g. ``"course:c1"``).
    """

    event: BaseModel
    tags: frozenset[str]

    def __init__(self, event: BaseModel, tags: Iterable[str] = ()) -> None:
        if not isinstance(event, BaseModel):
            raise InvalidArgumentError(
                f"Invalid event {_shown(event)}: a TaggedEvent holds an instance of a registered pydantic model."
            )
        object.__setattr__(self, "event", event)
        tags = _names("tags", tags)
        if len(tags) > MAX_TAGS_PER_EVENT:
            raise InvalidArgumentError(
                f"An event carries {len(tags)} tags, more than {MAX_TAGS_PER_EVENT}; tag it with what decisions query."
            )
        object.__setattr__(self, "tags", tags)


@dataclass(frozen=True, slots=True, init=False)
class QueryItem:
    """Events of any of ``types`` (every type when empty) carrying all of ``tags`` (no tag needed when empty)."""

    types: frozenset[str]
    tags: frozenset[str]

    def __init__(self, types: Iterable[str] = (), tags: Iterable[str] = ()) -> None:
        object.__setattr__(self, "types", _names("types", types))
        object.__setattr__(self, "tags", _names("tags", tags))

    def matches(self, type_name: str, tags: frozenset[str]) -> bool:
        """Whether an event of ``type_name`` carrying ``tags`` matches this item."""
        return (not self.types or type_name in self.types) and self.tags <= tags


@dataclass(frozen=True, slots=True)
class Query:
    """One or more :class:`QueryItem`, OR-ed. ``Query.all()`` matches every DCB event."""

    items: tuple[QueryItem, ...]

    def __post_init__(self) -> None:
        items: object = self.items
        if isinstance(items, QueryItem):
            items = (items,)
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            raise InvalidArgumentError(f"Invalid query items: {_shown(items)}; give a list of QueryItem.")
        items = tuple(items)
        if not items or not all(isinstance(i, QueryItem) for i in items):
            raise InvalidArgumentError(
                f"Invalid query items: {_shown(items)}; give one or more QueryItem (Query.all() for every event)."
            )
        object.__setattr__(self, "items", items)

    @classmethod
    def of(cls, *, types: Iterable[str] = (), tags: Iterable[str] = ()) -> "Query":
        """A query of one item."""
        return cls((QueryItem(types, tags),))

    @classmethod
    def all(cls) -> "Query":
        """The query every DCB event matches."""
        return cls((QueryItem(),))

    def __or__(self, other: "Query") -> "Query":
        """The query matching what either matches (its items are both queries' items)."""
        if not isinstance(other, Query):
            return NotImplemented
        return Query(self.items + other.items)

    def matches(self, type_name: str, tags: frozenset[str]) -> bool:
        """Whether an event of ``type_name`` carrying ``tags`` matches one of the items."""
        return any(item.matches(type_name, tags) for item in self.items)


@dataclass(frozen=True, slots=True)
class AppendCondition:
    """Fail the append if an event matching ``query`` was stored at a position after ``after`` (0: at all).

    Checked by the server in the same commit as the write, through one tag of each item (see
    :func:`check_tags`): it may fail for an event sharing that tag that the query does not match (retry after
    reading again), never pass for one it matches.
    """

    query: Query
    after: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.query, Query):
            raise InvalidArgumentError(f"Invalid condition query: {_shown(self.query)}; give a Query.")
        if isinstance(self.after, bool) or not isinstance(self.after, int) or self.after < 0:
            raise InvalidArgumentError(
                f"Invalid condition after: {_shown(self.after)}; give the position the decision read up to "
                "(QueryResult.position), an int >= 0."
            )
        check_tags(self.query)


def check_tags(query: Query) -> list[str]:
    """The tags a condition on ``query`` is checked through, sorted: one per item, its least tag.

    Why this is never narrower than the query: an event matching an item carries all the item's tags, so
    also the checked one; its append wrote an index message on that tag's subject after the event's own
    commit, so the subject's last sequence moved past ``after``, which the server's check refuses. It is
    broader: an event with that tag but another type, or without the item's other tags, fails it too.
    An item without tags cannot be checked so: :class:`UncheckableQueryError`.
    """
    untagged = [item for item in query.items if not item.tags]
    if untagged:
        raise UncheckableQueryError(
            f"An append condition cannot check the query item {untagged[0]!r}: it has no tags, so no index "
            "subject holds its events and the server could only check the whole stream. Tag the events the "
            "decision depends on and query by a tag (reading such a query is fine; only conditions refuse it)."
        )
    return sorted({min(item.tags) for item in query.items})


def encode_tags(tags: Sequence[frozenset[str]]) -> str:
    """The ``Es-Tags`` header of a commit: per event ``+`` and its tags as subject tokens joined by ``.``,
    events joined by a space (tokens hold neither, and the ``+`` keeps a tagless event's entry non-empty)."""
    return " ".join("+" + ".".join(encode_entity_id(t) for t in sorted(event_tags)) for event_tags in tags)


def decode_tags(text: str | None, count: int) -> list[frozenset[str]]:
    """The tags of each of a commit's ``count`` events from its ``Es-Tags`` header (none when absent)."""
    if text is None:
        return [frozenset()] * count
    entries = text.split(" ")
    if len(entries) != count or not all(e.startswith("+") for e in entries):
        raise ValueError(f"Es-Tags names {len(entries)} events, the commit holds {count}")
    return [frozenset(decode_entity_id(t) for t in e[1:].split(".") if t) for e in entries]


def _check_append(
    events: object, condition: object, idempotency_key: object, correlation_id: object, causation_id: object,
    note: object,
) -> tuple[str | None, str | None, str | None]:
    """Check a DCB append's arguments as every store does; return the checked key and metadata."""
    if isinstance(events, (str, bytes, TaggedEvent)) or not isinstance(events, Sequence):
        raise InvalidArgumentError(f"Invalid events: {_shown(events)}; give a list of TaggedEvent.")
    if not events:
        raise InvalidEventError("Nothing to append: the list of events is empty.")
    bad = next((e for e in events if not isinstance(e, TaggedEvent)), None)
    if bad is not None:
        raise InvalidArgumentError(
            f"Invalid event {_shown(bad)}: a DCB append takes TaggedEvent(event, tags), e.g. "
            "TaggedEvent(CourseDefined(...), {\"course:c1\"})."
        )
    if condition is not None and not isinstance(condition, AppendCondition):
        raise InvalidArgumentError(f"Invalid condition: {_shown(condition)}; give an AppendCondition or None.")
    key = check_idempotency_key(idempotency_key)
    correlation = check_metadata("correlation_id", correlation_id)
    causation = check_metadata("causation_id", causation_id)
    check_note(note)
    return key, correlation, causation


def _check_read(query: object, after: object, limit: object) -> None:
    """Check a DCB read's arguments as every store does."""
    if not isinstance(query, Query):
        raise InvalidArgumentError(f"Invalid query: {_shown(query)}; give a Query (Query.all() for every event).")
    check_int("after", after, 0, what="a position")
    if limit is not None:
        check_int("limit", limit, 1, what="None or a number of events")


def batch_messages(events: Sequence[TaggedEvent], checked: Sequence[str]) -> int:
    """How many messages the atomic batch of a DCB append holds: its commit, an index message per distinct tag,
    and an empty carrier per checked tag beyond the index messages free to carry its check (each message
    carries one check); :class:`InvalidEventError` when more than one batch may hold (1000)."""
    written = {t for e in events for t in e.tags}
    foreign = set(checked) - written
    count = 1 + len(written) + max(0, len(foreign) - len(written - set(checked)))
    if count > _MAX_BATCH:
        raise InvalidEventError(
            f"The DCB append needs {count} messages (its commit, one per distinct tag and per checked tag), more "
            f"than the {_MAX_BATCH} of one atomic batch; split it or use fewer tags."
        )
    return count


def _appended_entity(idempotency_key: object) -> StreamId:
    """The entity of the DCB append keyed ``idempotency_key`` (what ``find_append`` looks for), else
    :class:`InvalidArgumentError`."""
    key = check_idempotency_key(idempotency_key)
    if key is None:
        raise InvalidArgumentError("find_append needs an idempotency_key (a non-empty str), not None.")
    return dcb_stream_id(key, escape_key(key))


def dcb_stream_id(key: str | None, append_id: str) -> StreamId:
    """The entity of a DCB append's commit: derived from its idempotency key (so any retry names the same
    subject), else its append id (random, reused by this call's resends)."""
    if key is None:
        return StreamId(DCB_CATEGORY, append_id)
    return StreamId(DCB_CATEGORY, uuid.uuid5(uuid.NAMESPACE_URL, f"jetsourcing-dcb/{append_id}").hex)


@dataclass(frozen=True, slots=True)
class SequencedEvent:
    """A stored DCB event: ``position`` and ``index`` order it (as every reader's), ``tags`` as appended."""

    position: int
    index: int
    tags: frozenset[str]
    recorded: RecordedEvent

    @property
    def type(self) -> str:
        """The event's registered type name."""
        return self.recorded.type

    @property
    def data(self) -> BaseModel:
        """The event as its registered (upcast) pydantic model."""
        return self.recorded.data


@dataclass(frozen=True, slots=True)
class QueryResult:
    """The events a read found, in stream order, and ``position``: the position the query was read up to.

    Every matching event at or before ``position`` (and after the read's ``after``) is in ``events``, so
    ``AppendCondition(query, after=result.position)`` is the condition of a decision made on them.
    """

    events: list[SequencedEvent]
    position: int


class DcbCommit(NamedTuple):
    """A DCB append's commit as it is to be stored: its headers and body (``Es-Tags`` included), and the tags its
    condition is checked through (:func:`check_tags`; none without a condition)."""

    commit: Commit
    headers: dict[str, str]
    body: bytes
    checked: list[str]

    @property
    def stream_id(self) -> StreamId:
        """The entity ``Dcb/<append id>`` the commit is stored on."""
        return self.commit.request.stream_id


class DcbLog(ABC):
    """Reads by query and conditional appends of tagged events (``store.dcb``). Both stores keep this contract, and
    pass one contract suite: this class checks the arguments and builds an append's commit, each store reads,
    checks the condition and stores in its own way.

    Example::

        result = await store.dcb.read(Query.of(types=["StudentSubscribed"], tags=["course:c1"]))
        await store.dcb.append([TaggedEvent(StudentSubscribed(...), {"course:c1", "student:s1"})],
                               condition=AppendCondition(query, after=result.position))
    """

    def __init__(self, registry: TypeRegistry, subject_prefix: str) -> None:
        self._registry = registry
        self._prefix = subject_prefix

    async def ensure_index(self) -> None:
        """Prepare the store for DCB appends (idempotent); nothing to do unless the store says otherwise."""

    async def read(self, query: Query, *, after: int = 0, limit: int | None = None) -> QueryResult:
        """The DCB events matching ``query`` stored after ``after``, in stream order, at most ``limit``; and the
        position read up to (see :class:`QueryResult`)."""
        _check_read(query, after, limit)
        await self._check_ready()
        return await self._read(query, after, limit)

    async def append(
        self,
        events: Sequence[TaggedEvent],
        *,
        condition: AppendCondition | None = None,
        idempotency_key: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        note: str | None = None,
    ) -> AppendResult:
        """Append ``events`` atomically if ``condition`` holds, checked in the same commit (by the server, on
        JetStream).

        Raises :class:`AppendConditionError` naming the first conflicting position when it does not. With an
        ``idempotency_key`` a retry (also after a lost acknowledgement, at any later time) stores nothing and
        returns the first write's result with ``duplicate=True``. Other errors as :meth:`EventStore.append`.
        """
        key, correlation, causation = _check_append(events, condition, idempotency_key, correlation_id,
                                                    causation_id, note)
        await self._check_ready()
        append_id = escape_key(key) if key is not None else secrets.token_hex(16)
        stream_id = dcb_stream_id(key, append_id)
        commit = build_commit(self._registry, self._prefix, EntityAppend(stream_id, [e.event for e in events], NO_STREAM),
                              msg_id(append_id, 0), key, note)
        commit.previous = (0,)
        headers, body = commit.encode(utc_now_text(), correlation, causation)
        headers[Header.TAGS] = encode_tags([e.tags for e in events])
        checked = [] if condition is None else check_tags(condition.query)
        batch_messages(events, checked)  # the memory store refuses what the server refuses
        return await self._append(DcbCommit(commit, headers, body, checked), events, condition)

    async def find_append(self, idempotency_key: str) -> AppendResult | None:
        """What the DCB append with exactly ``idempotency_key`` stored (``duplicate=True``, with its note), or None,
        at any age."""
        stream_id = _appended_entity(idempotency_key)
        await self._check_ready()
        return await self._find(stream_id)

    async def _check_ready(self) -> None:
        """Raise when the store cannot take DCB reads and appends yet."""

    @abstractmethod
    async def _read(self, query: Query, after: int, limit: int | None) -> QueryResult:
        """:meth:`read`, its arguments checked."""

    @abstractmethod
    async def _append(
        self, prepared: DcbCommit, events: Sequence[TaggedEvent], condition: AppendCondition | None
    ) -> AppendResult:
        """Store the ``prepared`` commit (of ``events``) if ``condition`` holds, once per append id; see :meth:`append`."""

    @abstractmethod
    async def _find(self, stream_id: StreamId) -> AppendResult | None:
        """What the append whose commit is on ``stream_id`` stored (``duplicate=True``), or None."""
