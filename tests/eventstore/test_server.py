from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from eventstore import EmbeddedServer, EventStore, EventStoreSettings, ServerUnavailableError, StreamConfigError

from ..conftest import unique_settings
from ..support.freeze import freeze


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


def test_embedded_server_restarts_on_the_same_port_and_storage(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path)
    server.start()
    port, first_pid = server.port, server.pid
    server.restart()
    assert server.port == port and server.pid != first_pid and server.running
    server.kill()
    assert not server.running
    server.start()
    assert server.running and (tmp_path / "jetstream").is_dir()
    server.close()
    assert tmp_path.exists()  # a directory we were given is never deleted


async def test_sync_always_server_fsyncs_and_serves(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path, sync_always=True)
    server.start()
    try:
        assert "sync_interval: always" in (tmp_path / "nats-server.conf").read_text()
        store = await EventStore.connect(unique_settings(server.url))
        try:
            assert (await store.info()).commits == 0
        finally:
            await store.close()
    finally:
        server.close()


def test_server_dies_with_a_killed_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from eventstore import EmbeddedServer
        server = EmbeddedServer({str(tmp_path)!r}).start()
        print(server.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "nats-server outlived the process that started it"


async def test_connect_without_url_starts_and_stops_an_embedded_server(tmp_path: Path) -> None:
    store = await EventStore.connect(EventStoreSettings(storage_dir=tmp_path))
    assert store.server is not None and store.server.running
    server = store.server
    await store.close()
    assert not server.running


async def test_connect_without_url_lets_the_event_loop_run_while_the_server_starts(tmp_path: Path) -> None:
    # The server takes tens of milliseconds to listen (seconds when JetStream recovers a big storage directory):
    # this task must get to run meanwhile, and see the server's process before it listens.
    me = psutil.Process()
    earlier = {child.pid for child in me.children()}
    async def connect() -> EventStore:
        return await EventStore.connect(EventStoreSettings(storage_dir=tmp_path))

    connecting = asyncio.create_task(connect())
    while not (started := [c for c in me.children() if c.pid not in earlier and c.name() == "nats-server"]):
        await asyncio.sleep(0)
    listening = [c for c in started[0].net_connections("inet") if c.status == psutil.CONN_LISTEN]
    store = await connecting
    try:
        assert not listening, "the event loop ran only once the embedded server was up: its start blocked the loop"
        assert (await store.info()).commits == 0
    finally:
        await store.close()


def _terminate_pending(pid: int) -> bool:
    """Whether a SIGTERM sent to ``pid`` waits to be delivered (as it does while the process is stopped)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & 1 << (signal.SIGTERM - 1))
    return False


async def test_close_lets_the_event_loop_run_while_the_embedded_server_stops(tmp_path: Path) -> None:
    # A frozen server takes its SIGTERM only once it is thawed: this task thaws it, and can only if close() waits
    # for the server off the event loop. A close() that blocked the loop would wait out the stop's timeout and
    # kill the server, and this task would run only after it.
    store = await EventStore.connect(EventStoreSettings(storage_dir=tmp_path, request_timeout_s=0.5))
    assert store.server is not None and store.server.pid is not None
    pid = store.server.pid

    async def thaw_once_terminated() -> None:
        while not _terminate_pending(pid):
            await asyncio.sleep(0.001)
        os.kill(pid, signal.SIGCONT)

    await freeze(pid)
    thaw = asyncio.create_task(thaw_once_terminated())
    try:
        await store.close()
        assert thaw.done(), "close() blocked the event loop while the embedded server stopped"
        await thaw
    finally:
        thaw.cancel()
    assert not store.server.running
    assert "Server Exiting" in (tmp_path / "nats-server.log").read_text()  # on its SIGTERM, not killed


async def test_unreachable_server_raises_a_clear_error() -> None:
    port = EmbeddedServer().port  # a free port nobody listens on
    with pytest.raises(ServerUnavailableError, match="Could not connect"):
        await EventStore.connect(EventStoreSettings(nats_url=f"nats://127.0.0.1:{port}", request_timeout_s=0.5))


def test_nats_url_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_URL", "nats://example:4222")
    monkeypatch.setenv("JETSOURCING_STREAM", "ORDERS")
    settings = EventStoreSettings()
    assert (settings.nats_url, settings.stream) == ("nats://example:4222", "ORDERS")
    assert EventStoreSettings(stream="X").stream == "X"  # explicit beats environment


def test_an_empty_environment_variable_means_not_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """`export NATS_URL=` unsets the server as a shell user means it, not a URL of no characters."""
    monkeypatch.setenv("NATS_URL", "")
    monkeypatch.setenv("JETSOURCING_STREAM", "")
    settings = EventStoreSettings()
    assert (settings.nats_url, settings.stream) == (None, EventStoreSettings.model_fields["stream"].default)


async def test_stream_is_created_once_with_event_store_settings(nats_url: str) -> None:
    settings = unique_settings(nats_url)
    store = await EventStore.connect(settings)
    try:
        await store.ensure_stream()  # idempotent
        info = await store.nc.jetstream().stream_info(settings.stream)
        config = info.config
        assert config.deny_delete and config.deny_purge and config.allow_direct and config.allow_atomic
        assert config.subjects == [f"{settings.subject_prefix}.>"]
        assert config.duplicate_window == 120
        assert (config.max_msgs, config.max_bytes) == (-1, -1) and not config.max_age
    finally:
        await store.close()


async def test_incompatible_existing_stream_is_refused_not_changed(nats_url: str) -> None:
    settings = unique_settings(nats_url)
    store = await EventStore.connect(settings, create_stream=False)
    try:
        js = store.nc.jetstream()
        await js.add_stream(name=settings.stream, subjects=[f"{settings.subject_prefix}.>"], max_msgs=10)
        with pytest.raises(StreamConfigError, match="deny_delete.*allow_direct|discard policy"):
            await store.ensure_stream()
        assert (await js.stream_info(settings.stream)).config.max_msgs == 10  # untouched
    finally:
        await store.close()
