"""Reactor workers stop cleanly: what a stopping worker fetched goes to the next worker at once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from eventstore import EventStore, RecordedEvent
from projections import Reactor, ReactorWorker

from test_reactors import append_numbered, connections, consumer_info, register

ACK_WAIT_S = 30.0  # the default: a message stranded with a stopped worker would come back only after this


async def test_a_stopped_worker_hands_back_what_it_fetched_and_the_next_until_idle_worker_gets_it_at_once(
    store: EventStore,
) -> None:
    handled: Counter[int] = Counter()

    async def handle(event: RecordedEvent) -> None:
        await asyncio.sleep(0.002)
        handled[event.data.n] += 1  # type: ignore[attr-defined]

    register(store)
    appended = 0
    async with connections(store.settings, 2) as (first, second):
        for round_ in range(4):
            reactor = Reactor("handback", handler=handle, ack_wait_s=ACK_WAIT_S)
            worker = ReactorWorker(first, reactor, concurrency=16)
            await worker.setup()
            running = asyncio.create_task(worker.run())
            await asyncio.sleep(0.2)  # its pull requests are out
            await append_numbered(store, range(appended, appended + 300))
            appended += 300
            worker.stop()  # right after the appends: messages are on their way to it
            async with asyncio.timeout(20):
                await running
            # Appended after the stop, while the stopped worker's pull requests may still be open at the server.
            await append_numbered(store, range(appended, appended + 50))
            appended += 50
            started = time.monotonic()
            async with asyncio.timeout(ACK_WAIT_S + 10):
                await ReactorWorker(second, reactor, concurrency=16, until_idle=True).run()
            seconds = time.monotonic() - started
            assert seconds < ACK_WAIT_S / 3, f"round {round_}: the next worker waited {seconds:.1f}s for stranded messages"
            assert set(handled) == set(range(appended)), f"round {round_}"


async def test_an_event_that_reaches_a_stopping_worker_is_handed_back_once_not_bounced_to_its_dead_letter(
    store: EventStore,
) -> None:
    # A stopping worker's pull requests stay open at the server until they expire. An event handed back at once
    # (a plain -NAK) went straight back into the same open request, so one late event bounced through the stopping
    # worker until its max_deliver was spent and it was dead-lettered "without a verdict" (make demo's step 2).
    deliveries: Counter[int] = Counter()

    async def handle(event: RecordedEvent) -> None:
        deliveries[event.data.n] += 1  # type: ignore[attr-defined]

    register(store)
    async with connections(store.settings, 2) as (first, second):
        for round_ in range(3):
            reactor = Reactor(f"late{round_}", handler=handle, max_deliver=3)
            worker = ReactorWorker(first, reactor, concurrency=16)
            await worker.setup()
            running = asyncio.create_task(worker.run())
            await asyncio.sleep(0.3)  # its pull request (16 messages, 2 s) is open and empty
            worker.stop()
            await append_numbered(store, range(1000 * round_, 1000 * round_ + 2))  # reaches the open request
            async with asyncio.timeout(20):
                await running
            async with asyncio.timeout(30):
                stats = await ReactorWorker(second, reactor, concurrency=16, until_idle=True).run()
            assert stats.dead_lettered == 0, f"round {round_}: a late event was dead-lettered"
            assert [deliveries[n] for n in range(1000 * round_, 1000 * round_ + 2)] == [1, 1], f"round {round_}"
            info = await consumer_info(store, f"late{round_}")
            assert info["num_redelivered"] <= 2  # type: ignore[operator]
