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


async def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (kill() may return before the signal is delivered, and the
    process could still run meanwhile)."""
    process = psutil.Process(pid)
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop within 10 s of SIGSTOP"
        await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def frozen(server: EmbeddedServer) -> AsyncIterator[None]:
    """The server frozen (:func:`freeze`) while the block runs; SIGCONT on leaving."""
    assert server.pid is not None
    pid = server.pid
    try:
        await freeze(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
