"""The bulk-read connection against servers that misbehave: every call ends, with a clear error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from eventstore import AuthenticationError, ConnectionSecurity, ServerUnavailableError
from eventstore.jetstream import BulkConnection, Raw

INFO = b'INFO {"server_id":"fake","version":"2.15.1","headers":true,"max_payload":1048576}\r\n'


class Received:
    """A receiver that records what the connection hands it."""

    scan = None

    def __init__(self) -> None:
        self.rows: list[Raw] = []
        self.errors: list[Exception] = []

    def add(self, rows: list[Raw]) -> None:
        self.rows += rows

    def add_run(self, run: object) -> None:
        raise AssertionError(run)

    def wake(self) -> None:
        pass

    def lost(self, error: Exception) -> None:
        self.errors.append(error)


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def fake_server() -> AsyncIterator[Callable[[Script], Awaitable[str]]]:
    """Start a TCP server on loopback that runs a script per connection; yields a function returning its URL."""
    servers: list[asyncio.Server] = []

    async def start(script: Script) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await script(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        servers.append(server)
        return f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(INFO)
    await reader.readuntil(b"PING\r\n")
    writer.write(b"PONG\r\n")
    await writer.drain()


async def test_a_malformed_message_line_ends_the_connection_and_tells_the_readers(fake_server) -> None:  # type: ignore[no-untyped-def]
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await handshake(reader, writer)
        await reader.readuntil(b"SUB _INBOX.x 1\r\n")
        writer.write(b"MSG _INBOX.x 1 5\r\nhello\r\nHMSG _INBOX.x 1 notanumber 12\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    url = await fake_server(script)
    conn = await BulkConnection.open([url], ConnectionSecurity(), deadline_s=5)
    received = Received()
    conn.subscribe("_INBOX.x", received)
    async with asyncio.timeout(5):
        while not received.errors:
            await asyncio.sleep(0.01)
    assert [row[3] for row in received.rows] == [b"hello"]
    assert isinstance(received.errors[0], ServerUnavailableError)
    assert "malformed" in str(received.errors[0]) and conn.closed


@pytest.mark.parametrize("behaviour", ["silent", "closes", "refuses"])
async def test_opening_ends_within_its_deadline_with_a_clear_error(fake_server, behaviour: str) -> None:  # type: ignore[no-untyped-def]
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if behaviour == "silent":
            await asyncio.sleep(10)
        elif behaviour == "refuses":
            writer.write(INFO)
            await reader.readuntil(b"PING\r\n")
            writer.write(b"-ERR 'Maximum Connections Exceeded'\r\n")
            await writer.drain()

    url = await fake_server(script)
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError) as raised:
        await BulkConnection.open([url], ConnectionSecurity(), deadline_s=1.0)
    assert time.monotonic() - started < 2.0
    assert not isinstance(raised.value, AuthenticationError)
    assert "Could not connect to NATS at nats://127.0.0.1" in str(raised.value)
    if behaviour == "refuses":
        assert "Maximum Connections Exceeded" in str(raised.value)


async def test_a_rejected_password_is_an_authentication_error_at_once(fake_server) -> None:  # type: ignore[no-untyped-def]
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(INFO)
        await reader.readuntil(b"PING\r\n")
        writer.write(b"-ERR 'Authorization Violation'\r\n")
        await writer.drain()

    url = await fake_server(script)
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match="rejected the credentials"):
        await BulkConnection.open([url.replace("nats://", "nats://bob:wrong@")], ConnectionSecurity(), deadline_s=5)
    assert time.monotonic() - started < 1.0


async def test_a_request_without_an_answer_ends_at_its_timeout(fake_server) -> None:  # type: ignore[no-untyped-def]
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await handshake(reader, writer)
        await asyncio.sleep(10)

    url = await fake_server(script)
    conn = await BulkConnection.open([url], ConnectionSecurity(), deadline_s=5)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await conn.request("$JS.API.INFO", b"", 0.3)
    assert time.monotonic() - started < 1.0
    conn.close()
