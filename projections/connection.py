"""Connecting to the event store and naming leases: shared by the daemon, rebuilds and status."""

from __future__ import annotations

import asyncio

from eventstore import EventStore

from .settings import ProjectionSettings

__all__ = ["connect_event_store", "lease_key"]


async def connect_event_store(
    settings: ProjectionSettings, *, long_running: bool = False, stop: asyncio.Event | None = None
) -> EventStore:
    """Connect to the configured server; projections never start an embedded server of their own.

    ``long_running`` (the daemon, a rebuild) waits out an election at start as the outage policy says, until
    ``stop`` is set (see :meth:`EventStore.ensure_stream`)."""
    return await EventStore.connect(settings.eventstore.require_server(
        "Projections follow an existing event store; an empty embedded server started here would hold nothing."
    ), long_running=long_running, stop=stop)


def lease_key(store_id: str, projection: str, kind: str = "run") -> str:
    """The KV key of a lease: one per (read-model store, projection, kind), kind ``run`` or ``rebuild``."""
    return f"{store_id}.{projection}.{kind}"
