"""Acknowledged events survive a stopped or killed server, exactly once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from eventstore import ANY, EmbeddedServer, EventStore, StreamId, TypeRegistry

from ..conftest import unique_settings
from .events import Deposited


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_every_acknowledged_event_is_there_once_after_a_restart(tmp_path: Path, how: str) -> None:
    server = EmbeddedServer(tmp_path)
    server.start()
    registry = TypeRegistry()
    registry.register(Deposited)
    settings = unique_settings(server.url, request_timeout_s=1.0, append_retries=1)
    acknowledged: list[tuple[StreamId, int]] = []
    store = await EventStore.connect(settings, registry)

    async def write(i: int) -> None:
        sid = StreamId("Account", str(i % 50))
        try:
            await store.append(sid, [Deposited(amount=i)], ANY, idempotency_key=f"w{i}")
        except Exception:
            return  # not acknowledged: may or may not be stored
        acknowledged.append((sid, i))

    writers = asyncio.gather(*(write(i) for i in range(2000)))
    while len(acknowledged) < 200:
        await asyncio.sleep(0.01)
    server.kill() if how == "kill" else server.stop()
    await writers
    await store.close()
    server.start()
    store = await EventStore.connect(settings, registry)
    try:
        stored = [e async for batch in store.read_all() for e in batch]
        amounts = [e.data.amount for e in stored]  # type: ignore[attr-defined]
        assert len(amounts) == len(set(amounts)), "an event was stored twice"
        assert {i for _, i in acknowledged} <= set(amounts), "an acknowledged event was lost"
        assert len(acknowledged) > 0
        for i in range(50):
            versions = [e.version for e in await store.read(StreamId("Account", str(i)))]
            assert versions == list(range(1, len(versions) + 1))
    finally:
        await store.close()
        server.close()
