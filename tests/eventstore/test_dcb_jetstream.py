"""DCB on JetStream: what only the real server shows (the check made in the commit, under concurrent writers; a
retry long after the server forgot the message ids; the index outside the event subjects; the stream setup)."""

from __future__ import annotations

import asyncio

import pytest

from eventstore import (
    AppendCondition,
    AppendConditionError,
    EventStore,
    EventStoreSettings,
    Query,
    StreamConfigError,
    TaggedEvent,
)
from eventstore.dcb_index import IndexReads
from eventstore.dcb_jetstream import JetStreamDcb
from samples.courses import StudentSubscribed, UsernameClaimed
from tests.conftest import unique_settings

from .dcb_events import Blob, register


def claim(username: str, user: str) -> TaggedEvent:
    return TaggedEvent(UsernameClaimed(username=username, user=user), {f"username:{username}"})


async def test_of_many_concurrent_claims_of_a_username_the_server_lets_exactly_one_through(
    dcb_store: EventStore, settings: EventStoreSettings
) -> None:
    # Writers on connections of their own, each with nothing remembered: every check is the server's.
    others = [await EventStore.connect(settings) for _ in range(4)]
    try:
        for other in others:
            register(other.registry)
        await dcb_store.dcb.append([TaggedEvent(Blob(text="unrelated"), {"username:zed"})])
        taken = Query.of(types=["UsernameClaimed"], tags=["username:alice"])
        reads = [await o.dcb.read(taken) for o in others]

        async def attempt(writer: EventStore, user: str, after: int) -> str:
            try:
                await writer.dcb.append([claim("alice", user)], condition=AppendCondition(taken, after))
                return "won"
            except AppendConditionError:
                return "lost"

        outcomes = await asyncio.gather(*(attempt(o, f"u{i}", r.position) for i, (o, r) in enumerate(zip(others, reads))))
        assert sorted(outcomes) == ["lost", "lost", "lost", "won"]
        claims = (await dcb_store.dcb.read(taken)).events
        assert [e.data.user for e in claims] == [f"u{outcomes.index('won')}"]  # type: ignore[attr-defined]
    finally:
        for other in others:
            await other.close()


