"""Fixtures of the projection tests: a fresh stream, a fresh read-model database and a private lease bucket per test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eventstore import EventStore
from projections import ProjectionSettings

from projection_examples import register_all
from projection_helpers import make_settings
from tests.support.postgres import unique_schema


@pytest.fixture
def psettings(request: pytest.FixtureRequest, nats_url: str, tmp_path: Path) -> ProjectionSettings:
    """Read models in a fresh SQLite file; in a PostgreSQL schema of their own for tests marked ``both_stores``
    (projection_helpers), which run once per store."""
    if getattr(request, "param", "sqlite") == "sqlite":
        return make_settings(nats_url, tmp_path / "read-models.sqlite3")
    return make_settings(nats_url, request.getfixturevalue("postgres_url"), postgres_schema=unique_schema())


@pytest.fixture
async def es(psettings: ProjectionSettings) -> AsyncIterator[EventStore]:
    """A connected event store on the test's own stream, with the example events registered."""
    store = await EventStore.connect(psettings.eventstore)
    register_all(store)
    try:
        yield store
    finally:
        await store.close()

