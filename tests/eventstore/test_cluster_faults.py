"""Fault tests on a 3-node cluster with an R3 stream: the stream leader SIGKILLed under load, a follower lost,
a quorum lost. The workload and its checker are in ``tests/support/workload.py``."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest

from eventstore import (
    ANY,
    EmbeddedCluster,
    EventStore,
    RecordedEvent,
    ServerUnavailableError,
    StreamConfigError,
    StreamId,
    stop_task,
)
from projections import Daemon, Outcome, Reactor, ReactorWorker, read_reactor_dead_letters
from tests.support.workload import (
    CATEGORY,
    Step,
    StepCounts,
    Workload,
    check,
    projection_checkpoint,
    read_model_equals_rebuild,
    read_workload_events,
)

from ..conftest import unique_settings
from .test_faults_single import make_projection_settings, wait_for


async def test_sigkill_of_the_stream_leader_under_load_loses_nothing_and_duplicates_nothing(
    cluster: EmbeddedCluster, tmp_path: Path
) -> None:
    settings = make_projection_settings(cluster.url, tmp_path / "rm.sqlite3")
    settings = settings.model_copy(update={"eventstore": settings.eventstore.model_copy(update={"replicas": 3, "request_timeout_s": 2.0})})
    store = await EventStore.connect(settings.eventstore)
    daemon = Daemon([StepCounts()], settings)
    following = asyncio.create_task(daemon.run())
    handled: set[int] = set()

    async def react(event: RecordedEvent) -> None:
        handled.add(event.position)

    reactor = Reactor("failover", handler=react, categories=[CATEGORY], ack_wait_s=2.0, retry_backoff_s=(0.2,))
    reactor_store = await EventStore.connect(settings.eventstore)  # a worker has a connection of its own
    worker = ReactorWorker(reactor_store, reactor, concurrency=16)
    await worker.setup()
    reacting = asyncio.create_task(worker.run())
    try:
        workload = Workload(store, entities=200, writers=16, seed=5)
        try:
            workload.start()
            await wait_for(lambda: len(workload.ledger.acked) > 50, 15, "the writers append")
            leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.eventstore.stream)
            cluster.kill(leader)
            killed = time.monotonic()
            await asyncio.to_thread(cluster.wait_for_stream_leader, settings.eventstore.stream, other_than=leader)
            elected = time.monotonic()
            await wait_for(lambda: set(workload.ledger.acked_after(elected)) == set(workload.kinds), 20,
                           lambda: f"every kind of write resumes (errors {dict(workload.ledger.errors)})")
            first = workload.ledger.first_ack_after(elected)
            assert first is not None and first - killed < 20
            await asyncio.sleep(1.0)
        finally:
            await workload.stop()
        # The killed node rejoins; reading the stream back needs JetStream's meta group, which may have lost its
        # leader with the node and elects one within about 5 s (longer than request_timeout_s).
        await asyncio.to_thread(cluster.start)
        report = await check(store, workload.ledger)
        report.assert_clean()
        assert report.unresolved == 0
        # The reactor handles every event at least once, and dead-letters nothing.
        positions = {e.position for e in await read_workload_events(store)}
        await wait_for(lambda: positions <= handled, 30, lambda: f"the reactor handles every event ({len(positions - handled)} left)")
        worker.stop()
        stats = await reacting
        assert stats.dead_lettered == 0
        await asyncio.to_thread(cluster.wait_for_stream_leader, f"{settings.eventstore.stream}_DLQ")
        assert await read_reactor_dead_letters(store) == []
        last = await store.last_position()
        await wait_for(lambda: projection_checkpoint(settings) == last, 30, "the daemon catches up")
        daemon.stop()
        assert await following == {StepCounts.name: Outcome.STOPPED}
        await read_model_equals_rebuild(settings, store, tmp_path / "clean.sqlite3")
    finally:
        if not following.done():
            daemon.stop()
            await stop_task(following, timeout_s=10, grace_s=5)
        if not reacting.done():
            worker.stop()
            await stop_task(reacting, timeout_s=10, grace_s=5)
        await reactor_store.close()
        await store.close()


async def test_a_lost_follower_changes_nothing_and_catches_up_when_it_returns(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=2.0)
    store = await EventStore.connect(settings)
    try:
        workload = Workload(store, entities=50, writers=8, seed=7)
        workload.start()
        try:
            await wait_for(lambda: len(workload.ledger.acked) > 30, 15, "the writers append")
            leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
            follower = next(i for i in cluster.running() if i != leader)
            cluster.stop(follower)
            stopped = time.monotonic()
            await wait_for(lambda: len(workload.ledger.acked_after(stopped + 1.0)) > 0 and
                           sum(workload.ledger.acked_after(stopped + 1.0).values()) > 50, 15,
                           lambda: f"writes go on without the follower (errors {dict(workload.ledger.errors)})")
            cluster.start_node(follower)
        finally:
            await workload.stop()
        report = await check(store, workload.ledger)
        report.assert_clean()
        assert report.unresolved == 0
        # The follower caught up: with the other two stopped in turn, reads served by it see everything.
        await asyncio.to_thread(cluster.start)
        expected = await store.last_position()
        await wait_for(lambda: _replica_last_seq(cluster, follower, settings.stream) == expected, 15,
                       "the returned follower catches up")
    finally:
        await store.close()


async def test_without_a_quorum_appends_fail_clearly_and_resume_when_it_returns(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=1.0, append_retries=1)
    store = await EventStore.connect(settings)
    store.registry.register(Step)
    try:
        sid = StreamId(CATEGORY, "q")
        await store.append(sid, [Step(command="c0", part=0, parts=1, entities=["q"])], ANY, idempotency_key="c0")
        leader = await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
        others = [i for i in cluster.running() if i != leader]
        for i in others:
            cluster.stop(i)
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError) as lost:
            for n in range(1, 100):  # the leader may take a moment to notice it lost its quorum
                await store.append(sid, [Step(command=f"c{n}", part=0, parts=1, entities=["q"])], ANY,
                                   idempotency_key=f"c{n}")
        took = time.monotonic() - started
        assert not isinstance(lost.value, StreamConfigError)
        assert str(sid) in str(lost.value), lost.value
        assert took < 30, took
        await asyncio.to_thread(cluster.start)
        await asyncio.to_thread(cluster.wait_for_stream_leader, settings.stream)
        unresolved = f"c{n}"
        deadline = time.monotonic() + 20
        while True:  # the same command, resent until the quorum is back: stored once
            try:
                result = await store.append(sid, [Step(command=unresolved, part=0, parts=1, entities=["q"])], ANY,
                                            idempotency_key=unresolved)
                break
            except ServerUnavailableError:
                assert time.monotonic() < deadline, "appends did not resume with the quorum"
                await asyncio.sleep(0.2)
        events = await store.read(sid)
        commands = [json.loads(e.payload)["command"] for e in events]
        assert len(commands) == len(set(commands)) and commands[-1] == unresolved
        assert [e.version for e in events] == list(range(1, len(events) + 1))
        # Stored by this resend, or (duplicate) by the unanswered send once the quorum was back: either way once.
        assert result.last_version == next(e.version for e in events if json.loads(e.payload)["command"] == unresolved)
    finally:
        await store.close()


def _replica_last_seq(cluster: EmbeddedCluster, node: int, stream: str) -> int:
    """The last sequence of ``stream`` in node ``node``'s own copy (its monitoring endpoint)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.http_ports[node]}/jsz?streams=true", timeout=2) as reply:
        jsz = json.loads(reply.read())
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                return int(detail["state"]["last_seq"])
    return -1
