"""A loopback TCP proxy between a NATS client and server that can swallow JetStream publish acknowledgements.

Use it to prove that an append whose acknowledgement was lost is stored once::

    async with AckDropper(nats_url) as proxy:
        store = await EventStore.connect(settings.model_copy(update={"nats_url": proxy.url}))
        proxy.drop_acks(1)          # the next acknowledgement never reaches the client
        ...

Client to server bytes pass unchanged; server to client traffic is framed
(``MSG``/``HMSG`` with their payloads, other control lines whole) so that a
message whose payload is a publish acknowledgement (a JSON object with
``stream`` and ``seq`` and nothing but PubAck fields) can be dropped.
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from urllib.parse import urlsplit

_PUB_ACK_FIELDS = frozenset({"stream", "seq", "duplicate", "domain", "batch", "count", "val"})


def _is_pub_ack(payload: bytes) -> bool:
    if not payload.startswith(b"{"):
        return False
    try:
        data = json.loads(payload)
    except ValueError:
        return False
    return isinstance(data, dict) and {"stream", "seq"} <= data.keys() <= _PUB_ACK_FIELDS


class AckDropper:
    """Forwards connections on 127.0.0.1 to ``upstream_url``; drops publish acks when told to."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 4222
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._to_drop = 0
        self.dropping_all = False
        self.dropped = 0
        self.url = ""

    def drop_acks(self, count: int) -> None:
        """Swallow the next ``count`` publish acknowledgements (on any connection)."""
        self._to_drop = count

    async def __aenter__(self) -> AckDropper:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"nats://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        async with asyncio.timeout(5):
            await self._server.wait_closed()

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(5):
            server_r, server_w = await asyncio.open_connection(self._host, self._port)
        self._writers.update((client_w, server_w))
        self._spawn(self._pipe(client_r, server_w))
        self._spawn(self._frames(server_r, client_w))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
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
                payload = b""
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
                writer.write(frame)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
