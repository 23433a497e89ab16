"""Fault tests on a 3-node cluster with an R3 stream: the stream leader SIGKILLed under load, a follower lost,
a quorum lost. The workload and its checker are in ``tests/support/workload.py``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from eventstore import EmbeddedCluster, EventStore, RecordedEvent, stop_task
from projections import Daemon, Outcome, Reactor, ReactorWorker, read_reactor_dead_letters
from tests.support.workload import (
    CATEGORY,
    StepCounts,
    Workload,
    check,
    projection_checkpoint,
    read_model_equals_rebuild,
    read_workload_events,
)

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
