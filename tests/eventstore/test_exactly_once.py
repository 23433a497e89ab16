"""Every acknowledged append stored exactly once: retries (automatic and the caller's), lost acks, keys, sizes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
from pydantic import BaseModel, create_model

from eventstore import (
    ANY,
    NO_STREAM,
    AppendResult,
    EntityAppend,
    EventStore,
    EventStoreSettings,
    EventTooLargeError,
    InvalidArgumentError,
    InvalidEventError,
    StreamId,
)
from tests.conftest import unique_settings
from tests.support.proxy import Proxy

from .events import ALL, Deposited, Note

A = StreamId("Account", "a")
B = StreamId("Account", "b")


async def _connect(settings: EventStoreSettings) -> EventStore:
    store = await EventStore.connect(settings)
    for model in ALL:
        store.registry.register(model)
    return store


@pytest.fixture
async def proxy(nats_url: str) -> AsyncIterator[Proxy]:
    async with Proxy(nats_url) as proxy:
        yield proxy


async def _events(store: EventStore, *streams: StreamId) -> list[list[int]]:
    return [[e.data.amount for e in await store.read(s)] for s in streams]  # type: ignore[attr-defined]


async def _prepare(store: EventStore) -> None:
    """Both entities at version 1, so exact appends expect 1."""
    await store.append(A, [Deposited(amount=0)], NO_STREAM)
    await store.append(B, [Deposited(amount=0)], NO_STREAM)


def _requests(multi: bool, exact: bool) -> list[EntityAppend]:
    expected = 1 if exact else ANY
    requests = [EntityAppend(A, [Deposited(amount=1), Deposited(amount=2)], expected)]
    if multi:
        requests.append(EntityAppend(B, [Deposited(amount=3)], expected))
    return requests


def _stored_once(multi: bool) -> list[list[int]]:
    return [[0, 1, 2], [0, 3]] if multi else [[0, 1, 2], [0]]


PATHS = [
    pytest.param(multi, exact, id=f"{'multi' if multi else 'single'}-{'exact' if exact else 'any'}")
    for multi in (False, True)
    for exact in (True, False)
]


@pytest.mark.parametrize(("multi", "exact"), PATHS)
@pytest.mark.parametrize("fresh_store", [False, True], ids=["warm-cache", "fresh-store"])
async def test_a_retried_append_returns_the_first_write_and_stores_nothing(
    nats_url: str, multi: bool, exact: bool, fresh_store: bool
) -> None:
    settings = unique_settings(nats_url, duplicate_window_s=2)
    store = await _connect(settings)
    try:
        await _prepare(store)
        first = await store.append_many(_requests(multi, exact), idempotency_key="K")
        retry_store = await _connect(settings) if fresh_store else store
        async with asyncio.timeout(10):
            again = await retry_store.append_many(_requests(multi, exact), idempotency_key="K")
        if retry_store is not store:
            await retry_store.close()
        assert [(r.position, r.first_version, r.last_version) for r in again] == [
            (r.position, r.first_version, r.last_version) for r in first
        ]
        assert all(r.duplicate for r in again) and not any(r.duplicate for r in first)
        assert await _events(store, A, B) == _stored_once(multi)
    finally:
        await store.close()


async def test_a_key_used_for_another_entity_is_refused_not_reported_as_stored(store: EventStore) -> None:
    await store.append(A, [Deposited(amount=1)], idempotency_key="K")
    with pytest.raises(InvalidEventError, match="already used"):
        await store.append(B, [Deposited(amount=2)], idempotency_key="K")
    assert await _events(store, A, B) == [[1], []]


async def test_an_any_append_losing_every_race_backs_off_and_ends(nats_url: str) -> None:
    """Two ANY writers racing hard on one entity: both finish, versions stay gap-free."""
    store = await _connect(unique_settings(nats_url))
    try:
        async with asyncio.timeout(60):
            results = await asyncio.gather(*(store.append(A, [Deposited(amount=i)], ANY) for i in range(100)))
        assert sorted(r.last_version for r in results) == list(range(1, 101))
    finally:
        await store.close()


# -- lost acknowledgements ------------------------------------------------------------------


@pytest.mark.parametrize(("multi", "exact"), PATHS)
async def test_a_lost_ack_is_resent_and_the_append_stored_once(
    nats_url: str, proxy: Proxy, multi: bool, exact: bool
) -> None:
    store = await _connect(unique_settings(proxy.url, request_timeout_s=0.5, append_retries=3))
    try:
        await _prepare(store)
        proxy.drop_acks(1)
        results = await store.append_many(_requests(multi, exact))
        assert proxy.dropped == 1
        assert [r.first_version for r in results] == ([2, 2] if multi else [2])
        assert all(r.duplicate for r in results)  # the commit is the one the first, unacknowledged send stored
        assert await _events(store, A, B) == _stored_once(multi)
    finally:
        await store.close()


@pytest.mark.parametrize(("multi", "exact"), PATHS)
async def test_after_every_ack_was_lost_a_retry_with_the_key_finds_the_first_write(
    nats_url: str, proxy: Proxy, multi: bool, exact: bool
) -> None:
    settings = unique_settings(proxy.url, request_timeout_s=0.5, append_retries=0)
    store = await _connect(settings)
    try:
        await _prepare(store)
        proxy.dropping_all = True
        with pytest.raises(Exception, match="may or may not be stored"):
            await store.append_many(_requests(multi, exact), idempotency_key="K")
        proxy.dropping_all = False
        again = await store.append_many(_requests(multi, exact), idempotency_key="K")
        assert all(r.duplicate for r in again)
        assert [(r.first_version, r.last_version) for r in again] == ([(2, 3), (2, 2)] if multi else [(2, 3)])
        assert await _events(store, A, B) == _stored_once(multi)
    finally:
        await store.close()


# -- keys and metadata on the wire ---------------------------------------------------------


async def test_keys_differing_in_whitespace_or_line_breaks_do_not_collide(store: EventStore) -> None:
    keys = ["k 1", "k\n1", " k", "k ", "k", "k\r\n1", "k\t1", "k%201", "k%:0", "k\ud800", "\u00e9", "e\u0301"]
    results = [await store.append(A, [Deposited(amount=i)], idempotency_key=k) for i, k in enumerate(keys)]
    assert not any(r.duplicate for r in results)
    events = await store.read(A)
    assert [e.idempotency_key for e in events] == keys
    for i, key in enumerate(keys):
        found = await store.find_append(A, key)
        assert found is not None and found.first_version == i + 1


async def test_command_ids_compare_exactly_also_against_multi_entity_appends(store: EventStore) -> None:
    await store.append(A, [Deposited(amount=1)], idempotency_key="order-7:1")
    assert await store.find_append(A, "order-7") is None
    results = await store.append_many(
        [EntityAppend(B, [Deposited(amount=2)]), EntityAppend(A, [Deposited(amount=3)])], idempotency_key="order-7"
    )
    assert not any(r.duplicate for r in results)  # entity #1 of key "order-7" is not key "order-7:1"
    found = await store.find_append(A, "order-7")
    assert found is not None and found.first_version == 2
    assert await _events(store, A, B) == [[1, 3], [2]]


@pytest.mark.parametrize("value", ["a b ", " a", "a\nb", "a\r\nb", "a\tb", "", "a\x00", "a\u2028b", "\ud800", 7, b"x"])
@pytest.mark.parametrize("name", ["correlation_id", "causation_id"])
async def test_metadata_that_a_header_cannot_carry_is_refused(store: EventStore, name: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        await store.append(A, [Deposited(amount=1)], **{name: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=name):
        await store.append_many([EntityAppend(A, [Deposited(amount=1)])], **{name: value})  # type: ignore[arg-type]
    assert await store.read(A) == []


@pytest.mark.parametrize("key", ["", 7, b"k", ["k"]])
async def test_an_idempotency_key_that_is_not_a_non_empty_str_is_refused(store: EventStore, key: object) -> None:
    with pytest.raises(InvalidArgumentError, match="idempotency_key"):
        await store.append(A, [Deposited(amount=1)], idempotency_key=key)  # type: ignore[arg-type]
    assert await store.read(A) == []


_TEXT = st.text(st.characters(codec=None, exclude_categories=()), min_size=0, max_size=12)  # surrogates too


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=_TEXT, other=_TEXT, correlation=st.none() | _TEXT)
async def test_any_key_and_id_round_trips_exactly_or_is_refused_with_nothing_stored(
    nats_url: str, key: str, other: str, correlation: str | None
) -> None:
    store = await _connect(unique_settings(nats_url))  # a stream per example: keys are per stream
    try:
        stored: dict[str, int] = {}
        for i, k in enumerate((key, other)):
            try:
                result = await store.append(A, [Deposited(amount=i)], idempotency_key=k, correlation_id=correlation)
            except InvalidArgumentError as exc:
                assert k == "" or correlation is not None, exc
                continue
            if k in stored:
                assert result.duplicate and result.last_version == stored[k]
            else:
                assert not result.duplicate  # distinct keys never dedupe each other
                stored[k] = result.last_version
        events = await store.read(A)
        assert [(e.idempotency_key, e.correlation_id) for e in events] == [(k, correlation) for k in stored]
        assert [e.version for e in events] == list(stored.values())
    finally:
        await store.close()


# -- sizes ---------------------------------------------------------------------------------


async def _still_works(store: EventStore) -> None:
    await store.info()
    result = await store.append(A, [Deposited(amount=1)])
    assert [e.version for e in await store.read(A)] == [result.last_version] == [1]


async def test_a_commit_pushed_over_max_payload_by_its_headers_is_refused_and_the_store_stays_open(
    store: EventStore,
) -> None:
    limit = store.nc.max_payload
    big = Note(text="x" * (limit - 2_000))
    with pytest.raises(EventTooLargeError, match="max_payload"):
        await store.append(A, [big], correlation_id="c" * 20_000)
    with pytest.raises(EventTooLargeError, match=f"to {B}"):  # each message of an atomic batch is checked
        await store.append_many(
            [EntityAppend(A, [Note(text="small")]), EntityAppend(B, [big])], correlation_id="c" * 20_000
        )
    assert await store.read(B) == []
    await _still_works(store)


async def test_many_events_with_long_type_names_are_refused_and_the_store_stays_open(store: EventStore) -> None:
    long_named: type[BaseModel] = create_model("LongNamed")  # tiny bodies: the headers make the size
    store.registry.register(long_named, name="T" * 128)
    with pytest.raises(EventTooLargeError, match="max_payload"):
        await store.append(B, [long_named() for _ in range(6_450)])
    assert await store.read(B) == []
    await _still_works(store)


async def test_the_size_limit_is_exact_whole_message_as_sent(store: EventStore) -> None:
    """A commit of exactly max_payload bytes as sent is stored; one byte more is refused before sending."""
    limit = store.nc.max_payload
    probe = await store.append(B, [Note(text="")])
    headers_and_rest = limit - _commit_size(probe)
    fits = Note(text="y" * headers_and_rest)
    result = await store.append(B, [fits], 1)
    assert result.last_version == 2
    with pytest.raises(EventTooLargeError):
        await store.append(B, [Note(text="y" * (headers_and_rest + 1))], 2)
    await store.info()


def _commit_size(probe: AppendResult) -> int:
    """How many bytes a commit of one empty Note after ``probe`` takes as sent, headers included."""
    from eventstore.wire import Header, encode_commit, header_block_size, utc_now_text

    headers, body = encode_commit(
        msg_id="0" * 32, types=["Note"], schema_versions=[1], event_ids=["0" * 32], payloads=[b'{"text":""}'],
        last_version=2, recorded_at=utc_now_text(),
    )
    headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(probe.position)
    headers[Header.PREVIOUS] = f"{probe.position},0"  # the back pointers: the probe, then the entity's start
    return header_block_size(headers) + len(body)


async def test_a_keyed_any_retry_is_recognised_within_the_duplicate_window_and_after_it_when_stale(
    nats_url: str,
) -> None:
    """The documented reach of a keyed ANY append's idempotency (docs/concepts/guarantees.md)."""
    settings = unique_settings(nats_url, duplicate_window_s=1)
    store = await _connect(settings)
    try:
        first = await store.append(A, [Deposited(amount=1)], ANY, idempotency_key="K")
        assert (await store.append(A, [Deposited(amount=1)], ANY, idempotency_key="K")).duplicate
        stale = await _connect(settings)  # its view of A is from before the next write
        await stale.state(A)
        await store.append(A, [Deposited(amount=2)], ANY)
        await asyncio.sleep(1.5)
        again = await stale.append(A, [Deposited(amount=1)], ANY, idempotency_key="K")
        assert (again.duplicate, again.position) == (True, first.position)
        fresh = await _connect(settings)  # up to date, after the window: the server no longer knows K
        assert not (await fresh.append(A, [Deposited(amount=1)], ANY, idempotency_key="K")).duplicate
        await asyncio.gather(stale.close(), fresh.close())
        assert await _events(store, A) == [[1, 2, 1]]
    finally:
        await store.close()


