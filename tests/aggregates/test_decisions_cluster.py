"""Decisions on a 3-node cluster: many writers decide course subscriptions and username claims while the stream's
leader is killed; no rule is ever broken, and every command, retried by its command id, is decided once."""

from __future__ import annotations

import asyncio
from collections import Counter

from aggregates import Decisions, DomainError, RetryPolicy
from eventstore import EmbeddedCluster, EventStore, ServerUnavailableError
from samples.courses import Courses, StudentSubscribed, UsernameClaimed, register
from tests.conftest import unique_settings
from tests.support.elections import leader_killed

from .test_decisions import check_invariants


async def read_everything(store: EventStore) -> list[object]:
    """Every event's data, once the cluster answers again (the killed node is back, leaders may still move)."""
    async with asyncio.timeout(60):
        while True:
            try:
                return [e.data async for batch in store.read_all() for e in batch]
            except ServerUnavailableError:
                await asyncio.sleep(0.5)


async def test_writers_across_a_leader_kill_never_break_a_rule(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=2.0)
    writers = [await EventStore.connect(settings) for _ in range(3)]
    try:
        for writer in writers:
            register(writer.registry)
        await writers[0].dcb.ensure_index()
        setup = Courses(Decisions(writers[0]))
        await setup.define_course("c1", 2)  # three students ask for it (each several times)
        await setup.define_course("c2", 5)  # six do
        outcomes: Counter[str] = Counter()

        async def decided(courses: Courses, command: tuple[str, str, str], command_id: str) -> None:
            while True:  # a command interrupted by the election is sent again with its id: decided once
                try:
                    if command[0] == "subscribe":
                        await courses.subscribe(command[1], command[2], command_id=command_id)
                    else:
                        await courses.claim_username(command[1], command[2], command_id=command_id)
                    outcomes["done"] += 1
                    return
                except DomainError:
                    outcomes["refused"] += 1
                    return
                except ServerUnavailableError:
                    outcomes["retried"] += 1
                    await asyncio.sleep(0.2)

        async def writer(index: int, store: EventStore) -> None:
            courses = Courses(Decisions(store, retry=RetryPolicy(attempts=500)))
            for n in range(index, 48, len(writers)):
                command = ("subscribe", f"s{n % 12}", f"c{1 + n % 2}") if n % 4 else ("claim", "alice", f"u{n}")
                await decided(courses, command, f"cmd-{n}")

        async def kill() -> None:
            await asyncio.sleep(0.3)
            async with leader_killed(cluster, settings.stream, back_after_s=4.0):
                await asyncio.sleep(0.5)

        await asyncio.gather(kill(), *(writer(i, w) for i, w in enumerate(writers)))
        events = await read_everything(writers[1])
    finally:
        for writer_store in writers:
            await writer_store.close()
    check_invariants(events, {"c1": 2, "c2": 5})
    subscriptions = Counter(e.course for e in events if isinstance(e, StudentSubscribed))
    assert subscriptions == {"c1": 2, "c2": 5}  # both courses filled: nothing lost in the election
    assert sum(isinstance(e, UsernameClaimed) for e in events) == 1
    assert outcomes["done"] + outcomes["refused"] == 48
