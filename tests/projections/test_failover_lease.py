"""A lease's confirmation (before a read model is re-claimed) decides by the key's owner, not by a revision race."""

from __future__ import annotations

import uuid

import nats

from projections.lease import Lease, open_lease_bucket


async def test_confirm_keeps_a_lease_whose_renewal_landed_unseen(nats_url: str) -> None:
    # A renewal whose answer was lost, or (replicated bucket) one still in flight, answered with err_code 10164:
    # either way the key's revision is not the one the lease knows, and the key is still ours.
    nc = await nats.connect(nats_url)
    try:
        kv, ttl = await open_lease_bucket(nc, f"leases_{uuid.uuid4().hex[:10]}", 5.0)
        lease = Lease(kv, "projection.a", "owner-1", ttl, request_timeout_s=2.0)
        assert await lease.try_acquire()
        try:
            await kv.put("projection.a", b"owner-1")
            assert await lease.confirm()
            assert not lease.lost.is_set()
            await kv.put("projection.a", b"owner-2")  # really taken
            assert not await lease.confirm()
            assert lease.lost.is_set()
        finally:
            await lease.release()
    finally:
        await nc.close()
