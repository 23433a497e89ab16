"""Unreliable networks for tests, on 127.0.0.1: a proxy that can swallow acknowledgements, go silent or go down,
add latency, latency spikes and connection resets, and a server that accepts connections and never answers.

A lost acknowledgement (the append is stored, the client never hears so)::

    async with Proxy(nats_url) as proxy:
        store = await EventStore.connect(settings.model_copy(update={"nats_url": proxy.url}))
        proxy.drop_acks(1)          # the next publish acknowledgement never reaches the client

A hung server or a black-holed network: :meth:`Proxy.silence`; the connections open now black-holed (a partition
or a lost host: no reset, nothing more arrives either way), new ones passing: :meth:`Proxy.blackhole`; a stopped
server: :meth:`Proxy.down`; lost answers to requests: :meth:`Proxy.drop_replies`; a server that never says a word:
:class:`SilentServer`. A slow or lossy network: :meth:`Proxy.delay` (latency,
with jitter) and :meth:`Proxy.lose`. TCP never loses or reorders bytes, so a
lost packet shows as a latency spike (the retransmission: everything behind it
on the connection waits too), and a long loss as a reset connection; that is
what :meth:`Proxy.lose` does, each chunk either way independently. Client-to-server bytes pass unchanged; server-to-client
traffic is framed (``MSG``/``HMSG`` with their payloads, other control lines
whole) so that a message whose payload is a JetStream publish acknowledgement
(a JSON object with ``stream`` and ``seq`` and nothing but PubAck fields) can
be dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
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

    def __init__(self, upstream_url: str, *, seed: int = 0) -> None:
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 4222)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._to_drop = 0
        self._rng = random.Random(seed)
        self.dropping_all = False
        self.dropped = 0
        self.reply_loss = 0.0
        self.silent = False
        self._holes: list[list[bool]] = []  # per connection: [black-holed, the client's end open]
        self.latency_s = 0.0
        self.jitter_s = 0.0
        self.loss = 0.0
        self.spike_s = 0.0
        self.reset_fraction = 0.0
        self.spikes = 0
        self.resets = 0
        self.url = ""

    def delay(self, latency_s: float, jitter_s: float = 0.0) -> None:
        """Deliver every chunk, either way, ``latency_s`` plus up to ``jitter_s`` later (in order; 0: no delay)."""
        self.latency_s, self.jitter_s = latency_s, jitter_s

    def lose(self, fraction: float, *, spike_s: float = 0.2, reset_fraction: float = 0.0) -> None:
        """Lose ``fraction`` of the chunks, either way, as TCP shows it: a lost chunk arrives ``spike_s`` late
        (and holds up those behind it); with ``reset_fraction``, that share of chunks resets their connection
        instead (both ends see it closed). 0 turns loss off."""
        self.loss, self.spike_s, self.reset_fraction = fraction, spike_s, reset_fraction

    def drop_replies(self, fraction: float) -> None:
        """Drop ``fraction`` of the replies the server sends (messages on ``_INBOX.`` subjects: the answers to
        requests, JetStream's API answers among them), each independently; 0 turns it off. Other messages (those
        of subscriptions) pass."""
        self.reply_loss = fraction

    def drop_acks(self, count: int) -> None:
        """Swallow the next ``count`` publish acknowledgements (on any connection)."""
        self._to_drop = count

    def silence(self) -> None:
        """Keep every connection open but forward nothing more, either way (a hung server)."""
        self.silent = True

    def blackhole(self) -> None:
        """Drop every byte, either way, of every connection open now, for good, keeping both of its sockets open
        (a lost host or a partition: neither end sees a reset). Connections made later pass."""
        for hole in self._holes:
            hole[0] = True

    @property
    def connections(self) -> int:
        """How many connections the proxy has accepted so far."""
        return len(self._holes)

    @property
    def open_connections(self) -> int:
        """How many of them the client has not closed."""
        return sum(1 for hole in self._holes if hole[1])

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
        ends = (client_w, server_w)
        to_server, to_client = _Link(self, server_w, ends), _Link(self, client_w, ends)
        hole = [False, True]
        self._holes.append(hole)
        self._spawn(to_server.run())
        self._spawn(to_client.run())
        self._spawn(self._pipe(client_r, to_server, hole))
        self._spawn(self._frames(server_r, to_client, hole))

    def _due(self, link: _Link) -> float | None:
        """When a chunk sent now on ``link`` arrives; None: it resets the connection instead."""
        now = asyncio.get_running_loop().time()
        due = now + self.latency_s + (self._rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0)
        if self.loss and self._rng.random() < self.loss:
            if self._rng.random() < self.reset_fraction / self.loss:
                self.resets += 1
                return None
            self.spikes += 1
            due += self.spike_s
        return max(due, link.last_due)  # TCP delivers in order

    async def _pipe(self, reader: asyncio.StreamReader, link: _Link, hole: list[bool]) -> None:
        try:
            while data := await reader.read(65536):
                if not self.silent and not hole[0]:
                    await link.send(data)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            hole[1] = False
            link.close()

    async def _frames(self, reader: asyncio.StreamReader, link: _Link, hole: list[bool]) -> None:
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
                    if self.reply_loss and line.split()[1].startswith(b"_INBOX.") and self._rng.random() < self.reply_loss:
                        self.dropped += 1
                        continue
                if not self.silent and not hole[0]:
                    await link.send(frame)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            link.close()


class _Link:
    """One direction of one proxied connection: writes chunks in order, each at its due time, or resets both
    ends of the connection when the proxy's loss says so."""

    def __init__(self, proxy: Proxy, writer: asyncio.StreamWriter, ends: tuple[asyncio.StreamWriter, ...]) -> None:
        self._proxy = proxy
        self._writer = writer
        self._ends = ends
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._queued = 0  # chunks queued or being written by run(): a direct write would overtake them
        self.last_due = 0.0

    async def send(self, data: bytes) -> None:
        due = self._proxy._due(self)
        if due is None:
            for end in self._ends:
                end.transport.abort()
            raise ConnectionResetError("reset by the proxy")
        self.last_due = due
        if due <= asyncio.get_running_loop().time() and not self._queued:
            self._writer.write(data)  # nothing to delay: as fast as a plain pipe
            await self._writer.drain()
        else:
            self._queued += 1
            self._queue.put_nowait((due, data))

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while (item := await self._queue.get()) is not None:
                due, data = item
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                self._writer.write(data)
                self._queued -= 1
                await self._writer.drain()
        except ConnectionError:
            pass
        finally:
            self._writer.close()


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
