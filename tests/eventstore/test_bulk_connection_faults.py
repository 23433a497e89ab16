"""The store's connections when a server goes silent (a blackholed network: sockets open, every byte dropped),
when the store closes under calls in flight, and when opens fail: every call ends in time with a typed error,
and nothing is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import nats
import pytest

from eventstore import (
    NO_STREAM,
    AuthenticationError,
    ConnectionSecurity,
    EmbeddedCluster,
    EmbeddedServer,
    EventStore,
    EventStoreClosedError,
    EventStoreSettings,
    ServerUnavailableError,
    StreamId,
    stop_task,
)
from eventstore.jetstream import BulkConnection
from eventstore.jetstream.replay import OrderedReplay
from eventstore.jetstream import SharedConnection
from tests.conftest import unique_settings
from tests.support.proxy import Proxy, SilentServer

from .events import ALL, Deposited


async def _connect(settings: EventStoreSettings) -> EventStore:
    store = await EventStore.connect(settings)
    for model in ALL:
        store.registry.register(model)
    return store


async def _first(batches: AsyncIterator[Any]) -> Any:
    async for batch in batches:
        return batch
    return None


async def _ends_within(call: Awaitable[Any], seconds: float) -> BaseException | None:
    """The error ``call`` ends with (None when it returns), asserting it ends within ``seconds``."""
    started = time.monotonic()
    try:
        await call
    except BaseException as exc:  # noqa: BLE001 - the error is the result
        return exc
    finally:
        assert time.monotonic() - started < seconds, f"took {time.monotonic() - started:.1f}s"
    return None


async def test_close_ends_every_request_in_flight_at_once_with_a_typed_error(nats_url: str) -> None:
    async with Proxy(nats_url) as proxy:
        store = await _connect(unique_settings(proxy.url, request_timeout_s=3.0))
        account = StreamId("Account", "a-1")
        await store.append(account, [Deposited(amount=1)], expected_version=NO_STREAM)
        assert await _first(store.read_all())  # the bulk-read connection is open
        proxy.silence()
        loop = asyncio.get_running_loop()
        calls = {
            "read": loop.create_task(store.read(account)),  # a direct get on the store's own connection
            "append": loop.create_task(store.append(account, [Deposited(amount=2)], expected_version=1)),
            "read_all": loop.create_task(_first(store.read_all(to_position=1))),  # a request on the bulk one
            "subscribe": loop.create_task(_first(store.subscribe(from_position=2))),
        }
        await asyncio.sleep(0.5)
        assert not any(task.done() for task in calls.values())
        closing = loop.create_task(store.close())
        started = time.monotonic()
        done, _ = await asyncio.wait(calls.values(), timeout=1.0)
        assert set(done) == set(calls.values()), f"still waiting after close: {[n for n, t in calls.items() if not t.done()]}"
        for name, task in calls.items():
            assert isinstance(task.exception(), EventStoreClosedError), (name, task.exception())
        assert time.monotonic() - started < 1.0
        async with asyncio.timeout(10):
            await closing
        # And a call after close fails the same way, at once.
        assert isinstance(await _ends_within(store.read(account), 1.0), EventStoreClosedError)


async def test_a_closed_store_ends_live_and_bounded_replays_at_once(settings: EventStoreSettings) -> None:
    store = await _connect(settings)
    await store.append(StreamId("Account", "a-1"), [Deposited(amount=1)], expected_version=NO_STREAM)
    await store.close()
    calls = {
        "subscribe": _first(store.subscribe()),
        "live replay": _first(store.replay(live=True)),
        "read_all": _first(store.read_all(to_position=1)),
    }
    for name, call in calls.items():
        async with asyncio.timeout(10):  # the old code retried a closed store for ever
            error = await _ends_within(call, 0.5)
        assert isinstance(error, EventStoreClosedError), (name, error)
        assert "Reading" in str(error), error  # names the read


async def test_a_half_open_replay_connection_is_not_handed_out_again(nats_url: str) -> None:
    async with Proxy(nats_url) as proxy:
        store = await _connect(unique_settings(proxy.url, request_timeout_s=1.0))
        try:
            await store.append(StreamId("Account", "a-1"), [Deposited(amount=1)], expected_version=NO_STREAM)
            assert await _first(store.read_all(to_position=1))
            opened = proxy.connections
            proxy.blackhole()  # the replay connection (and the store's own) now lead nowhere, without a reset
            outcomes: list[str] = []
            for _ in range(4):
                try:
                    async with asyncio.timeout(10):
                        batch = await _first(store.read_all(to_position=1))
                    outcomes.append("read" if batch else "empty")
                except ServerUnavailableError:
                    outcomes.append("failed")
            # The read that finds the connection dead may fail; no later read is handed that connection.
            assert outcomes[1:] == ["read"] * 3, outcomes
            assert proxy.connections == opened + 1
        finally:
            async with asyncio.timeout(10):
                await store.close()


def _descriptors() -> int:
    """This process's open descriptors (the sockets of connections closed a moment ago are let go first)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


