"""Snapshots with a silent server: every call ends within about request_timeout_s and logs what failed."""

from __future__ import annotations

import logging
import time

import pytest

from aggregates.snapshots import SnapshotStore
from eventstore import EventStore

from ..conftest import unique_settings
from tests.support.proxy import Proxy
from .domain import AccountState

TIMEOUT_S = 1.0
BOUND_S = 2 * TIMEOUT_S + 2


async def test_snapshot_calls_end_in_time_and_name_the_operation(nats_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async with Proxy(nats_url) as proxy:
        store = await EventStore.connect(unique_settings(proxy.url, request_timeout_s=TIMEOUT_S))
        snapshots = SnapshotStore(store, "Account", AccountState, every=1)
        await snapshots.put("a", 1, 1, AccountState(owner="Ann", balance=0, open=True), {})
        proxy.silence()
        try:
            started = time.monotonic()
            with caplog.at_level(logging.WARNING):
                assert await snapshots.get("a") is None
                await snapshots.put("a", 2, 2, AccountState(owner="Ann", balance=1, open=True), {})
            assert time.monotonic() - started < 2 * BOUND_S
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert warnings[0].startswith("Reading the snapshot of Account 'a': the NATS server did not answer"), warnings
            assert warnings[1].startswith("Writing the snapshot of Account 'a' at version 2: the NATS server did not"), warnings
            assert not any("$JS" in w for w in warnings)
        finally:
            await store.close()
