"""The bulk read's socket reader (``_range_reader.ChunkReader``) on a real TCP connection."""

from __future__ import annotations

import asyncio

from spark_projections._range_reader import _READ_SIZE, ChunkReader


async def test_the_chunk_reader_keeps_every_byte_in_order_through_pauses_and_the_end() -> None:
    sent = b"".join(b"%08d" % i for i in range(600_000))  # 4.8 MB: far past the pause threshold

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(sent)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=_READ_SIZE)
    await asyncio.sleep(0.05)  # some bytes arrive before the install: they must come first
    chunks = ChunkReader.install(reader)
    await asyncio.sleep(0.2)  # nobody reads: the reader pauses the transport instead of buffering it all
    assert chunks._paused  # type: ignore[attr-defined]
    received = bytearray()
    while piece := await chunks.take():
        received += piece
    assert bytes(received) == sent
    assert chunks.at_eof() and await chunks.take() == b""
    writer.close()
    server.close()
    await server.wait_closed()
