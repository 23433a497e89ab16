"""EmbeddedCluster: three real nats-servers routed as one cluster, nodes killed, stopped and brought back."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
from pathlib import Path

import pytest

from eventstore import EmbeddedCluster, EventStore, EventStoreError, StreamId, find_nats_server

from ..conftest import unique_settings
from .events import Deposited

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "cluster"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


async def test_the_sample_three_node_configuration_survives_the_loss_of_a_node(tmp_path: Path) -> None:
    """samples/cluster/n*.conf as a user starts them (ports moved to free ones so tests never collide)."""
    ports = {str(p): str(_free_port()) for base in (4220, 6220, 8220) for p in range(base + 1, base + 4)}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for i in (1, 2, 3):
            text = (SAMPLES / f"n{i}.conf").read_text()
            text = re.sub(r"\b(42[2][1-3]|62[2][1-3]|82[2][1-3])\b", lambda m: ports[m.group(1)], text)
            text = text.replace('"./data/', f'"{tmp_path}/')
            (tmp_path / f"n{i}.conf").write_text(text)
            processes.append(subprocess.Popen([find_nats_server(), "-c", str(tmp_path / f"n{i}.conf")],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = ",".join(f"nats://127.0.0.1:{ports[str(4220 + i)]}" for i in (1, 2, 3))
        settings = unique_settings(url, replicas=3, request_timeout_s=10.0)
        async with await EventStore.connect(settings) as store:  # waits out the cluster's first election
            store.registry.register(Deposited)
            sid = StreamId("Account", "1")
            await store.append(sid, [Deposited(amount=1)], 0)
            processes[0].kill()
            await store.append(sid, [Deposited(amount=2)], 1)  # within request_timeout_s of a new leader
            assert [e.version for e in await store.read(sid, consistent=True)] == [1, 2]
    finally:
        for process in processes:
            process.kill()
            process.wait()
