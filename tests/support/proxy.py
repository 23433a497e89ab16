"""Unreliable networks for tests, on 127.0.0.1: a proxy that can swallow acknowledgements, go silent or go down,
and a server that accepts connections and never answers.

A lost acknowledgement (the append is stored, the client never hears so)::

    async with Proxy(nats_url) as proxy:
        store = await EventStore.connect(settings.model_copy(update={"nats_url": proxy.url}))
        proxy.drop_acks(1)          # the next publish acknowledgement never reaches the client

A hung server or a black-holed network: :meth:`Proxy.silence`; a stopped
server: :meth:`Proxy.down`; a server that never says a word:
:class:`SilentServer`. Client-to-server bytes pass unchanged; server-to-client
traffic is framed (``MSG``/``HMSG`` with their payloads, other control lines
whole) so that a message whose payload is a JetStream publish acknowledgement
(a JSON object with ``stream`` and ``seq`` and nothing but PubAck fields) can
be dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import TracebackType
from urllib.parse import urlsplit

__all__ = ["INFO_LINE", "Proxy", "SilentServer"]

INFO_LINE = (
    b'INFO {"server_id":"silent","server_name":"silent","version":"2.12.0","proto":1,"go":"go1.24",'
    b'"host":"127.0.0.1","port":4222,"headers":true,"max_payload":1048576,"jetstream":true}\r\n'
)
"""What a nats-server says first; :class:`SilentServer` can say it and then nothing more."""

_PUB_ACK_FIELDS = frozenset({"stream", "seq", "duplicate", "domain", "batch", "count", "val"})


def _is_pub_ack(payload: bytes) -> bool:
    if not payload.startswith(b"{"):
        return False
    try:
        data = json.loads(payload)
    except ValueError:
        return False
    return isinstance(data, dict) and {"stream", "seq"} <= data.keys() <= _PUB_ACK_FIELDS


class Proxy:
    """Forwards connections on 127.0.0.1 to ``upstream_url`` until told to drop acks, go silent or go down."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 4222)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._to_drop = 0
        self.dropping_all = False
        self.dropped = 0
        self.silent = False
        self.url = ""

    def drop_acks(self, count: int) -> None:
        """Swallow the next ``count`` publish acknowledgements (on any connection)."""
        self._to_drop = count

    def silence(self) -> None:
        """Keep every connection open but forward nothing more, either way (a hung server)."""
        self.silent = True

    async def down(self) -> None:
        """Close every connection and refuse new ones (a stopped server)."""
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            server, self._server = self._server, None
            async with asyncio.timeout(5):
                await server.wait_closed()

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.down()

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(5):
            server_r, server_w = await asyncio.open_connection(*self._upstream)
        self._writers.update((client_w, server_w))
        self._spawn(self._pipe(client_r, server_w))
        self._spawn(self._frames(server_r, client_w))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if not self.silent:
                    writer.write(data)
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readuntil(b"\r\n")
                frame = line
                op = line.split(b" ", 1)[0].upper()
                if op in (b"MSG", b"HMSG"):
                    size = int(line.split()[-1])
                    body = await reader.readexactly(size + 2)
                    frame += body
                    payload = body[:-2]
                    if op == b"HMSG":
                        payload = payload[int(line.split()[-2]) :]
                    if _is_pub_ack(payload) and (self.dropping_all or self._to_drop > 0):
                        self._to_drop = max(0, self._to_drop - 1)
                        self.dropped += 1
                        continue
                if not self.silent:
                    writer.write(frame)
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


class SilentServer:
    """Accepts TCP connections, optionally sends ``greeting``, then never answers (and never closes)."""

    def __init__(self, greeting: bytes = b"") -> None:
        self.greeting = greeting
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._handlers: list[asyncio.Task[object]] = []

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> SilentServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        async with asyncio.timeout(5):  # closing the sockets ends the handlers' reads
            await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.append(task)
        if self.greeting:
            writer.write(self.greeting)
        with contextlib.suppress(OSError):
            while await reader.read(65536):  # read what the client says, answer nothing
                pass
