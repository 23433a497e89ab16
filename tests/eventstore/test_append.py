from __future__ import annotations

import asyncio
import json
import uuid

import nats
import pytest

from eventstore import (
    ANY,
    NO_STREAM,
    ConcurrencyError,
    EntityAppend,
    EventStore,
    EventTooLargeError,
    Header,
    InvalidEventError,
    StreamId,
    UnknownEventTypeError,
)

from .events import Deposited, Note, Opened

ACCOUNT = StreamId("Account", "alice@example.com")


async def test_append_then_read_returns_events_with_versions_and_positions(store: EventStore) -> None:
    first = await store.append(ACCOUNT, [Opened(owner="alice"), Deposited(amount=5)], NO_STREAM)
    second = await store.append(ACCOUNT, [Deposited(amount=7)], 2)
    assert (first.first_version, first.last_version, first.count) == (1, 2, 2)
    assert (second.first_version, second.last_version) == (3, 3)
    assert second.position > first.position
    events = await store.read(ACCOUNT)
    assert [e.version for e in events] == [1, 2, 3]
    assert [(e.position, e.index) for e in events] == [(first.position, 0), (first.position, 1), (second.position, 0)]
    assert [e.data for e in events] == [Opened(owner="alice"), Deposited(amount=5), Deposited(amount=7)]
    assert len({e.event_id for e in events}) == 3
    assert all(e.stream_id == ACCOUNT for e in events)


async def test_wrong_expected_version_raises_and_stores_nothing(store: EventStore) -> None:
    await store.append(ACCOUNT, [Opened(owner="alice")], NO_STREAM)
    with pytest.raises(ConcurrencyError) as caught:
        await store.append(ACCOUNT, [Deposited(amount=1), Deposited(amount=2)], 5)
    assert (caught.value.stream_id, caught.value.expected, caught.value.actual) == (ACCOUNT, 5, 1)
    with pytest.raises(ConcurrencyError) as caught:
        await store.append(ACCOUNT, [Deposited(amount=1)], NO_STREAM)
    assert caught.value.actual == 1
    assert [e.version for e in await store.read(ACCOUNT)] == [1]
    assert (await store.info()).commits == 1


async def test_a_stale_cached_position_is_caught_by_the_server(store: EventStore, settings: object) -> None:
    other = await EventStore.connect(store.settings, store.registry)
    try:
        await store.append(ACCOUNT, [Opened(owner="alice")], NO_STREAM)  # store caches (1, pos)
        await other.append(ACCOUNT, [Deposited(amount=1)], 1)  # another client moves it on
        with pytest.raises(ConcurrencyError) as caught:
            await store.append(ACCOUNT, [Deposited(amount=2)], 1)  # no lookup: the server must refuse
        assert caught.value.actual == 2
    finally:
        await other.close()
    assert [e.data for e in await store.read(ACCOUNT)] == [Opened(owner="alice"), Deposited(amount=1)]


async def test_any_appends_keep_versions_gap_free(store: EventStore) -> None:
    await asyncio.gather(*(store.append(ACCOUNT, [Deposited(amount=i)], ANY) for i in range(20)))
    assert [e.version for e in await store.read(ACCOUNT)] == list(range(1, 21))


async def test_eight_concurrent_writers_never_lose_or_duplicate_a_version(store: EventStore) -> None:
    clients = [await EventStore.connect(store.settings, store.registry) for _ in range(8)]

    async def writer(client: EventStore, n: int) -> int:
        conflicts = 0
        version = await client.version(ACCOUNT)
        for i in range(200):
            while True:
                try:
                    result = await client.append(ACCOUNT, [Deposited(amount=n * 1000 + i)], version)
                    version = result.last_version
                    break
                except ConcurrencyError as exc:
                    conflicts += 1
                    assert exc.actual is not None
                    version = exc.actual
        return conflicts

    try:
        conflicts = await asyncio.gather(*(writer(c, n) for n, c in enumerate(clients)))
    finally:
        for client in clients:
            await client.close()
    events = await store.read(ACCOUNT)
    assert len(events) == 1600
    assert [e.version for e in events] == list(range(1, 1601))
    assert sorted(e.data.amount for e in events) == sorted(n * 1000 + i for n in range(8) for i in range(200))  # type: ignore[attr-defined]
    assert sum(conflicts) > 0  # the writers really raced


