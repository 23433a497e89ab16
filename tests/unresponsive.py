"""Servers that do not answer, for tests of deadlines: a silent listener and a proxy that can go silent or down.

Both run on the test's event loop and listen on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["INFO_LINE", "Proxy", "SilentServer"]

INFO_LINE = (
    b'INFO {"server_id":"silent","server_name":"silent","version":"2.12.0","proto":1,"go":"go1.24",'
    b'"host":"127.0.0.1","port":4222,"headers":true,"max_payload":1048576,"jetstream":true}\r\n'
)
"""What a nats-server says first; :class:`SilentServer` can say it and then nothing more."""


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

    async def __aenter__(self) -> "SilentServer":
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


class Proxy:
    """Forwards TCP between clients and ``target`` (host, port) until told to go silent or down.

    :meth:`silence` keeps every connection open but forwards nothing more in
    either direction (a hung server or a black-holed network); :meth:`down`
    closes every connection and refuses new ones (a stopped server).
    """

    def __init__(self, target_url: str) -> None:
        host_port = target_url.rsplit("/", 1)[-1]
        host, _, port = host_port.rpartition(":")
        self._target = (host, int(port))
        self._server: asyncio.Server | None = None
        self._port = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.silent = False

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self._port}"

    async def __aenter__(self) -> "Proxy":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.down()

    def silence(self) -> None:
        self.silent = True

    async def down(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers += [writer, up_writer]
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if not self.silent:
                    sink.write(data)
                    await sink.drain()
        sink.close()