async def test_failed_and_cancelled_opens_leave_no_descriptor() -> None:
    async with SilentServer() as silent:  # accepts, says nothing (each connection is one descriptor of its own here)
        await asyncio.sleep(0.2)  # what earlier tests closed is let go
        before = _descriptors()
        for _ in range(10):
            with pytest.raises(ServerUnavailableError):
                await BulkConnection.open([silent.url], ConnectionSecurity(), deadline_s=0.1)
        for _ in range(10):
            opening = asyncio.ensure_future(BulkConnection.open([silent.url], ConnectionSecurity(), deadline_s=5))
            await asyncio.sleep(0.05)
            opening.cancel()
            with pytest.raises(asyncio.CancelledError):
                await opening
        await asyncio.sleep(0.1)
        assert silent.connections == 20
        assert _descriptors() - before <= silent.connections  # the server's ends only


async def test_live_replay_retries_leave_no_descriptor() -> None:
    async with SilentServer() as silent:
        shared = SharedConnection(lambda: [silent.url], ConnectionSecurity(), 0.2, "test")
        replay = OrderedReplay(shared.get, "EVENTS", live=True, api_timeout_s=0.2)
        await asyncio.sleep(0.2)  # what earlier tests closed is let go
        before = _descriptors()
        reading = asyncio.ensure_future(_first(replay.batches()))
        await asyncio.sleep(3)  # a retry every 0.2 s to 1.2 s
        await stop_task(reading, timeout_s=5)
        shared.close()
        await asyncio.sleep(0.1)
        assert silent.connections >= 4
        assert _descriptors() - before <= silent.connections  # the server's ends only


async def test_a_close_during_an_open_leaves_no_connection(nats_url: str) -> None:
    async with Proxy(nats_url) as proxy:
        proxy.delay(0.3)  # an open takes a few round trips: about a second
        shared = SharedConnection(lambda: [proxy.url], ConnectionSecurity(), 10.0, "test")
        opening = asyncio.ensure_future(shared.get())
        await asyncio.sleep(0.5)
        assert not opening.done()
        shared.close()
        async with asyncio.timeout(10):
            with pytest.raises(EventStoreClosedError):
                await opening
        proxy.delay(0.0)
        for _ in range(50):  # the proxy sees the client's end closed
            if not proxy.open_connections:
                break
            await asyncio.sleep(0.1)
        assert proxy.connections == 1 and proxy.open_connections == 0


class _Lost:
    """A receiver that only records the error the connection ends with."""

    scan = None

    def __init__(self) -> None:
        self.error: Exception | None = None

    def add(self, rows: list[Any]) -> None:
        pass

    def add_run(self, run: object) -> None:
        raise AssertionError(run)

    def wake(self) -> None:
        pass

    def lost(self, error: Exception) -> None:
        self.error = error


async def test_pings_notice_a_silent_replay_connection_within_the_detection_interval(nats_url: str) -> None:
    async with Proxy(nats_url) as proxy:
        pings = {"ping_interval_s": 0.2, "max_outstanding_pings": 2}  # detected within 0.6 s
        idle = await BulkConnection.open([proxy.url], ConnectionSecurity(), deadline_s=5, **pings)  # type: ignore[arg-type]
        await asyncio.sleep(1.0)
        assert not idle.closed  # a server that answers its PINGs keeps its connection
        receiver = _Lost()
        idle.subscribe("nothing.here", receiver)
        proxy.blackhole()
        started = time.monotonic()
        while not idle.closed and time.monotonic() - started < 10:
            await asyncio.sleep(0.02)
        assert idle.closed and 0.3 < time.monotonic() - started < 1.5, time.monotonic() - started
        assert isinstance(receiver.error, ServerUnavailableError) and "PING" in str(receiver.error), receiver.error


