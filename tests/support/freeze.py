"""Freeze an embedded nats-server (SIGSTOP): its sockets stay open and nothing answers, as on a stalled host."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import psutil

from eventstore import EmbeddedServer


@contextlib.asynccontextmanager
async def frozen(server: EmbeddedServer) -> AsyncIterator[None]:
    """SIGSTOP the server, entered once it is stopped (kill() may return before the signal is delivered, and the
    server could still answer meanwhile); SIGCONT on leaving."""
    assert server.pid is not None
    process = psutil.Process(server.pid)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while process.status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "nats-server did not stop within 10 s of SIGSTOP"
            await asyncio.sleep(0.001)
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)
