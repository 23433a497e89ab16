"""``jetsourcing server``: a development server the other commands can use, in a real subprocess.

And the reverse: a process that starts a private embedded server (no NATS_URL) says so.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore import EventStore, EventStoreSettings, StreamId
from eventstore.server import _free_port

from .events import Deposited

ROOT = Path(__file__).resolve().parents[2]


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports."""
    for _ in range(50):
        first = _free_port()
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise AssertionError("no run of free ports")


class Server:
    """One ``jetsourcing server`` process, its output read up to the URL it prints."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "projections.cli", "server", *args], cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        self.url = ""
        assert self.process.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if line.strip().startswith("export NATS_URL="):
                self.url = line.strip().removeprefix("export NATS_URL=")
                return
        raise AssertionError(f"no URL printed: {self.lines} {self.process.stderr.read() if self.process.stderr else ''}")

    def stop(self, sig: int) -> tuple[int, str, str]:
        """Send ``sig`` and return (exit code, the rest of stdout, stderr); the process must end within 10 s."""
        self.process.send_signal(sig)
        out, err = self.process.communicate(timeout=10)
        return self.process.returncode, out, err


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def test_server_prints_the_url_and_keeps_the_events_across_restarts(
    tmp_path: Path, server_process: list[Server]
) -> None:
    port = _free_ports(1)
    server = Server("--port", str(port), cwd=tmp_path)
    server_process.append(server)
    assert server.url == f"nats://127.0.0.1:{port}"
    assert any(str(tmp_path / ".jetsourcing" / "nats") in line for line in server.lines), server.lines
    settings = EventStoreSettings(nats_url=server.url, stream="TUTORIAL", subject_prefix="tut")
    async with EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        await store.append(StreamId("Account", "a"), [Deposited(amount=7)])
    code, out, err = server.stop(signal.SIGTERM)
    assert (code, err) == (0, "") and out.strip().endswith("NATS stopped."), (code, out, err)
    assert not _listening(port)

    again = Server("--port", str(port), cwd=tmp_path)  # the same directory: the default storage
    server_process.append(again)
    async with EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        assert [e.data.amount for e in await store.read(StreamId("Account", "a"))] == [7]  # type: ignore[attr-defined]
    code, out, err = again.stop(signal.SIGINT)  # Ctrl-C
    assert code == 130 and "Traceback" not in err + out, (code, out, err)
    assert not _listening(port)


async def test_server_with_three_nodes_takes_a_replicated_stream_and_stops_every_node(
    tmp_path: Path, server_process: list[Server]
) -> None:
    first = _free_ports(3)
    server = Server("--nodes", "3", "--port", str(first), "--storage-dir", str(tmp_path / "dev"), cwd=tmp_path)
    server_process.append(server)
    assert server.url == ",".join(f"nats://127.0.0.1:{p}" for p in range(first, first + 3))
    settings = EventStoreSettings(nats_url=server.url, stream="R3", subject_prefix="r3", replicas=3)
    async with EventStore.connect(settings) as store:
        store.registry.register(Deposited)
        assert (await store.append(StreamId("Account", "a"), [Deposited(amount=1)])).position == 1
    assert server.stop(signal.SIGTERM)[0] == 0
    assert not any(_listening(p) for p in range(first, first + 3))
    assert sorted(p.name for p in (tmp_path / "dev").iterdir()) == ["n1", "n2", "n3"]


def _run(*args: str, cwd: Path) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "projections.cli", "server", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done.returncode, done.stdout, done.stderr


def test_a_port_in_use_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = _run("--port", str(port), cwd=tmp_path)
    assert (code, out) == (1, "") and err.strip().splitlines() == [
        f"jetsourcing: Port {port} on 127.0.0.1 is in use (is a `jetsourcing server` or another nats-server already "
        "running?). Stop it, or pass another --port."
    ], err
    assert not (tmp_path / ".jetsourcing").exists()  # nothing was created


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nodes", "0"], "--nodes 0: give 1 for one server"),
        (["--nodes", "10"], "--nodes 10: give 1 for one server"),
        (["--nodes", "x"], "invalid int value: 'x'"),
        (["--port", "80"], "--port 80: give a port from 1024 to 65535"),
        (["--port", "65535", "--nodes", "3"], "--port 65535: give a port from 1024 to 65533"),
        (["--port", "-1"], "--port -1: give a port from 1024"),
        (["--storage-dir", "a-file"], "that is a file; give a directory"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_exit_2_and_start_nothing(tmp_path: Path, args: list[str], says: str) -> None:
    (tmp_path / "a-file").write_text("")
    code, out, err = _run(*args, cwd=tmp_path)
    assert code == 2 and out == "" and says in err, (code, out, err)
    assert "Traceback" not in err and not (tmp_path / ".jetsourcing").exists()


def test_a_server_that_dies_ends_the_command_with_its_log(tmp_path: Path, server_process: list[Server]) -> None:
    port = _free_ports(1)
    server = Server("--port", str(port), cwd=tmp_path)
    server_process.append(server)
    found = subprocess.run(["pgrep", "-f", str(tmp_path / ".jetsourcing" / "nats")], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split() if int(p) != server.process.pid]
    assert len(pids) == 1, found.stdout
    os.kill(pids[0], signal.SIGKILL)
    out, err = server.process.communicate(timeout=10)
    assert server.process.returncode == 1, (out, err)
    assert f"the nats-server at nats://127.0.0.1:{port} stopped by itself" in err and "Its log ends with" in err


@pytest.mark.parametrize("storage", [False, True], ids=["temporary", "storage_dir"])
async def test_a_store_without_nats_url_says_that_its_server_is_its_own(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, storage: bool
) -> None:
    settings = EventStoreSettings(nats_url=None, storage_dir=tmp_path if storage else None, stream="OWN",
                                 subject_prefix="own")
    with caplog.at_level(logging.INFO, logger="jetsourcing.eventstore"):
        async with EventStore.connect(settings) as store:
            assert store.server is not None
    said = [r for r in caplog.records if r.getMessage().startswith("No NATS_URL set: started an embedded nats-server")]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    # Without a storage_dir the events go with the process: a warning; with one, it was meant.
    assert said[0].levelno == (logging.INFO if storage else logging.WARNING)
    message = said[0].getMessage()
    assert store.server.url in message and "`jetsourcing server`" in message
    assert (f"kept in {tmp_path}" if storage else "kept in a temporary directory") in message