async def test_the_same_append_sent_twice_is_stored_once(store: EventStore) -> None:
    await store.append(ACCOUNT, [Opened(owner="alice")], NO_STREAM)
    first = await store.append(ACCOUNT, [Deposited(amount=1), Deposited(amount=2)], 1, idempotency_key="cmd-1")
    again = await store.append(ACCOUNT, [Deposited(amount=1), Deposited(amount=2)], 1, idempotency_key="cmd-1")
    assert not first.duplicate and again.duplicate
    assert (again.position, again.first_version, again.last_version) == (first.position, 2, 3)
    # With ANY the server's own duplicate detection answers.
    any_first = await store.append(ACCOUNT, [Note(text="x")], ANY, idempotency_key="cmd-2")
    any_again = await store.append(ACCOUNT, [Note(text="x")], ANY, idempotency_key="cmd-2")
    assert any_again.duplicate and any_again.position == any_first.position
    assert [e.version for e in await store.read(ACCOUNT)] == [1, 2, 3, 4]


async def test_a_retry_after_others_wrote_is_still_recognised(store: EventStore) -> None:
    """The lost-ack retry arrives after another writer appended: it must not store twice."""
    first = await store.append(ACCOUNT, [Opened(owner="alice")], NO_STREAM, idempotency_key="open")
    await store.append(ACCOUNT, [Deposited(amount=3)], 1)
    again = await store.append(ACCOUNT, [Opened(owner="alice")], NO_STREAM, idempotency_key="open")
    assert again.duplicate and again.position == first.position
    fresh = await EventStore.connect(store.settings, store.registry)  # no cached state at all
    try:
        mid = await store.append(ACCOUNT, [Deposited(amount=4)], 2, idempotency_key="dep-4")
        await store.append(ACCOUNT, [Deposited(amount=5)], 3)
        retry = await fresh.append(ACCOUNT, [Deposited(amount=4)], 2, idempotency_key="dep-4")
        assert retry.duplicate and retry.position == mid.position and retry.last_version == 3
    finally:
        await fresh.close()
    assert [e.version for e in await store.read(ACCOUNT)] == [1, 2, 3, 4]


async def test_multi_entity_append_is_all_or_nothing(store: EventStore) -> None:
    alice, bob = StreamId("Account", "alice"), StreamId("Account", "bob")
    await store.append(alice, [Opened(owner="alice"), Deposited(amount=10)], NO_STREAM)
    await store.append(bob, [Opened(owner="bob")], NO_STREAM)
    results = await store.append_many(
        [EntityAppend(alice, [Deposited(amount=-4)], 2), EntityAppend(bob, [Deposited(amount=4)], 1)],
        correlation_id="transfer-1",
    )
    assert [r.last_version for r in results] == [3, 2]
    assert results[1].position == results[0].position + 1
    before = (await store.info()).commits
    with pytest.raises(ConcurrencyError) as caught:
        await store.append_many(
            [EntityAppend(alice, [Deposited(amount=-1)], 3), EntityAppend(bob, [Deposited(amount=1)], 1)]
        )
    assert caught.value.stream_id == bob and caught.value.actual == 2
    assert (await store.info()).commits == before
    assert [e.version for e in await store.read(alice)] == [1, 2, 3]
    bob_events = await store.read(bob)
    assert bob_events[-1].correlation_id == "transfer-1"
    # Retried with the same key: recognised, nothing new.
    key = "transfer-2"
    requests = [EntityAppend(alice, [Deposited(amount=-1)], 3), EntityAppend(bob, [Deposited(amount=1)], 2)]
    first = await store.append_many(requests, idempotency_key=key)
    again = await store.append_many(requests, idempotency_key=key)
    assert all(r.duplicate for r in again) and [r.position for r in again] == [r.position for r in first]


