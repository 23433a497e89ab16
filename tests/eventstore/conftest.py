from __future__ import annotations

import pytest

from eventstore import EventStore

from .events import ALL


@pytest.fixture
def store(store: EventStore) -> EventStore:
    """The shared ``store`` fixture with this package's event models registered."""
    for model in ALL:
        store.registry.register(model)
    return store
