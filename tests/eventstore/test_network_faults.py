"""A slow and lossy network between client and server (the test proxy's latency, latency spikes and connection
resets): retried appends stay idempotent and no call waits past its deadline."""

from __future__ import annotations

import asyncio
import random
import time

from eventstore import EventStore, ServerUnavailableError, StreamId
from tests.conftest import unique_settings
from tests.support.proxy import Proxy
from tests.support.workload import CATEGORY, Workload, check

TIMEOUT_S = 0.5
RETRIES = 2
# An append waits for at most: one lookup of the entity's version, every send (append_retries + 1), one search
# for an earlier send after a conflict, and the probe of a server that answered no send (half a timeout); plus
# the backoffs between sends and scheduling on a busy machine.
APPEND_BOUND_S = TIMEOUT_S * (RETRIES + 1 + 3) + 1.0
# A read waits for the entity's last commit and for the commits it points to.
READ_BOUND_S = TIMEOUT_S * 3 + 1.0


async def test_over_a_lossy_network_keyed_appends_are_stored_once_and_every_call_ends_in_time(nats_url: str) -> None:
    async with Proxy(nats_url, seed=5) as proxy:
        settings = unique_settings(proxy.url, request_timeout_s=TIMEOUT_S, append_retries=RETRIES)
        store = await EventStore.connect(settings)
        proxy.delay(0.002, jitter_s=0.003)
        proxy.lose(0.03, spike_s=0.3, reset_fraction=0.01)
        workload = Workload(store, entities=100, writers=8, kinds=("events", "entities"), seed=2)
        reads: list[float] = []
        read_errors: list[BaseException] = []

        async def read_meanwhile() -> None:
            rng = random.Random(3)
            while True:
                started = time.monotonic()
                try:
                    await store.read(StreamId(CATEGORY, rng.choice(workload.ids)))
                    await store.last_position()
                except ServerUnavailableError as exc:
                    read_errors.append(exc)
                reads.append(time.monotonic() - started)
                await asyncio.sleep(0.02)

        reader = asyncio.create_task(read_meanwhile())
        try:
            workload.start()
            await asyncio.sleep(5.0)
        finally:
            proxy.lose(0.0)
            proxy.delay(0.0)
            await workload.stop()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        # Read back past the proxy.
        async with EventStore.connect(settings.model_copy(update={"nats_url": nats_url}), create_stream=False) as direct:
            report = await check(direct, workload.ledger)
        await store.close()
    report.assert_clean()
    assert report.acked > 20
    assert proxy.resets > 0 and proxy.spikes > 0
    # Sends went unanswered and were resent, or calls failed and were retried with the same key: all stored once.
    assert workload.ledger.duplicate_acks + sum(workload.ledger.errors.values()) > 0
    assert workload.ledger.slowest_call_s <= APPEND_BOUND_S, workload.ledger.slowest_call_s
    assert reads and max(reads) <= READ_BOUND_S, max(reads)
