"""EmbeddedCluster: three real nats-servers routed as one cluster, nodes killed, stopped and brought back."""

from __future__ import annotations

import asyncio

import pytest

from eventstore import EmbeddedCluster, EventStore, EventStoreError, StreamId

from ..conftest import unique_settings
from .events import Deposited


async def test_an_r3_store_on_the_cluster_keeps_its_events_when_the_stream_leader_is_killed(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=2.0)
    async with await EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        sid = StreamId("Account", "1")
        await store.append(sid, [Deposited(amount=1), Deposited(amount=2)], 0)
        leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
        assert leader in cluster.running()
        cluster.kill(leader)
        new_leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream, other_than=leader)
        assert new_leader != leader and new_leader in cluster.running()
        assert [e.version for e in await store.read(sid)] == [1, 2]
        cluster.start_node(leader)
        assert sorted(cluster.running()) == [0, 1, 2]


def test_the_cluster_reports_no_stream_leader_without_a_quorum(cluster: EmbeddedCluster) -> None:
    async def create() -> str:
        settings = unique_settings(cluster.url, replicas=3, request_timeout_s=2.0)
        async with await EventStore.connect(settings):
            return settings.stream

    stream = asyncio.run(create())
    leader = cluster.wait_for_stream_leader(stream)
    others = [i for i in range(3) if i != leader]
    cluster.stop(others[0])
    cluster.kill(others[1])
    with pytest.raises(EventStoreError, match="elect a leader"):
        # The old leader steps down once it cannot reach a quorum, and nobody takes over.
        cluster.wait_for_stream_leader(stream, other_than=leader, timeout_s=3)
    cluster.start()
    assert cluster.wait_for_stream_leader(stream) in (0, 1, 2)


def test_a_cluster_needs_a_sensible_number_of_nodes() -> None:
    for nodes in (0, 10, True, 2.5, "3"):
        with pytest.raises(EventStoreError, match="whole number of nodes"):
            EmbeddedCluster(nodes)  # type: ignore[arg-type]
