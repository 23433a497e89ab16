from __future__ import annotations

import pytest

from eventstore import EventStore

from . import dcb_events
from .events import ALL


@pytest.fixture
def store(store: EventStore) -> EventStore:
    """The shared ``store`` fixture with this package's event models registered."""
    for model in ALL:
        store.registry.register(model)
    return store


@pytest.fixture
async def dcb_store(store: EventStore) -> EventStore:
    """The shared store, with the DCB tests' events registered and the index subjects added to its stream."""
    dcb_events.register(store.registry)
    await store.dcb.ensure_index()
    return store
