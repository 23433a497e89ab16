"""Other entities' messages between an entity's commits, so a load walks back pointers instead of scanning."""

from __future__ import annotations

import asyncio
import uuid

from eventstore import EventStore, StreamId

GAP = 2100
"""Messages between two commits that make an entity sparse: more than a load would rather scan."""


async def noise(store: EventStore, count: int = GAP) -> None:
    """``count`` messages of a new entity, published without waiting for each acknowledgement."""
    subject = StreamId("Noise", uuid.uuid4().hex).subject(store.settings.subject_prefix)
    js = store.nc.jetstream(publish_async_max_pending=count)
    acks = [await js.publish_async(subject, b"{}") for _ in range(count)]
    await asyncio.gather(*acks)
