"""``jetsourcing serve`` starts while its stream elects a leader or while the server's replies are lost: it waits
and serves, instead of exiting 1; SIGTERM still ends the wait at once. A service's snapshot bucket is opened at
start the same way."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import date
from pathlib import Path

import nats
import pytest

from aggregates import CommandClient, CommandService, CommandUnavailableError, Repository
from aggregates.snapshots import SnapshotStore
from eventstore import EmbeddedCluster, EmbeddedServer, EventStore, EventStoreSettings
from samples.bank.account import Account, AccountState
from samples.bank.commands import Deposit, OpenAccount

from ..conftest import unique_settings
from tests.support.elections import kill_the_leader, leader_killed
from tests.support.proxy import Proxy

ROOT = Path(__file__).resolve().parents[2]


class Served:
    """A ``jetsourcing serve`` process and every line it has logged so far (read as they come)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._logged = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.process.stderr is not None
        while line := await self.process.stderr.readline():
            self.lines.append(line.decode().rstrip())
            self._logged.set()
        self._logged.set()

    async def until_logged(self, text: str, timeout_s: float) -> None:
        """Wait until a line holding ``text`` was logged; fails if the process ended first or took ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while not any(text in line for line in self.lines):
                assert not self._reader.done(), f"serve ended ({await self.process.wait()}) before {text!r}: {self.lines}"
                self._logged.clear()
                await self._logged.wait()


@asynccontextmanager
async def serve(settings: EventStoreSettings, url: str, prefix: str) -> AsyncIterator[Served]:
    """``jetsourcing serve`` of the bank's commands on ``settings``' stream, through ``url``, started (not ready)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JETSOURCING_")}
    env.update({"NATS_URL": url, "JETSOURCING_STREAM": settings.stream, "PYTHONPATH": str(ROOT),
                "JETSOURCING_SUBJECT_PREFIX": settings.subject_prefix, "JETSOURCING_REPLICAS": str(settings.replicas),
                "JETSOURCING_REQUEST_TIMEOUT_S": str(settings.request_timeout_s)})
    if settings.outage_limit_s is not None:
        env["JETSOURCING_OUTAGE_LIMIT_S"] = str(settings.outage_limit_s)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "projections.cli", "serve", "samples.bank.commands:command_service",
        "--command-prefix", prefix, env=env, stderr=asyncio.subprocess.PIPE,
    )
    served = Served(process)
    try:
        yield served
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await served._reader


async def serves_then_drains(store: EventStore, prefix: str, served: Served) -> None:
    """A command is served, then SIGTERM ends the service with exit code 0."""
    client = CommandClient(store, subject_prefix=prefix, timeout_s=10)
    async with asyncio.timeout(10):
        while True:
            try:
                await client.send(Account, "acc-1", OpenAccount(owner="Ann"), command_id="open-acc-1")
                break
            except CommandUnavailableError:
                # Nothing ran. On a cluster the service's interest reaches the client's node a moment after the
                # service's own node has it.
                assert store.settings.replicas > 1, served.lines
                await asyncio.sleep(0.05)
    await client.send(Account, "acc-1", Deposit(amount=5, value_date=date(2026, 1, 1)))
    assert (await Repository(store, Account).get("acc-1")).state.balance == 5
    served.process.send_signal(signal.SIGTERM)
    async with asyncio.timeout(10):
        assert await served.process.wait() == 0, served.lines


@pytest.mark.parametrize("attempt", range(3))  # replies are dropped at random: try it more than once
async def test_serve_starts_while_replies_are_lost(store: EventStore, attempt: int) -> None:
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    settings = store.settings.model_copy(update={"request_timeout_s": 0.5})
    async with Proxy(store.settings.nats_url or "", seed=attempt) as proxy:
        proxy.drop_replies(1.0)
        async with serve(settings, proxy.url, prefix) as served:
            # Every reply lost until the first try to read the stream's settings has failed, then half of them.
            await served.until_logged(f"Checking stream '{settings.stream}' failed", 30)
            proxy.drop_replies(0.5)
            await served.until_logged("serving ", 60)
            proxy.drop_replies(0.0)
            await serves_then_drains(store, prefix, served)


