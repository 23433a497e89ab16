"""A reactor's durable consumer on an R3 stream keeps handling events across the loss of its leader."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import BaseModel

from eventstore import ANY, EmbeddedCluster, EventStore, RecordedEvent, StreamId, stop_task
from projections import Reactor, ReactorWorker, read_reactor_dead_letters

from tests.conftest import unique_settings
from tests.support.elections import kill_the_leader, leader_killed


class Pinged(BaseModel):
    n: int


async def consumer_leader(store: EventStore, name: str) -> int | None:
    reply = await store.nc.request(f"$JS.API.CONSUMER.INFO.{store.settings.stream}.{name}", b"", timeout=2)
    leader = (json.loads(reply.data).get("cluster") or {}).get("leader")
    return None if leader is None else [EmbeddedCluster.node_name(i) for i in range(3)].index(leader)


async def test_a_reactor_handles_every_event_across_a_kill_of_its_consumer_leader(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=2.0)
    async with await EventStore.connect(settings) as store:
        store.registry.register(Pinged)
        handled: set[int] = set()

        async def handle(event: RecordedEvent) -> None:
            handled.add(event.position)

        worker = ReactorWorker(store, Reactor("pinger", handler=handle, ack_wait_s=2, max_deliver=3,
                                              retry_backoff_s=[0.1]), concurrency=8)
        await worker.setup()
        running = asyncio.ensure_future(worker.run())
        try:
            positions = [(await store.append(StreamId("Ping", str(n)), [Pinged(n=n)], ANY)).position for n in range(20)]
            leader = await consumer_leader(store, "pinger")
            assert leader is not None
            cluster.kill(leader)
            deadline = time.monotonic() + 20
            n = 20
            while time.monotonic() < deadline and (n < 60 or not set(positions) <= handled):
                try:
                    positions.append((await store.append(StreamId("Ping", str(n)), [Pinged(n=n)], ANY)).position)
                    n += 1
                except ConnectionError:  # ServerUnavailableError, during the election
                    pass
                await asyncio.sleep(0.05)
                assert not running.done(), running.exception()
            assert set(positions) <= handled, f"{len(set(positions) - handled)} events never handled"
        finally:
            worker.stop()
            await stop_task(running, timeout_s=10, grace_s=5)
        assert running.exception() is None
        assert await read_reactor_dead_letters(store, "pinger") == []


@pytest.mark.parametrize("of_the_stream", [True, False], ids=["stream-and-meta-leader", "meta-leader"])
async def test_a_reactor_starts_while_its_stream_elects_a_leader(cluster: EmbeddedCluster, of_the_stream: bool) -> None:
    # The node killed leads JetStream's meta group (and the stream): the consumer's and the dead-letter stream's
    # creation wait for a new meta leader (5-10 s, then perhaps "no suitable peers" until the node is back, 10 s
    # later), far beyond one request's timeout. The worker must wait and start, not fail.
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=1.0)
    async with await EventStore.connect(settings) as store:
        store.registry.register(Pinged)
        positions = [(await store.append(StreamId("Ping", str(n)), [Pinged(n=n)], ANY)).position for n in range(10)]
        handled: set[int] = set()

        async def handle(event: RecordedEvent) -> None:
            handled.add(event.position)

        async with leader_killed(cluster, settings.stream, of_the_stream=of_the_stream):
            worker = ReactorWorker(store, Reactor("starter", handler=handle, ack_wait_s=2), until_idle=True)
            async with asyncio.timeout(60):
                stats = await worker.run()
        assert handled == set(positions) and stats.dead_lettered == 0
        assert await read_reactor_dead_letters(store, "starter") == []  # the dead-letter stream exists, empty


async def test_a_reactor_stopped_while_it_waits_to_start_returns_at_once(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=5.0)
    async with await EventStore.connect(settings) as store:
        await kill_the_leader(cluster, settings.stream)
        worker = ReactorWorker(store, Reactor("stopped", handler=lambda event: asyncio.sleep(0)), until_idle=True)
        running = asyncio.ensure_future(worker.run())
        await asyncio.sleep(1.0)
        assert not running.done()
        worker.stop()
        started = time.monotonic()
        async with asyncio.timeout(10):
            stats = await running
        assert stats.handled == 0 and time.monotonic() - started < 2.0
