"""A flush (or a drain, which flushes) that gives up while the server is frozen leaves the connection working.

nats-py 2.16 sets the result of a PING's future when its PONG comes without checking that the flush still
waits: the late PONG of a flush that timed out ended nats-py's read loop, and the connection stayed
connected but deaf until its unanswered PINGs made nats-py drop it (about 14 s with the default pings).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from eventstore import EmbeddedServer, EventStore
from eventstore.connection import flush
from tests.conftest import unique_settings
from tests.support.freeze import frozen

GIVE_UP_S = 0.5
REQUEST_TIMEOUT_S = 2.0
"""Far below the ~14 s a deaf connection took to be dropped with the default pings (5 s, 2 outstanding)."""


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    """A server of this module's own: freezing the session's would stall other users of it."""
    with EmbeddedServer() as server:  # in a temporary directory of its own
        yield server


@pytest.fixture
async def store(server: EmbeddedServer) -> AsyncIterator[EventStore]:
    """A store on the module's server, connected with the default pings."""
    async with await EventStore.connect(unique_settings(server.url, request_timeout_s=REQUEST_TIMEOUT_S)) as store:
        yield store


async def _own_timeout(nc: Client) -> None:
    await nc.flush(timeout=1)


async def _cancelled(nc: Client) -> None:
    async with asyncio.timeout(GIVE_UP_S):
        await nc.flush()


async def _drain_cancelled(nc: Client) -> None:
    async def ignore(msg: Msg) -> None:
        pass

    sub = await nc.subscribe("flush.drained", cb=ignore)
    async with asyncio.timeout(GIVE_UP_S):
        await sub.drain()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("give_up", [_own_timeout, _cancelled, _drain_cancelled],
                         ids=["its own timeout", "cancelled", "a drain cancelled"])
async def test_a_flush_given_up_on_during_a_freeze_leaves_the_stores_connection_working(
    server: EmbeddedServer, store: EventStore, give_up: Callable[[Client], Awaitable[None]]
) -> None:
    async with frozen(server):
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await give_up(store.nc)
        assert time.monotonic() - started < 1 + 1.0, "the flush outlived its timeout"
    # The server answers the flush's PING first, then this request: nats-py must read past that PONG.
    info = await store.info()
    assert info.last_position == 0
    assert store.nc.is_connected


async def test_flush_leaves_a_plain_nats_py_client_working_when_it_times_out(server: EmbeddedServer) -> None:
    """The function flushes a client the caller made (``EventStore(nc)``) as safely as the store's own."""
    nc = await nats.connect(server.url)
    try:
        async def echo(msg: Msg) -> None:
            await msg.respond(b"ok")

        await nc.subscribe("flush.echo", cb=echo)
        await flush(nc, REQUEST_TIMEOUT_S)
        async with frozen(server):
            started = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await flush(nc, GIVE_UP_S)
            assert time.monotonic() - started < GIVE_UP_S + 1.0
        assert (await nc.request("flush.echo", b"", timeout=REQUEST_TIMEOUT_S)).data == b"ok"
    finally:
        await nc.close()
