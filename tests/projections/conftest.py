"""Fixtures of the projection tests: a fresh stream, a fresh SQLite file and a private lease bucket per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eventstore import EventStore
from projections import ProjectionSettings

from projection_examples import register_all
from projection_helpers import make_settings


@pytest.fixture
def psettings(nats_url: str, tmp_path: Path) -> ProjectionSettings:
    return make_settings(nats_url, tmp_path / "read-models.sqlite3")


@pytest.fixture
async def es(psettings: ProjectionSettings) -> AsyncIterator[EventStore]:
    """A connected event store on the test's own stream, with the example events registered."""
    store = await EventStore.connect(psettings.eventstore)
    register_all(store)
    try:
        yield store
    finally:
        await store.close()

