from __future__ import annotations

import asyncio
import time

import pytest

from eventstore import (
    NO_STREAM,
    EmbeddedServer,
    EventDecodeError,
    EventStore,
    Pending,
    ServerUnavailableError,
    StreamConfigError,
    StreamId,
    TypeRegistry,
    UnknownEventTypeError,
)

from ..conftest import unique_settings
from .events import Deposited, Note, Opened


async def _fill(store: EventStore, entities: int, per_entity: int) -> None:
    for v in range(per_entity):
        await asyncio.gather(
            *(store.append(StreamId("Account", str(i)), [Deposited(amount=v)], v) for i in range(entities))
        )


async def test_read_versions_ranges_and_positions(store: EventStore) -> None:
    await _fill(store, entities=5, per_entity=30)
    sid = StreamId("Account", "3")
    events = await store.read(sid)
    assert [e.version for e in events] == list(range(1, 31))
    assert [e.data.amount for e in events] == list(range(30))  # type: ignore[attr-defined]
    assert [e.version for e in await store.read(sid, from_version=11, to_version=20)] == list(range(11, 21))
    tail = await store.read(sid, from_version=29, from_position=events[27].position + 1)
    assert [e.version for e in tail] == [29, 30]
    assert [e.version for e in await store.read(sid, consistent=True)] == list(range(1, 31))
    assert await store.read(StreamId("Account", "missing")) == []
    assert (await store.state(sid)).version == 30


async def test_read_of_a_long_entity_spans_several_direct_get_batches(store: EventStore) -> None:
    sid = StreamId("Cart", "big")
    for start in range(0, 2500, 500):
        await store.append(sid, [Note(text=str(i)) for i in range(start, start + 500)], start)
    events = await store.read(sid)
    assert [e.version for e in events] == list(range(1, 2501))


async def test_read_all_is_global_order_exactly_once_with_ranges_and_categories(store: EventStore) -> None:
    await _fill(store, entities=20, per_entity=10)
    for i in range(10):
        await store.append(StreamId("Cart", str(i)), [Note(text="a"), Note(text="b")], NO_STREAM)
    everything = [e async for batch in store.read_all(batch=37) for e in batch]
    assert len(everything) == 220
    keys = [(e.position, e.index) for e in everything]
    assert keys == sorted(keys) and len(set(keys)) == 220
    last = await store.last_position()
    middle = [e async for batch in store.read_all(from_position=50, to_position=100) for e in batch]
    assert {e.position for e in middle} == set(range(50, 101))
    carts = [e async for batch in store.read_all(categories=["Cart"]) for e in batch]
    assert len(carts) == 20 and {e.stream_id.category for e in carts} == {"Cart"}
    assert [e async for batch in store.read_all(from_position=last + 1) for e in batch] == []


async def test_subscribe_catches_up_then_follows_live(store: EventStore) -> None:
    await _fill(store, entities=3, per_entity=5)
    seen: list[int] = []

    async def follow() -> None:
        async for batch in store.subscribe(heartbeat_s=0.2):
            seen.extend(e.version for e in batch if e.stream_id.entity_id == "0")
            if len(seen) >= 8:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    for v in range(5, 8):
        await store.append(StreamId("Account", "0"), [Deposited(amount=v)], v)
    await asyncio.wait_for(task, 10)
    assert seen == list(range(1, 9))


async def test_subscribe_survives_a_server_restart_without_gap_or_duplicate(tmp_path: object) -> None:
    server = EmbeddedServer(tmp_path)  # type: ignore[arg-type]
    server.start()
    registry = TypeRegistry()
    registry.register(Deposited)
    store = await EventStore.connect(unique_settings(server.url), registry)
    writer = await EventStore.connect(store.settings, registry)
    positions: list[int] = []

    async def follow() -> None:
        async for batch in store.subscribe(heartbeat_s=0.2):
            positions.extend(e.position for e in batch)
            if len(positions) >= 60:
                return

    try:
        task = asyncio.create_task(follow())
        for i in range(30):
            await writer.append(StreamId("Account", str(i)), [Deposited(amount=i)], NO_STREAM)
        await asyncio.sleep(0.5)
        server.stop()
        await asyncio.sleep(0.5)
        server.start()
        for i in range(30, 60):
            for attempt in range(100):
                try:
                    await writer.append(StreamId("Account", str(i)), [Deposited(amount=i)], NO_STREAM)
                    break
                except Exception:
                    await asyncio.sleep(0.1)
        await asyncio.wait_for(task, 30)
        assert positions == list(range(1, 61))
    finally:
        await writer.close()
        await store.close()
        server.close()


async def test_a_live_read_waits_out_an_outage_up_to_the_outage_limit_then_names_the_server(tmp_path: object) -> None:
    """outage_limit_s bounds a live read's wait for a lost server; without it (the default) the read waits."""
    server = EmbeddedServer(tmp_path)  # type: ignore[arg-type]
    server.start()
    registry = TypeRegistry()
    registry.register(Deposited)
    patient = await EventStore.connect(unique_settings(server.url), registry)
    limited = await EventStore.connect(patient.settings.model_copy(update={"outage_limit_s": 1.5}), registry)

    async def follow(store: EventStore) -> None:
        async for _ in store.subscribe(heartbeat_s=0.2):
            pass

    try:
        await patient.append(StreamId("Account", "a"), [Deposited(amount=1)], NO_STREAM)
        waiting, giving_up = asyncio.create_task(follow(patient)), asyncio.create_task(follow(limited))
        await asyncio.sleep(0.5)
        server.stop()
        stopped = time.monotonic()
        with pytest.raises(ServerUnavailableError):
            async with asyncio.timeout(30):
                await giving_up
        assert time.monotonic() - stopped < 15
        await asyncio.sleep(1.0)
        assert not waiting.done(), "without a limit a live read waits the outage out"
        waiting.cancel()
    finally:
        await limited.close()
        await patient.close()
        server.close()


