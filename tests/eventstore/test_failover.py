"""Failover: what callers see while a replicated stream elects a new leader, and a missing stream told apart
from a stream without a leader."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from eventstore import (
    ANY,
    EmbeddedCluster,
    EventStore,
    EventStoreSettings,
    ServerUnavailableError,
    StreamConfigError,
    StreamId,
)

from ..conftest import unique_settings
from .events import Deposited


async def test_an_append_to_a_missing_stream_is_a_config_error_at_once(settings: EventStoreSettings) -> None:
    # A 503 is also what a replicated stream answers between leaders; a stream the server says does not exist
    # must not wait out request_timeout_s as if an election were under way.
    slow = settings.model_copy(update={"request_timeout_s": 3.0})
    async with await EventStore.connect(slow, create_stream=False) as store:
        store.registry.register(Deposited)
        started = time.monotonic()
        with pytest.raises(StreamConfigError, match="does not exist") as info:
            await store.append(StreamId("Account", "1"), [Deposited(amount=1)], 0)
        assert time.monotonic() - started < 1.5
        assert "Account/1" in str(info.value)
        started = time.monotonic()
        with pytest.raises(StreamConfigError, match="does not exist"):
            await store.read(StreamId("Account", "1"))
        assert time.monotonic() - started < 1.5


async def test_read_all_and_subscribe_deliver_every_event_once_in_order_across_a_leader_kill(
    cluster: EmbeddedCluster,
) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=2.0)
    async with await EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        acked: list[int] = []
        errors: list[BaseException] = []

        stop = asyncio.Event()

        async def write(count: int) -> None:
            for i in range(count):
                if stop.is_set():
                    return  # not cancelled: an append cancelled in flight may be stored after the check below
                sid = StreamId("Account", str(i % 7))
                try:
                    result = await store.append(sid, [Deposited(amount=i)], ANY)
                    acked.append(result.position)
                except ServerUnavailableError as exc:  # the only error an election may cause
                    errors.append(exc)
                    await asyncio.sleep(0.1)

        seen: list[int] = []

        async def follow() -> None:
            async for batch in store.subscribe(heartbeat_s=0.2):
                seen.extend(e.position for e in batch)

        await write(100)
        following = asyncio.create_task(follow())
        try:
            leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
            writing = asyncio.create_task(write(10_000))
            await asyncio.sleep(0.3)
            cluster.kill(leader)
            await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream, other_than=leader)
            elected = len(acked)
            while len(acked) < elected + 50 and not writing.done():
                await asyncio.sleep(0.05)
            stop.set()
            await writing
            assert len(acked) >= elected + 50, f"appends resume after the election ({errors[-3:]})"
            last = await store.last_position()
            deadline = time.monotonic() + 15
            while (not seen or seen[-1] < last) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        assert seen == list(range(1, last + 1)), "subscribe delivers each position once, in order, without gaps"
        assert set(acked) <= set(seen)
        # A bounded read gives up after request_timeout_s; its consumer takes a meta leader (maybe the killed node).
        while await asyncio.to_thread(cluster.meta_leader) in (None, leader):
            await asyncio.sleep(0.1)
        read = [e.position async for batch in store.read_all() for e in batch]
        assert read == list(range(1, last + 1))


async def test_a_consistent_read_after_a_leader_kill_sees_the_last_acknowledged_write(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=2.0)
    async with await EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        sid = StreamId("Account", "1")
        for version in range(20):
            await store.append(sid, [Deposited(amount=version)], version)
        leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
        cluster.kill(leader)
        await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream, other_than=leader)
        # A consistent read creates a consumer, which takes a meta leader too: the killed node may have been it.
        while await asyncio.to_thread(cluster.meta_leader) in (None, leader):
            await asyncio.sleep(0.1)
        for version in range(20, 30):
            await store.append(sid, [Deposited(amount=version)], version)
            events = await store.read(sid, consistent=True)
            assert [e.version for e in events] == list(range(1, version + 2))


async def test_appends_go_on_across_a_graceful_stop_of_the_stream_leader(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=5.0)
    async with await EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        sid = StreamId("Account", "1")
        await store.append(sid, [Deposited(amount=0)], 0)
        leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
        stopping = asyncio.create_task(asyncio.to_thread(cluster.stop, leader))
        version = 1
        while not stopping.done() or version < 40:
            await store.append(sid, [Deposited(amount=version)], version)  # no error: the wait fits the deadline
            version += 1
        await stopping
        assert [e.version for e in await store.read(sid, consistent=True)] == list(range(1, version + 1))


async def test_a_resend_refused_while_its_first_send_is_in_flight_is_not_a_conflict(cluster: EmbeddedCluster) -> None:
    # The followers frozen: the leader proposes the first send but cannot commit it, and its answer is late. The
    # resend is refused with 10164 (a write to the subject in flight): that is the first send, not a rival.
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=1.5, append_retries=1)
    async with await EventStore.connect(settings) as setup:
        setup.registry.register(Deposited)
        sid = StreamId("Account", "1")
        await setup.append(sid, [Deposited(amount=0)], 0)
        leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
    on_leader = settings.model_copy(update={"nats_url": cluster.urls[leader]})
    followers = [cluster.nodes[i].pid for i in range(3) if i != leader]
    async with await EventStore.connect(on_leader, create_stream=False) as store:
        store.registry.register(Deposited)
        await store.append(sid, [Deposited(amount=1)], 1)  # the entity's position is known: no lookup below
        for pid in followers:
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
        try:
            appending = asyncio.create_task(store.append(sid, [Deposited(amount=2)], 2))
            await asyncio.sleep(2.0)  # the first send unanswered, the resend refused as in flight
        finally:
            for pid in followers:
                assert pid is not None
                os.kill(pid, signal.SIGCONT)
        result = await appending
        assert (result.first_version, result.last_version) == (3, 3)
        assert [e.version for e in await store.read(sid, consistent=True)] == [1, 2, 3]


async def test_a_stream_that_does_not_cover_the_subjects_is_a_configuration_error(nats_url: str) -> None:
    settings = unique_settings(nats_url, request_timeout_s=0.5)
    async with EventStore.connect(settings) as store:
        pass
    other = settings.model_copy(update={"subject_prefix": settings.subject_prefix + "x"})
    async with EventStore.connect(other, create_stream=False) as store:
        store.registry.register(Deposited)
        with pytest.raises(StreamConfigError, match="does not store subjects"):
            await store.append(StreamId("Account", "1"), [Deposited(amount=1)], 0)


async def test_a_read_of_a_missing_stream_is_a_configuration_error_naming_the_entity(nats_url: str) -> None:
    settings = unique_settings(nats_url, request_timeout_s=0.5)
    async with EventStore.connect(settings, create_stream=False) as store:
        with pytest.raises(StreamConfigError, match="Account/7.*does not exist"):
            await store.read(StreamId("Account", "7"))