async def test_a_condition_read_by_another_process_is_looked_up_on_the_leader(
    dcb_store: EventStore, settings: EventStoreSettings
) -> None:
    query = Query.of(tags=["course:c1"])
    await dcb_store.dcb.append([TaggedEvent(Blob(text="first"), {"course:c1"})])
    await dcb_store.dcb.append([TaggedEvent(Blob(text="noise"), {"course:c2"})])  # moves the stream, not the tag
    read = await dcb_store.dcb.read(query)  # up to the noise: the tag's last position lies before
    async with await EventStore.connect(settings) as fresh:  # remembers nothing of the read
        register(fresh.registry)
        held = await fresh.dcb.append([TaggedEvent(Blob(text="second"), {"course:c1"})], condition=AppendCondition(query, read.position))
        with pytest.raises(AppendConditionError) as caught:
            await fresh.dcb.append([TaggedEvent(Blob(text="third"), {"course:c1"})], condition=AppendCondition(query, read.position))
        assert caught.value.position == held.position
    async with await EventStore.connect(settings) as fresh:  # nor of the append: the leader already holds a match
        fresh.registry.register(Blob)
        with pytest.raises(AppendConditionError) as caught:
            await fresh.dcb.append([TaggedEvent(Blob(text="third"), {"course:c1"})], condition=AppendCondition(query, read.position))
        assert caught.value.position == held.position
    assert [e.data.text for e in (await dcb_store.dcb.read(query)).events] == ["first", "second"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("tags", [set(), {"student:s1"}])
async def test_a_retry_after_the_server_forgot_the_message_ids_still_stores_nothing_twice(nats_url: str, tags: set[str]) -> None:
    settings = unique_settings(nats_url, duplicate_window_s=0.5)
    async with await EventStore.connect(settings) as store:
        register(store.registry)
        await store.dcb.ensure_index()
        event = TaggedEvent(StudentSubscribed(student="s1", course="c1"), tags)
        first = await store.dcb.append([event], idempotency_key="enrol-s1")
        await asyncio.sleep(1.0)  # past the duplicate window: only the commit's own check can tell
        again = await store.dcb.append([event], idempotency_key="enrol-s1")
        assert (again.position, again.duplicate) == (first.position, True)
        assert [e.position async for batch in store.read_all() for e in batch] == [first.position]


async def test_index_messages_stay_off_the_event_subjects(dcb_store: EventStore) -> None:
    result = await dcb_store.dcb.append([TaggedEvent(Blob(text="x"), {"a", "b", "c"})],
                                        condition=AppendCondition(Query.of(tags=["d"]) | Query.of(tags=["e"])))
    assert result.position == await dcb_store.last_position() == 4  # three index messages, then the commit
    commit = await dcb_store.nc.jetstream().get_msg(dcb_store.settings.stream, result.position)
    assert (commit.headers or {}).get("Nats-Batch-Commit") == "1"  # a reader of events meets it as a whole batch
    assert [(e.position, e.type) async for batch in dcb_store.read_all() for e in batch] == [(result.position, "Blob")]
    assert [(e.position, e.type) async for batch in dcb_store.read_all(categories=["Dcb"]) for e in batch] == [
        (result.position, "Blob")]


async def test_a_stream_without_the_index_subjects_is_refused_until_they_are_added(store: EventStore) -> None:
    store.registry.register(Blob)
    with pytest.raises(StreamConfigError, match="ensure_index"):
        await store.dcb.append([TaggedEvent(Blob(text="x"), {"a"})])
    with pytest.raises(StreamConfigError, match="ensure_index"):
        await store.dcb.read(Query.all())
    assert await store.last_position() == 0
    await store.dcb.ensure_index()
    await store.ensure_stream()  # the stream, index subjects added, still passes the event store's checks
    assert (await store.dcb.append([TaggedEvent(Blob(text="x"), {"a"})])).position == 2  # after its index message


async def test_a_condition_after_an_appends_position_holds_in_a_process_that_remembers_nothing(
    dcb_store: EventStore, settings: EventStoreSettings
) -> None:
    tagged = TaggedEvent(Blob(text="x"), {"a", "b"})  # its index messages follow its commit
    first = await dcb_store.dcb.append([tagged])
    async with await EventStore.connect(settings) as fresh:
        fresh.registry.register(Blob)
        query = Query.of(tags=["a"]) | Query.of(tags=["b"])
        with pytest.raises(AppendConditionError) as caught:
            await fresh.dcb.append([tagged], condition=AppendCondition(query, first.position - 1))
        assert caught.value.position == first.position
        await fresh.dcb.append([tagged], condition=AppendCondition(query, first.position))


@pytest.mark.parametrize("how", ["chain", "scan", "auto"])
async def test_an_index_read_by_its_back_pointers_and_scans_misses_nothing(dcb_store: EventStore, how: IndexReads) -> None:
    query = Query.of(tags=["course:c1"])
    written = []
    for n in range(30):  # checked appends (back pointers), unchecked ones (none), and other tags between them
        condition = AppendCondition(query, await dcb_store.last_position()) if n % 3 else None
        written.append((await dcb_store.dcb.append([TaggedEvent(Blob(text=f"e{n}"), {"course:c1"})], condition=condition)).position)
        await dcb_store.dcb.append([TaggedEvent(Blob(text="noise"), {"course:c2"})])
    async with await EventStore.connect(dcb_store.settings) as fresh:  # remembers nothing
        fresh.registry.register(Blob)
        assert isinstance(fresh.dcb, JetStreamDcb)
        fresh.dcb.index_reads = how
        assert [e.position for e in (await fresh.dcb.read(query)).events] == written
        assert [e.position for e in (await fresh.dcb.read(query, after=written[12])).events] == written[13:]
        assert [e.position for e in (await fresh.dcb.read(query, after=written[12] - 1)).events] == written[12:]