async def test_a_live_replay_and_appends_go_on_after_their_server_goes_silent(nats_url: str) -> None:
    settings = unique_settings("", request_timeout_s=1.5, ping_interval_s=0.3, max_outstanding_pings=2)
    detection_s = 0.9
    account = StreamId("Account", "a-1")
    async with Proxy(nats_url) as proxy:
        store = await _connect(settings.model_copy(update={"nats_url": proxy.url}))
        try:
            await store.append(account, [Deposited(amount=1)], expected_version=NO_STREAM)
            live = store.subscribe(heartbeat_s=0.5)
            assert [e.data.amount for e in await anext(live)] == [1]
            proxy.blackhole()  # both of the store's connections; new ones pass (another route, another node)
            started = time.monotonic()
            async with asyncio.timeout(30):
                await store.append(account, [Deposited(amount=2)], expected_version=1)
            appended = time.monotonic() - started
            assert appended < detection_s + 2 * settings.request_timeout_s + 1.0, appended
            async with asyncio.timeout(30):
                batch = await anext(live)
            resumed = time.monotonic() - started
            assert [e.data.amount for e in batch] == [2]
            assert resumed < detection_s + 2 * settings.request_timeout_s + 1.0, resumed
            await live.aclose()  # type: ignore[attr-defined]
        finally:
            async with asyncio.timeout(10):
                await store.close()


async def test_connect_reaches_a_live_server_listed_after_a_silent_one(nats_url: str) -> None:
    async with SilentServer() as silent:  # accepts, never sends INFO: a blackholed seed
        for _ in range(4):  # nats-py picks the first server at random
            settings = unique_settings(f"{silent.url},{nats_url}", request_timeout_s=2.0)
            async with asyncio.timeout(10):
                store = await EventStore.connect(settings)
            await store.close()


async def test_an_open_fails_over_from_a_silent_server_to_a_live_one(nats_url: str) -> None:
    async with SilentServer() as silent:  # accepts, never sends INFO: a blackholed server
        for _ in range(6):  # the order is shuffled: the silent one comes first about half the time
            started = time.monotonic()
            conn = await BulkConnection.open([silent.url, nats_url], ConnectionSecurity(), deadline_s=4.0)
            assert conn.url == nats_url and time.monotonic() - started < 4.0  # the silent one had half of it
            conn.close()
        assert silent.connections >= 1


async def test_replays_fail_over_to_the_servers_the_cluster_advertised(cluster: EmbeddedCluster) -> None:
    async with Proxy(cluster.urls[0]) as seed:  # the only server configured
        shared = SharedConnection(lambda: [seed.url], ConnectionSecurity(), 2.0, "test")
        try:
            first = await shared.get()
            assert first.url == seed.url
            await seed.down()  # the seed is gone for good; the cluster's other nodes are not
            async with asyncio.timeout(10):
                while not first.closed:
                    await asyncio.sleep(0.02)
                second = await shared.get()
            assert second.url in cluster.urls  # as advertised (node 0 itself, reached directly, would do too)
        finally:
            shared.close()