async def test_the_connection_is_closed_for_good_once_an_outage_passes_the_limit(
    tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py would reconnect for ever: past outage_limit_s the store closes the connection, so that every
    long-running user of it (serve, reactors) fails and ends instead of waiting on."""
    server = EmbeddedServer(tmp_path)  # type: ignore[arg-type]
    server.start()
    registry = TypeRegistry()
    registry.register(Deposited)
    limited = await EventStore.connect(unique_settings(server.url, outage_limit_s=1.0), registry)
    patient = await EventStore.connect(limited.settings.model_copy(update={"outage_limit_s": None}), registry)
    try:
        server.stop()
        stopped = time.monotonic()
        while not limited.nc.is_closed and time.monotonic() - stopped < 10:
            await asyncio.sleep(0.1)
        assert limited.nc.is_closed
        assert 1.0 <= time.monotonic() - stopped < 10
        assert any("outage limit" in r.getMessage() for r in caplog.records)
        assert not patient.nc.is_closed, "without a limit the connection keeps reconnecting"
        with pytest.raises(ServerUnavailableError):
            await limited.append(StreamId("Account", "z"), [Deposited(amount=1)], NO_STREAM)
        server.start()
        for _ in range(100):
            if patient.nc.is_connected:
                break
            await asyncio.sleep(0.1)
        assert patient.nc.is_connected
    finally:
        await limited.close()
        await patient.close()
        server.close()


async def test_catalogue_and_info(store: EventStore) -> None:
    await store.append(StreamId("Account", "b@x.io"), [Opened(owner="b"), Deposited(amount=1)], NO_STREAM)
    await store.append(StreamId("Account", "a"), [Opened(owner="a")], NO_STREAM)
    await store.append(StreamId("Account", "a"), [Deposited(amount=2)], 1)
    await store.append(StreamId("Cart", "c"), [Note(text="c")], NO_STREAM)
    page = await store.catalogue("Account")
    assert [(e.stream_id.entity_id, e.version, e.commits) for e in page] == [("a", 2, 2), ("b@x.io", 2, 1)]
    assert [e.stream_id.entity_id for e in await store.catalogue("Account", offset=1, limit=5)] == ["b@x.io"]
    info = await store.info()
    assert (info.last_position, info.commits) == (4, 4)
    assert await store.event_count() == 5


async def test_pending_counts_commits_after_a_position_and_finds_the_oldest(store: EventStore) -> None:
    assert await store.pending(0) == Pending(0, None, None)
    opened = await store.append(StreamId("Account", "a"), [Opened(owner="a"), Deposited(amount=1)], NO_STREAM)
    await store.append(StreamId("Cart", "c"), [Note(text="c")], NO_STREAM)
    await store.append(StreamId("Account", "b"), [Opened(owner="b")], NO_STREAM)
    await store.append(StreamId("Cart", "c"), [Note(text="d")], 1)
    everything = await store.pending(0)
    assert (everything.commits, everything.first_position) == (4, opened.position)
    (first,) = [e for e in await store.read(StreamId("Account", "a")) if e.version == 1]
    assert everything.first_recorded_at == first.recorded_at
    assert 0 <= everything.age_s() < 60
    carts = await store.pending(opened.position, ["Cart"])
    assert (carts.commits, carts.first_position) == (2, opened.position + 1)
    assert (await store.pending(opened.position + 1, ["Account", "Cart"])).commits == 2
    caught_up = await store.pending(await store.last_position())
    assert caught_up == Pending(0, None, None) and caught_up.age_s() == 0.0
    with pytest.raises(ValueError, match="position"):
        await store.pending(-1)


async def test_catalogue_pages_past_the_servers_multi_last_limit(store: EventStore) -> None:
    await asyncio.gather(
        *(store.append(StreamId("Account", f"{i:05d}"), [Note(text="x")] * (1 + i % 3), NO_STREAM) for i in range(1500))
    )
    page = await store.catalogue("Account", limit=2000)
    assert len(page) == 1500 and [e.version for e in page[:4]] == [1, 2, 3, 1]
    assert await store.event_count() == sum(1 + i % 3 for i in range(1500))


async def test_unknown_types_and_bad_payloads_raise_on_read(store: EventStore, nats_url: str) -> None:
    sid = StreamId("Account", "z")
    await store.append(sid, [Note(text="hello")], NO_STREAM)
    stranger = await EventStore.connect(store.settings, TypeRegistry())
    try:
        (event,) = await stranger.read(sid)
        assert event.type == "Note" and event.payload == b'{"text":"hello"}'
        with pytest.raises(UnknownEventTypeError, match="Unknown event type 'Note'"):
            event.data
    finally:
        await stranger.close()
    other = TypeRegistry()
    other.register(Deposited, name="Note")
    mismatched = await EventStore.connect(store.settings, other)
    try:
        (event,) = await mismatched.read(sid)
        with pytest.raises(EventDecodeError, match="does not validate"):
            event.data
    finally:
        await mismatched.close()


async def test_info_and_a_replay_of_a_missing_stream_say_so_clearly(nats_url: str) -> None:
    async with EventStore.connect(unique_settings(nats_url), create_stream=False) as store:
        with pytest.raises(StreamConfigError, match="There is no stream"):
            await store.info()
        started = asyncio.get_running_loop().time()
        with pytest.raises(StreamConfigError, match="there is no stream"):
            [batch async for batch in store.read_all(to_position=10)]
        assert asyncio.get_running_loop().time() - started < 1.0  # told at once, not retried
