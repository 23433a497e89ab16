"""Reactor workers stop cleanly: what a stopping worker fetched goes to the next worker at once."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from eventstore import EventStore, RecordedEvent
from projections import Reactor, ReactorWorker

from test_reactors import append_numbered, connections, register

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