@hsettings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    correlation_length=st.integers(1, 30_000),
    key_length=st.integers(1, 300),
    over=st.sampled_from([-1, 0, 1]),
)
async def test_a_commit_around_max_payload_is_stored_whole_or_refused_with_nothing_stored(
    store: EventStore, correlation_length: int, key_length: int, over: int
) -> None:
    from eventstore.wire import encode_commit, header_block_size, utc_now_text

    entity = StreamId("Size", uuid.uuid4().hex)  # hypothesis may repeat an example on this store
    correlation, key = "c" * correlation_length, f"{entity}/" + "k" * key_length
    headers, body = encode_commit(
        msg_id=key, types=["Note"], schema_versions=[1], event_ids=["0" * 32], payloads=[b'{"text":""}'],
        last_version=1, recorded_at=utc_now_text(), correlation_id=correlation, idempotency_key=key,
    )
    headers["Nats-Expected-Last-Subject-Sequence"] = "0"
    headers["Es-Previous"] = "0"  # the first commit's back pointer: the entity's start
    text = "y" * (store.nc.max_payload - header_block_size(headers) - len(body) + over)
    if over > 0:
        with pytest.raises(EventTooLargeError):
            await store.append(entity, [Note(text=text)], NO_STREAM, idempotency_key=key, correlation_id=correlation)
        assert await store.read(entity) == []
    else:
        await store.append(entity, [Note(text=text)], NO_STREAM, idempotency_key=key, correlation_id=correlation)
        (event,) = await store.read(entity)
        assert (event.data, event.correlation_id, event.idempotency_key) == (Note(text=text), correlation, key)
    await store.info()