async def test_serve_stopped_while_it_waits_for_the_server_exits_0_at_once(store: EventStore) -> None:
    settings = store.settings.model_copy(update={"request_timeout_s": 1.0})
    async with Proxy(store.settings.nats_url or "") as proxy:
        proxy.drop_replies(1.0)
        async with serve(settings, proxy.url, f"cmd{uuid.uuid4().hex[:8]}") as served:
            await served.until_logged(f"Checking stream '{settings.stream}' failed", 30)
            served.process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            async with asyncio.timeout(10):
                assert await served.process.wait() == 0, served.lines
            assert time.monotonic() - started < 2.0


async def test_serve_ends_with_one_line_once_an_outage_outlasts_the_outage_limit(tmp_path: Path) -> None:
    """Past JETSOURCING_OUTAGE_LIMIT_S without the server, serve exits 1 and says why (before: it waited for ever)."""
    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    try:
        settings = unique_settings(server.url, outage_limit_s=1.5)
        async with serve(settings, server.url, f"cmd{uuid.uuid4().hex[:8]}") as served:
            await served.until_logged("serving ", 60)
            server.stop()
            stopped = time.monotonic()
            async with asyncio.timeout(20):
                assert await served.process.wait() == 1, served.lines
            assert time.monotonic() - stopped < 15
            await served._reader
            assert "outage limit" in served.lines[-1] and served.lines[-1].startswith("jetsourcing:"), served.lines
            assert not any("Traceback" in line for line in served.lines), served.lines
    finally:
        server.close()


async def test_serve_starts_while_its_stream_elects_a_leader(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=1.0)
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    async with await EventStore.connect(settings) as store:
        # The node killed leads the stream and the meta group: reading the stream's settings waits for the
        # stream's election (seconds; one request times out after 1 s).
        await kill_the_leader(cluster, settings.stream)
        async with serve(settings, cluster.url, prefix) as served:
            await served.until_logged("serving ", 60)
            await serves_then_drains(store, prefix, served)


async def test_a_services_snapshot_bucket_opens_while_the_cluster_elects_a_leader(cluster: EmbeddedCluster) -> None:
    settings = unique_settings(cluster.url, replicas=3, request_timeout_s=1.0)
    prefix = f"cmd{uuid.uuid4().hex[:8]}"
    async with await EventStore.connect(settings) as store:
        accounts = Repository(store, Account, snapshot_every=1)
        service = CommandService(store, subject_prefix=prefix)
        service.add(accounts, OpenAccount, lambda account, c: account.open(c.owner), create=True)
        # The meta leader killed: creating the snapshot bucket waits for its election (5-10 s, or until it is back).
        async with leader_killed(cluster, settings.stream, of_the_stream=False):
            async with asyncio.timeout(60):
                await service.start(long_running=True)
        try:
            await CommandClient(store, subject_prefix=prefix, timeout_s=10).send(Account, "acc-s", OpenAccount(owner="Sue"))
            snapshot = await SnapshotStore(store, "Account", AccountState, every=1).get("acc-s")
            assert snapshot is not None and snapshot.state.owner == "Sue"
        finally:
            await service.stop()



async def test_once_a_service_has_started_the_server_routes_its_commands(store: EventStore, nats_url: str) -> None:
    # nats-py writes a flush's PING at once, ahead of SUBs still queued for its flusher task: after one flush the
    # server may not have the interest yet, and a client on another connection hears "no responders".
    other = await nats.connect(nats_url)
    try:
        for attempt in range(50):
            prefix = f"cmd{uuid.uuid4().hex[:8]}"
            service = CommandService(store, subject_prefix=prefix)
            service.add(Repository(store, Account), OpenAccount, lambda account, c: account.open(c.owner), create=True)
            await service.start()
            try:
                reply = await CommandClient(other, subject_prefix=prefix).send(Account, f"a{attempt}", OpenAccount(owner="Al"))
                assert reply.version == 1
            finally:
                await service.stop()
    finally:
        await other.close()