async def test_a_batch_never_committed_stores_nothing(store: EventStore) -> None:
    """A client that dies half-way through an atomic batch leaves no trace."""
    nc = await nats.connect(store.settings.nats_url)
    subject = StreamId("Account", "x").subject(store.settings.subject_prefix)
    batch_id = uuid.uuid4().hex
    for i in range(1, 4):
        headers = {Header.BATCH_ID: batch_id, Header.BATCH_SEQUENCE: str(i), Header.TYPE: "Note",
                   Header.SCHEMA_VERSION: "1", Header.EVENT_ID: str(i), Header.VERSION: str(i)}
        await nc.publish(subject, json.dumps({"text": str(i)}).encode(), headers=headers)
    await nc.flush()
    await nc.close()  # dies before the commit message
    assert await store.read(StreamId("Account", "x")) == []
    assert (await store.info()).commits == 0
    await store.append(StreamId("Account", "x"), [Note(text="after")], NO_STREAM)
    assert [e.version for e in await store.read(StreamId("Account", "x"))] == [1]


async def test_bad_input_is_refused_before_anything_is_sent(store: EventStore) -> None:
    class Unregistered(Note):
        pass

    with pytest.raises(UnknownEventTypeError, match="not registered"):
        await store.append(ACCOUNT, [Note(text="ok"), Unregistered(text="no")], NO_STREAM)
    with pytest.raises(InvalidEventError, match="empty"):
        await store.append(ACCOUNT, [], NO_STREAM)
    with pytest.raises(InvalidEventError, match="pydantic"):
        await store.append(ACCOUNT, [{"amount": 1}], NO_STREAM)  # type: ignore[list-item]
    with pytest.raises(InvalidEventError, match="twice"):
        await store.append_many([EntityAppend(ACCOUNT, [Note(text="a")]), EntityAppend(ACCOUNT, [Note(text="b")])])
    with pytest.raises(InvalidEventError, match="at most 1000"):
        await store.append_many([EntityAppend(StreamId("A", str(i)), [Note(text="a")]) for i in range(1001)])
    with pytest.raises(EventTooLargeError, match="max_payload"):
        await store.append(ACCOUNT, [Note(text="x" * (store.nc.max_payload + 1))], NO_STREAM)
    assert (await store.info()).commits == 0


async def test_a_duplicate_reports_the_versions_of_the_first_write(store: EventStore) -> None:
    await store.append(ACCOUNT, [Opened(owner="alice")], NO_STREAM)
    first = await store.append(ACCOUNT, [Deposited(amount=1), Deposited(amount=2)], 1, idempotency_key="k")
    # Retried at the version the first write produced: the server answers "duplicate".
    again = await store.append(ACCOUNT, [Deposited(amount=1), Deposited(amount=2)], 3, idempotency_key="k")
    assert again.duplicate
    assert (again.position, again.first_version, again.last_version) == (first.position, 2, 3)
    # The store's own idea of the entity is still right: the next append lands at version 4.
    assert (await store.append(ACCOUNT, [Deposited(amount=3)], ANY)).last_version == 4


async def test_find_append_finds_an_idempotent_append_of_any_age(store: EventStore) -> None:
    await store.append(ACCOUNT, [Opened(owner="alice")], NO_STREAM)
    stored = await store.append(ACCOUNT, [Deposited(amount=1), Deposited(amount=2)], 1, idempotency_key="cmd-9")
    await store.append(ACCOUNT, [Deposited(amount=3)], 3)
    found = await store.find_append(ACCOUNT, "cmd-9")
    assert found is not None and found.duplicate
    assert (found.position, found.first_version, found.last_version) == (stored.position, 2, 3)
    assert await store.find_append(ACCOUNT, "never-sent") is None
    assert await store.find_append(StreamId("Account", "nobody"), "cmd-9") is None
