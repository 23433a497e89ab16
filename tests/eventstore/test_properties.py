"""Property-based tests over the public API: every input is either stored and read back exactly, or
refused with a typed error and nothing stored (the stream's last position does not move)."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from eventstore import (
    ANY,
    NO_STREAM,
    ConcurrencyError,
    EntityAppend,
    EventStore,
    EventStoreSettings,
    EventTooLargeError,
    InvalidArgumentError,
    InvalidEventError,
    InvalidStreamIdError,
    RecordedEvent,
    StreamConfigError,
    StreamId,
)

from ..conftest import unique_settings
from .events import Deposited, Note
from .test_stream_settings import HOSTILE, base_config, raw

STORE_TESTS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
PURE_TESTS = settings(max_examples=300, deadline=None)

# Values of every kind, for arguments that want one kind only.
anything = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 8), st.floats(), st.text(max_size=3), st.binary(max_size=2),
    st.lists(st.integers(0, 3), max_size=2), st.just(ANY), st.just(NO_STREAM), st.just(object()),
)
# Characters of every kind: controls, surrogates, subject separators and wildcards, '%', non-BMP.
hostile_chars = st.one_of(
    st.characters(codec=None, categories=None),
    st.sampled_from([".", "*", ">", "%", "2", "E", " ", "\t", "\n", "\x00", "\x7f", "\ud800", "\udfff", "\U0001f600", "é"]),
)


def hostile_text(min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[str]:
    """Text with any of those characters (st.text never yields lone surrogates, so it is joined by hand)."""
    return st.lists(hostile_chars, min_size=min_size, max_size=max_size).map("".join)


def is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def new_entity() -> StreamId:
    return StreamId("Account", uuid.uuid4().hex)


@STORE_TESTS
@given(existing=st.integers(0, 2), expected=anything)
async def test_expected_version_is_honoured_exactly_or_refused(store: EventStore, existing: int, expected: Any) -> None:
    entity = new_entity()
    for amount in range(existing):
        await store.append(entity, [Deposited(amount=amount)])
    before = await store.last_position()
    valid = expected is ANY or expected is NO_STREAM or is_int(expected, 0)
    holds = expected is ANY or (0 if expected is NO_STREAM else expected) == existing
    if not valid:
        with pytest.raises(InvalidArgumentError, match="expected_version"):
            await store.append(entity, [Deposited(amount=99)], expected_version=expected)
    elif not holds:
        with pytest.raises(ConcurrencyError):
            await store.append(entity, [Deposited(amount=99)], expected_version=expected)
    else:
        result = await store.append(entity, [Deposited(amount=99)], expected_version=expected)
        assert (result.first_version, result.duplicate) == (existing + 1, False)
        assert [e.data for e in await store.read(entity)][-1] == Deposited(amount=99)
        return
    assert await store.last_position() == before
    assert await store.version(entity) == existing


@STORE_TESTS
@given(
    parts=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.one_of(st.just("exact"), anything)), min_size=1, max_size=3
    )
)
async def test_append_many_stores_every_entity_or_none(store: EventStore, parts: list[tuple[int, int, Any]]) -> None:
    """parts: (entity number, events it already has, expected version: "exact" for the right one)."""
    entities = {n: new_entity() for n, _, _ in parts}
    existing = {}
    for n, count, _ in parts:
        if n not in existing:
            existing[n] = count
            for amount in range(count):
                await store.append(entities[n], [Deposited(amount=amount)])
    before = await store.last_position()
    expectations = [(n, existing[n] if expected == "exact" else expected) for n, _, expected in parts]
    acceptable = len(entities) == len(parts) and all(
        e is ANY or (e is NO_STREAM and existing[n] == 0) or (is_int(e, 0) and e == existing[n]) for n, e in expectations
    )
    try:
        results = await store.append_many([EntityAppend(entities[n], [Deposited(amount=7)], e) for n, e in expectations])
    except (InvalidArgumentError, InvalidEventError, ConcurrencyError):
        assert not acceptable
        assert await store.last_position() == before
        assert [await store.version(entities[n]) for n in existing] == list(existing.values())
        return
    assert acceptable
    for (n, _, _), result in zip(parts, results):
        assert (result.first_version, result.duplicate) == (existing[n] + 1, False)
        assert [e.data for e in await store.read(entities[n])][-1] == Deposited(amount=7)


@PURE_TESTS
@given(a=hostile_text(), b=hostile_text())
def test_entity_ids_are_valid_or_refused_and_never_collide(a: str, b: str) -> None:
    ids = []
    for entity_id in (a, b):
        bad = (not entity_id or any(ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF for c in entity_id))
        if bad:
            with pytest.raises(InvalidStreamIdError):
                StreamId("Account", entity_id)
        else:
            ids.append(StreamId("Account", entity_id))
    for stream_id in ids:
        subject = stream_id.subject("events")
        assert subject.count(".") == 2 and not set("*> \t") & set(subject)
        assert StreamId.from_subject(subject, "events").entity_id == stream_id.entity_id
    if len(ids) == 2 and a != b:
        assert ids[0].subject("events") != ids[1].subject("events")


@STORE_TESTS
@given(entity_id=hostile_text(min_size=1, max_size=20))
async def test_an_accepted_entity_id_reads_back_exactly(store: EventStore, entity_id: str) -> None:
    try:
        entity = StreamId("Account", entity_id)
    except InvalidStreamIdError:
        return  # refused before anything could be sent
    result = await store.append(entity, [Note(text=entity_id)])
    (event,) = await store.read(entity)
    assert (event.stream_id, event.data) == (entity, Note(text=entity_id))
    replayed = [e async for batch in store.read_all(from_position=result.position, categories=["Account"]) for e in batch]
    assert replayed[0].stream_id.entity_id == entity_id


class Anything(BaseModel):
    text: str
    number: float
    maybe: float | None
    blob: bytes
    items: list[float]


floats = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308]))


@STORE_TESTS
@given(
    text=hostile_text(max_size=8), number=floats, maybe=st.none() | floats,
    blob=st.binary(max_size=6), items=st.lists(floats, max_size=3),
)
async def test_an_event_is_stored_and_read_back_equal_or_refused(
    store: EventStore, text: str, number: float, maybe: float | None, blob: bytes, items: list[float]
) -> None:
    store.registry.register(Anything)
    event = Anything(text=text, number=number, maybe=maybe, blob=blob, items=items)
    entity = new_entity()
    before = await store.last_position()
    try:
        await store.append(entity, [event])
    except InvalidEventError:
        assert await store.last_position() == before
        readable = all(map(math.isfinite, [number, *items, *([maybe] if maybe is not None else [])]))
        assert not readable or not _utf8(text) or not _utf8(blob)
        return
    (recorded,) = await store.read(entity)
    assert recorded.data == event


def _utf8(value: str | bytes) -> bool:
    try:
        value.encode() if isinstance(value, str) else value.decode()
    except UnicodeError:
        return False
    return True


@pytest.fixture
async def history(store: EventStore) -> tuple[StreamId, list[RecordedEvent]]:
    """One account with 5 events in 3 commits, between events of other entities."""
    account = new_entity()
    await store.append(StreamId("Cart", "c1"), [Note(text="before")])
    await store.append(account, [Deposited(amount=1), Deposited(amount=2)])
    await store.append(StreamId("Cart", "c1"), [Note(text="between")])
    await store.append(account, [Deposited(amount=3)])
    await store.append(account, [Deposited(amount=4), Deposited(amount=5)])
    return account, await store.read(account)


@STORE_TESTS
@given(from_version=anything | st.integers(1, 6), to_version=anything | st.integers(1, 6),
       from_position=anything | st.integers(0, 7), consistent=anything)
async def test_read_returns_exactly_the_asked_events_or_refuses(
    store: EventStore, history: tuple[StreamId, list[RecordedEvent]],
    from_version: Any, to_version: Any, from_position: Any, consistent: Any,
) -> None:
    account, everything = history
    valid = (
        is_int(from_version, 1) and (to_version is None or is_int(to_version, from_version))
        and is_int(from_position, 0) and isinstance(consistent, bool)
    )
    if not valid:
        with pytest.raises(InvalidArgumentError):
            await store.read(account, from_version=from_version, to_version=to_version,
                             from_position=from_position, consistent=consistent)
        return
    events = await store.read(account, from_version=from_version, to_version=to_version,
                              from_position=from_position, consistent=consistent)
    high = math.inf if to_version is None else to_version
    assert events == [e for e in everything if from_version <= e.version <= high and e.position >= from_position]


@STORE_TESTS
@given(from_position=anything | st.integers(1, 7), to_position=anything | st.integers(0, 7),
       batch=anything | st.integers(1, 3),
       categories=st.one_of(anything, st.lists(st.sampled_from(["Account", "Cart", "Nope", "bad name", "a.b", ""]),
                                              max_size=2)))
async def test_read_all_returns_exactly_the_asked_events_or_refuses(
    store: EventStore, history: tuple[StreamId, list[RecordedEvent]],
    from_position: Any, to_position: Any, batch: Any, categories: Any,
) -> None:
    try:
        batches = store.read_all(from_position=from_position, to_position=to_position, batch=batch,
                                 categories=categories)
    except (InvalidArgumentError, InvalidStreamIdError):
        bad_categories = categories is not None and (
            not isinstance(categories, list) or any(c not in ("Account", "Cart", "Nope") for c in categories)
        )
        assert bad_categories or not (
            is_int(from_position, 1) and (to_position is None or is_int(to_position, 0)) and is_int(batch, 1)
        )
        return
    everything = [e async for b in store.read_all() for e in b]
    high = to_position if to_position is not None else math.inf
    wanted = [
        e for e in everything
        if from_position <= e.position <= high and (not categories or e.stream_id.category in categories)
    ]
    got = [b async for b in batches]
    assert [e for b in got for e in b] == wanted


@STORE_TESTS
@given(char=st.sampled_from(["x", "é", "\x00", '"', "\U0001f600"]), delta=st.integers(-700, 60))
async def test_payloads_around_the_size_limit_are_stored_whole_or_refused(
    store: EventStore, char: str, delta: int
) -> None:
    limit = store.nc.max_payload
    width = len(json.dumps(char, ensure_ascii=False).encode()) - 2
    note = Note(text=char * ((limit + delta - len('{"text":""}')) // width))
    entity = new_entity()
    before = await store.last_position()
    try:
        await store.append(entity, [note])
    except EventTooLargeError:
        assert await store.last_position() == before
        return
    assert [e.data for e in await store.read(entity)] == [note]
    assert store.nc.is_connected


@PURE_TESTS
@given(timeout=st.floats() | st.integers(-2, 5), window=st.floats() | st.integers(-2, 5),
       retries=st.integers(-5, 10**6) | st.floats())
def test_settings_are_usable_or_refused(timeout: float, window: float, retries: float) -> None:
    try:
        values = EventStoreSettings(request_timeout_s=timeout, duplicate_window_s=window, append_retries=retries)
    except ValidationError:
        return
    assert 0 < values.request_timeout_s <= 3600 and math.isfinite(values.request_timeout_s)
    assert 0 < values.duplicate_window_s <= 7 * 86400 and math.isfinite(values.duplicate_window_s)
    assert 0 <= values.append_retries <= 20


BENIGN: dict[str, dict[str, Any]] = {
    "compression": {"compression": "s2"},
    "description": {"description": "x"},
    "max_msgs": {"max_msgs": 10**6, "discard": "new"},
    "max_consumers": {"max_consumers": 50},
}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hostile=st.sets(st.sampled_from(sorted(HOSTILE)), max_size=3), benign=st.sets(st.sampled_from(sorted(BENIGN))))
async def test_a_stream_is_accepted_exactly_when_none_of_its_settings_can_lose_events(
    nats_url: str, hostile: set[str], benign: set[str]
) -> None:
    changes: dict[str, Any] = {}
    for change in [BENIGN[name] for name in sorted(benign)] + [HOSTILE[name] for name in sorted(hostile)]:
        changes.update(change)  # hostile last: its discard policy wins
    # A setting is named unless a later change neutralised it (another one is named then).
    refused_keys = {k for k in hostile if HOSTILE[k].get(k) == changes.get(k)}
    settings_ = unique_settings(nats_url)
    store = await EventStore.connect(settings_, create_stream=False)
    try:
        config = json.loads(json.dumps({**base_config(settings_), **changes}).replace("PREFIX", settings_.subject_prefix))
        reply = json.loads((await store.nc.request(f"$JS.API.STREAM.CREATE.{settings_.stream}",
                                                   json.dumps(config).encode(), timeout=5)).data)
        assume("error" not in reply)  # a combination the server itself refuses
        if not hostile:
            await store.ensure_stream()
            return
        before = (await raw(store, "INFO"))["config"]
        with pytest.raises(StreamConfigError) as info:
            await store.ensure_stream()
        for key in refused_keys:
            assert f"{key}=" in str(info.value)
        assert (await raw(store, "INFO"))["config"] == before
    finally:
        await store.close()
