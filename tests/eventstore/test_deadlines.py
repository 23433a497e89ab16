"""Every call of the event store ends within about request_timeout_s when the server is silent or gone.

Each failure is a :class:`ServerUnavailableError` naming the operation (never a
raw nats-py error, never an internal subject), and a server that is down is
logged once per change of state, not once per reconnect attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import pytest
from pydantic import BaseModel

from eventstore import EmbeddedServer, EventStore, EventStoreClosedError, EventStoreSettings, ServerUnavailableError, StreamId

from ..conftest import unique_settings
from tests.support.proxy import INFO_LINE, Proxy, SilentServer

TIMEOUT_S = 1.0
BOUND_S = 2 * TIMEOUT_S + 2  # "about request_timeout_s", with room for a loaded machine


class Opened(BaseModel):
    owner: str


ACCOUNT = StreamId("Account", "acc 42")


async def _fails_in_time(call: Awaitable[object]) -> ServerUnavailableError:
    """Await ``call``; it must raise ServerUnavailableError within BOUND_S."""
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError) as caught:
        async with asyncio.timeout(30):  # today's code would otherwise hang the test
            await call
    elapsed = time.monotonic() - started
    assert elapsed < BOUND_S, f"took {elapsed:.1f}s: {caught.value}"
    assert "$JS" not in str(caught.value) and "_INBOX" not in str(caught.value)
    return caught.value


@pytest.mark.parametrize("greeting", [b"", INFO_LINE], ids=["accepts-and-says-nothing", "sends-info-then-nothing"])
async def test_connect_to_a_silent_server_fails_within_the_request_timeout(greeting: bytes) -> None:
    async with SilentServer(greeting) as silent:
        settings = EventStoreSettings(nats_url=silent.url, request_timeout_s=TIMEOUT_S)
        error = await _fails_in_time(EventStore.connect(settings))
    assert "Could not connect to NATS" in str(error) and str(TIMEOUT_S) in str(error)


async def test_a_refused_first_connection_logs_no_warnings(caplog: pytest.LogCaptureFixture) -> None:
    port = EmbeddedServer().port  # a free port nobody listens on
    settings = EventStoreSettings(nats_url=f"nats://127.0.0.1:{port}", request_timeout_s=TIMEOUT_S)
    with caplog.at_level(logging.DEBUG, logger="jetsourcing.eventstore"):
        await _fails_in_time(EventStore.connect(settings))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("jetsourcing")] == []


def _inspections(store: EventStore) -> dict[str, tuple[Callable[[], Awaitable[object]], str]]:
    """Every waiting call of the store, and what its error must name."""

    async def read_all() -> object:
        return [batch async for batch in store.read_all()]

    stream = store.settings.stream
    return {
        "info": (store.info, stream),
        "last_position": (store.last_position, stream),
        "ensure_stream": (store.ensure_stream, stream),
        "catalogue": (lambda: store.catalogue("Account"), "'Account'"),
        "event_count": (store.event_count, stream),
        "pending": (lambda: store.pending(0), "after position 0"),
        "version": (lambda: store.version(ACCOUNT), str(ACCOUNT)),
        "read": (lambda: store.read(ACCOUNT), str(ACCOUNT)),
        "read_consistent": (lambda: store.read(ACCOUNT, consistent=True), str(ACCOUNT)),
        "find_append": (lambda: store.find_append(ACCOUNT, "k"), str(ACCOUNT)),
        "read_all": (read_all, stream),
    }


@pytest.mark.parametrize("outage", ["silent", "down"])
async def test_every_inspection_fails_in_time_and_names_the_operation(nats_url: str, outage: str) -> None:
    async with Proxy(nats_url) as proxy:
        store = await EventStore.connect(unique_settings(proxy.url, request_timeout_s=TIMEOUT_S))
        store.registry.register(Opened)
        await store.append(ACCOUNT, [Opened(owner="ann")])
        if outage == "silent":
            proxy.silence()
        else:
            await proxy.down()
        try:
            for name, (call, named) in _inspections(store).items():
                error = await _fails_in_time(call())
                assert named in str(error), f"{name}: {error}"
                assert "did not answer within 1.0s" in str(error), f"{name}: {error}"
        finally:
            started = time.monotonic()
            await store.close()
            assert time.monotonic() - started < BOUND_S


async def test_a_closed_store_raises_a_closed_error_at_once(settings: EventStoreSettings) -> None:
    store = await EventStore.connect(settings)
    await store.close()
    for name, (call, named) in _inspections(store).items():
        started = time.monotonic()
        with pytest.raises(EventStoreClosedError) as caught:  # not an outage: never retried
            async with asyncio.timeout(30):
                await call()
        assert time.monotonic() - started < 0.5, name
        error = caught.value
        assert "closed" in str(error) and named in str(error), f"{name}: {error}"


async def test_a_lost_server_is_logged_once_not_at_every_attempt(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with Proxy(nats_url) as proxy:
        store = await EventStore.connect(unique_settings(proxy.url, request_timeout_s=TIMEOUT_S))
        try:
            with caplog.at_level(logging.DEBUG, logger="jetsourcing.eventstore"):
                await proxy.down()
                await asyncio.sleep(2.5)  # a dozen reconnect attempts
            warnings = [
                r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "jetsourcing.eventstore"
            ]
            assert 1 <= len(warnings) <= 2, warnings
            assert any("NATS connection" in w and "retrying" in w for w in warnings)
        finally:
            await store.close()