_PERMISSIONS = """
authorization {
  users: [
    {user: limited, password: pw, permissions: {publish: {deny: ["forbidden.>"]}}}
    {user: boxed, password: pw, permissions: {subscribe: {allow: ["_MY.>"]}}}
  ]
}
"""


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A server whose users lack some permissions."""
    server = EmbeddedServer(tmp_path_factory.mktemp("guarded"), extra_config=_PERMISSIONS)
    server.start()
    yield server
    server.close()


async def test_a_permission_violation_fails_what_was_refused_and_keeps_the_connection(
    guarded_server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    security = ConnectionSecurity(user="limited", password="pw")  # type: ignore[arg-type]
    conn = await BulkConnection.open([guarded_server.url], security, deadline_s=5)
    try:
        received = _Lost()
        conn.subscribe("allowed.x", received)
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(AuthenticationError, match="Permissions Violation for Publish"):
                await conn.request("forbidden.x", b"", timeout_s=5)
            assert time.monotonic() - started < 1.0  # at once, not at the timeout
        await conn.flush(2)  # the connection, and its subscription, go on
        assert not conn.closed and received.error is None
        refusals = [r for r in caplog.records if "Permissions Violation" in r.getMessage()]
        assert len(refusals) == 1 and refusals[0].levelname == "WARNING"  # logged once, not per refusal
    finally:
        conn.close()


@pytest.mark.parametrize("own_connection", [False, True], ids=["connect", "own-nats-py-connection"])
async def test_replays_use_the_connections_inbox_prefix(guarded_server: EmbeddedServer, own_connection: bool) -> None:
    settings = unique_settings(guarded_server.url, user="boxed", password="pw", request_timeout_s=2.0)
    async with asyncio.timeout(30):
        if own_connection:  # EventStore(nc): the replays learn the prefix from nc's options
            nc = await nats.connect(guarded_server.url, user="boxed", password="pw", inbox_prefix="_MY")
            await nc.jetstream().add_stream(name=settings.stream, subjects=[f"{settings.subject_prefix}.>"])
            store = EventStore(nc, settings)
        else:
            store = await EventStore.connect(settings, inbox_prefix="_MY")  # the user may subscribe to _MY.> only
        try:
            for model in ALL:
                store.registry.register(model)
            await store.append(StreamId("Account", "a-1"), [Deposited(amount=1)], expected_version=NO_STREAM)
            batch = await _first(store.read_all())
            assert [e.data.amount for e in batch] == [1]
            live = store.subscribe()
            assert [e.data.amount for e in await anext(live)] == [1]
            await live.aclose()  # type: ignore[attr-defined]
        finally:
            await store.close()
            if own_connection:
                await nc.close()


async def test_a_replay_refused_its_inbox_fails_at_once_naming_the_permission(guarded_server: EmbeddedServer) -> None:
    settings = unique_settings(guarded_server.url, user="boxed", password="pw", request_timeout_s=2.0)
    store = await EventStore.connect(settings, create_stream=False)  # inbox_prefix left at _INBOX: refused
    try:
        for read in (_first(store.subscribe()), _first(store.read_all(to_position=5))):
            async with asyncio.timeout(10):  # the old code retried a live read for ever
                error = await _ends_within(read, 3.0)
            assert isinstance(error, AuthenticationError) and "inbox_prefix" in str(error), error
    finally:
        await store.close()


async def test_a_live_replay_and_appends_move_to_another_node_when_theirs_goes_silent(cluster: EmbeddedCluster) -> None:
    async with contextlib.AsyncExitStack() as stack:
        proxies = [await stack.enter_async_context(Proxy(url)) for url in cluster.urls]  # a route per node
        settings = unique_settings(
            ",".join(p.url for p in proxies), replicas=3, request_timeout_s=2.0, ping_interval_s=0.3,
            max_outstanding_pings=2,
        )
        bound_s = 0.9 + settings.request_timeout_s + 2.0  # detection, one request timeout, room for a loaded machine
        account = StreamId("Account", "a-1")
        store = await _connect(settings)
        try:
            await store.append(account, [Deposited(amount=1)], expected_version=NO_STREAM)
            live = store.subscribe(heartbeat_s=0.5)
            assert [e.data.amount for e in await anext(live)] == [1]
            silenced = [p for p in proxies if p.open_connections]
            for proxy in silenced:  # the store's nodes are cut off from it, without a reset; the cluster is whole
                proxy.silence()
            started = time.monotonic()
            async with asyncio.timeout(30):
                await store.append(account, [Deposited(amount=2)], expected_version=1)
            assert time.monotonic() - started < bound_s + settings.request_timeout_s, time.monotonic() - started
            async with asyncio.timeout(30):
                batch = await anext(live)
            assert [e.data.amount for e in batch] == [2]
            assert time.monotonic() - started < bound_s + settings.request_timeout_s, time.monotonic() - started
            await live.aclose()  # type: ignore[attr-defined]
        finally:
            async with asyncio.timeout(15):
                await store.close()
