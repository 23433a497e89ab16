"""Shutdown always completes: leases, the daemon and the CLI end within a bounded time, whatever a task does."""

from __future__ import annotations

import asyncio
from typing import Any

from eventstore import EventStore
from projections import ProjectionSettings
from projections.lease import Lease, open_lease_bucket

from nats.js.kv import KeyValue


class CancelSwallowingKV:
    """A real KV bucket whose ``update`` behaves like Python 3.11's ``asyncio.wait_for`` when the answer and a
    cancellation arrive together: the request completes and the cancellation is lost.

    That race sits inside nats-py's KV requests; here it happens on every update, so a lease that relies on
    one cancellation to stop its keep-alive never stops.
    """

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.updates = 0
        self.inside = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        request = asyncio.ensure_future(self._slow_update(key, value, last))
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            return await request  # the cancellation is swallowed, as wait_for does when the answer is in
        finally:
            self.updates += 1
            self.inside.clear()

    async def _slow_update(self, key: str, value: bytes, last: int | None) -> int:
        self.inside.set()
        await asyncio.sleep(0.05)  # a slow answer: the keep-alive is inside the request when release() comes
        return await self._kv.update(key, value, last=last)


async def test_lease_release_ends_even_when_the_keep_alive_swallows_its_cancellation(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    kv, ttl = await open_lease_bucket(es.nc, psettings.lease_bucket, 0.6)
    swallowing = CancelSwallowingKV(kv)
    lease = Lease(swallowing, "swallow", "me", ttl)  # type: ignore[arg-type]
    assert await lease.try_acquire()
    for _ in range(5):
        async with asyncio.timeout(5):
            await swallowing.inside.wait()
        # A liveness bound, checked from outside: release() must not hang, nor hide a hang by eating the
        # cancellation a timeout sends it.
        release = asyncio.ensure_future(lease.release())
        done, _ = await asyncio.wait({release}, timeout=5)
        assert release in done, "Lease.release() hung: its keep-alive task lost its cancellation"
        release.result()
        assert lease.revision is None
        assert await lease.holder() is None, "a released lease must be free at once"
        renewals = swallowing.updates
        await asyncio.sleep(ttl)  # nothing renews a released lease
        assert swallowing.updates == renewals
        assert await lease.try_acquire()
    await lease.release()
