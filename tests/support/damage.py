"""A stream that can be damaged, as one damaged before it was locked (or restored outside jetsourcing) is."""

from __future__ import annotations

import dataclasses

from eventstore import EventStore, EventStoreSettings


async def damageable_store(settings: EventStoreSettings) -> EventStore:
    """A store on a new stream that allows deletes and purges (otherwise as ``ensure_stream`` makes it): tests
    damage it with ``js.delete_msg`` and ``js.purge_stream``. Close it when done."""
    store = await EventStore.connect(settings, create_stream=False)
    config = dataclasses.replace(store.stream_config(), deny_delete=False, deny_purge=False)
    await store.nc.jetstream().add_stream(config)
    return store
