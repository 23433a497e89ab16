"""Shutdown always completes: leases, the daemon and the CLI end within a bounded time, whatever a task does."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nats.js.kv import KeyValue

from eventstore import EventStore, stop_task
from projections import Daemon, Outcome, ProjectionSettings, read_status
from projections.lease import Lease, open_lease_bucket

from projection_examples import AccountBalances, append_workload, workload
from projection_helpers import checkpoint, spawn, wait_until


class CancelSwallowingKV:
    """A real KV bucket whose ``update`` behaves like Python 3.11's ``asyncio.wait_for`` when the answer and a
    cancellation arrive together: the request completes and the cancellation is lost.

    That race sits inside nats-py's KV requests; here it happens on every update, so a lease that relies on
    one cancellation to stop its keep-alive never stops.
    """

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self.updates = 0
        self.inside = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        request = asyncio.ensure_future(self._slow_update(key, value, last))
        try:
            return await asyncio.shield(request)
        except asyncio.CancelledError:
            return await request  # the cancellation is swallowed, as wait_for does when the answer is in
        finally:
            self.updates += 1
            self.inside.clear()

    async def _slow_update(self, key: str, value: bytes, last: int | None) -> int:
        self.inside.set()
        await asyncio.sleep(0.05)  # a slow answer: the keep-alive is inside the request when release() comes
        return await self._kv.update(key, value, last=last)


async def test_lease_release_ends_even_when_the_keep_alive_swallows_its_cancellation(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    kv, ttl = await open_lease_bucket(es.nc, psettings.lease_bucket, 1.5)
    swallowing = CancelSwallowingKV(kv)
    lease = Lease(swallowing, "swallow", "me", ttl)  # type: ignore[arg-type]
    assert await lease.try_acquire()
    for _ in range(5):
        async with asyncio.timeout(5):
            await swallowing.inside.wait()
        # A liveness bound, checked from outside: release() must not hang, nor hide a hang by eating the
        # cancellation a timeout sends it.
        release = asyncio.ensure_future(lease.release())
        done, _ = await asyncio.wait({release}, timeout=5)
        assert release in done, "Lease.release() hung: its keep-alive task lost its cancellation"
        release.result()
        assert lease.revision is None
        assert await lease.holder() is None, "a released lease must be free at once"
        renewals = swallowing.updates
        # Nothing renews a released lease: two renewal intervals pass without an update. (Less than the TTL: its
        # delete marker must not expire while try_acquire below re-creates the key.)
        await asyncio.sleep(2 * ttl / 3)
        assert swallowing.updates == renewals
        assert await lease.try_acquire()
    await lease.release()


# -- the CLI ------------------------------------------------------------------------------------------------------

ROOT = Path(__file__).parent.parent.parent
BALANCES = "projection_examples:AccountBalances"
LIVENESS_S = 10.0  # a liveness bound with a wide margin (a stop takes well under a second here), not a timing


async def _run_cli(settings: ProjectionSettings, *args: str) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = spawn(settings, *args, stderr=subprocess.PIPE)
    try:
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
    return proc.returncode, stderr.decode(), time.monotonic() - started


async def _terminate(proc: subprocess.Popen[bytes], *signals: signal.Signals, between_s: float = 0.0) -> tuple[int, str, float]:
    """Send ``signals`` (``between_s`` apart); the exit code, stderr and how long the process took to end."""
    started = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            await asyncio.sleep(between_s)
        proc.send_signal(sig)
    try:
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, stderr.decode(), time.monotonic() - started


async def _wait_owned(settings: ProjectionSettings, es: EventStore, pid: int) -> None:
    """Wait until process ``pid`` runs every projection (it holds their leases)."""
    async with asyncio.timeout(30):
        while True:
            statuses = await read_status(settings, event_store=es)
            if statuses and all(s.state == "running" and f":{pid}:" in (s.owner or "") for s in statuses):
                return
            await asyncio.sleep(0.05)


async def test_cli_burst_mode_always_exits(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(300, accounts=30))
    last = await es.last_position()
    for run in range(12):
        if run == 6:  # the second half catches up from a checkpoint behind the stream's end
            await append_workload(es, workload(100, accounts=30, seed=run))
            last = await es.last_position()
        code, stderr, seconds = await _run_cli(psettings, "run", BALANCES, "projection_examples:Movements",
                                               "--until-caught-up")
        assert code == 0, f"run {run}: exit {code} after {seconds:.1f}s\n{stderr}"
        assert checkpoint(psettings, "account_balances") == last


async def test_cli_exits_although_a_task_ignores_cancellation(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(200, accounts=20))
    code, stderr, seconds = await _run_cli(psettings, "run", "shutdown_examples:StubbornBalances", "--until-caught-up")
    assert code == 0, stderr
    assert seconds < LIVENESS_S + 5, stderr  # today it waits for the stubborn task forever
    assert checkpoint(psettings, "stubborn_balances") == await es.last_position()
    # Live mode: SIGTERM stops the runners; the task left over must not keep the process alive.
    proc = spawn(psettings, "run", "shutdown_examples:StubbornBalances", stderr=subprocess.PIPE)
    await append_workload(es, workload(50, accounts=20, seed=3))
    last = await es.last_position()
    await wait_until(lambda: checkpoint(psettings, "stubborn_balances") == last, 30, "the daemon to catch up")
    code, stderr, seconds = await _terminate(proc, signal.SIGTERM)
    assert code == 0 and seconds < LIVENESS_S, f"exit {code} after {seconds:.1f}s\n{stderr}"


async def test_sigterm_ends_the_daemon_in_every_phase(es: EventStore, psettings: ProjectionSettings) -> None:
    await append_workload(es, workload(3000, accounts=200))
    last = await es.last_position()
    args = ("run", BALANCES, "projection_examples:Movements", "--batch-size", "20")

    # Start-up (imports, connection, lease): ends at once, by the handler or by the default action.
    proc = spawn(psettings, *args, stderr=subprocess.PIPE)
    await asyncio.sleep(0.3)
    code, stderr, seconds = await _terminate(proc, signal.SIGTERM)
    assert code in (0, -signal.SIGTERM) and seconds < LIVENESS_S, f"start-up: exit {code} after {seconds:.1f}s\n{stderr}"

    # Catch-up, in the middle of the replay: the batch in hand is committed, the lease released.
    proc = spawn(psettings, *args, stderr=subprocess.PIPE)
    before = checkpoint(psettings, "account_balances")
    await wait_until(lambda: checkpoint(psettings, "account_balances") > before, 30, "catch-up to start")
    code, stderr, seconds = await _terminate(proc, signal.SIGTERM)
    assert code == 0 and seconds < LIVENESS_S, f"catch-up: exit {code} after {seconds:.1f}s\n{stderr}"
    assert "Received SIGTERM" in stderr

    # Idle, following live.
    proc = spawn(psettings, *args, stderr=subprocess.PIPE)
    await wait_until(lambda: checkpoint(psettings, "account_balances") == last, 30, "the daemon to catch up")
    await asyncio.sleep(0.5)
    code, stderr, seconds = await _terminate(proc, signal.SIGTERM)
    assert code == 0 and seconds < LIVENESS_S, f"idle: exit {code} after {seconds:.1f}s\n{stderr}"

    # During the stop (lease release, counters): a second signal ends it at once.
    proc = spawn(psettings, *args, stderr=subprocess.PIPE)
    await _wait_owned(psettings, es, proc.pid)
    code, stderr, seconds = await _terminate(proc, signal.SIGTERM, signal.SIGTERM, between_s=0.01)
    # 143: cancelled by the second signal; -15: it came after the loop had ended, so the default action ended it.
    assert code in (0, 128 + signal.SIGTERM, -signal.SIGTERM) and seconds < LIVENESS_S, f"stop: exit {code} after {seconds:.1f}s\n{stderr}"

    # Every stop released its lease: a new daemon takes over at once, not after the TTL.
    code, stderr, seconds = await _run_cli(psettings, *args, "--until-caught-up")
    assert code == 0 and "waiting to take over" not in stderr, stderr


# -- the daemon's retries -----------------------------------------------------------------------------------------


async def test_a_busy_read_model_store_is_retried_without_freezing_the_event_loop(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    settings = psettings.model_copy(update={"sqlite_busy_timeout_s": 0.05, "status_interval_s": 30.0})
    daemon = Daemon([AccountBalances()], settings, event_store=es)
    running = asyncio.create_task(daemon.run())
    stalls: list[float] = []

    async def watch_the_loop() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            stalls.append(time.monotonic() - before - 0.01)

    watcher = asyncio.create_task(watch_the_loop())
    try:
        await append_workload(es, workload(50, accounts=10))
        last = await es.last_position()
        await wait_until(lambda: checkpoint(settings, "account_balances") == last, 30, "catch-up")
        blocker = sqlite3.connect(settings.database, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another writer holds the database: the daemon's commits are refused
        try:
            stalls.clear()
            await append_workload(es, workload(20, accounts=10, seed=2))
            await asyncio.sleep(1.2)  # the daemon retries meanwhile (0.5 s, then 1 s later)
        finally:
            blocker.rollback()
            blocker.close()
        # The retry waits asleep, not with time.sleep: the loop (lease renewals, other projections) keeps running.
        assert max(stalls) < 0.3, f"the event loop stalled for {max(stalls):.2f}s"
        last = await es.last_position()
        await wait_until(lambda: checkpoint(settings, "account_balances") == last, 30, "the retried batch")
    finally:
        daemon.stop()
        async with asyncio.timeout(10):
            outcomes = await running
        await stop_task(watcher, timeout_s=1)
    assert outcomes == {"account_balances": Outcome.STOPPED}


# -- SignalShutdown: the three steps, in a process of their own -------------------------------------------------------

_COMMAND = """
import asyncio, sys
from projections.daemon import SignalShutdown

async def command(stubborn: bool) -> None:
    print("ready", flush=True)
    while True:  # ignores the stop; with stubborn, every cancellation too
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if not stubborn:
                raise

shutdown = SignalShutdown(lambda: print("stop asked", flush=True), timeout_s=float(sys.argv[2]))
try:
    shutdown.run(command(sys.argv[1] == "stubborn"))
except asyncio.CancelledError:
    sys.exit(shutdown.exit_code)
"""


async def _command(kind: str, timeout_s: float, *signals: signal.Signals) -> tuple[int, str, float]:
    proc = subprocess.Popen([sys.executable, "-c", _COMMAND, kind, str(timeout_s)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert await asyncio.to_thread(proc.stdout.readline) == b"ready\n"
    code, stderr, seconds = await _terminate(proc, *signals, between_s=0.2)
    return code, stderr, seconds


async def test_a_command_that_ignores_the_stop_is_cancelled_after_its_timeout() -> None:
    code, stderr, seconds = await _command("polite", 0.5, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and seconds < LIVENESS_S, f"exit {code} after {seconds:.1f}s\n{stderr}"
    assert "did not complete within" in stderr


async def test_a_second_signal_cancels_at_once() -> None:
    code, stderr, seconds = await _command("polite", 60.0, signal.SIGINT, signal.SIGINT)
    assert code == 128 + signal.SIGINT and seconds < LIVENESS_S, f"exit {code} after {seconds:.1f}s\n{stderr}"
    assert "Received SIGINT again" in stderr


_STUCK_THREAD = """
import asyncio, threading
from concurrent.futures import ThreadPoolExecutor
from projections.daemon import SignalShutdown

async def command(stop: asyncio.Event) -> None:
    # A thread the interpreter joins at exit, stuck for good: a call waiting on a frozen database.
    ThreadPoolExecutor(1).submit(threading.Event().wait)
    print("ready", flush=True)
    await stop.wait()

stop = asyncio.Event()
SignalShutdown(stop.set, timeout_s=5.0).run(command(stop))
"""


async def test_a_signal_ends_the_process_although_a_thread_is_stuck_after_the_work_ended() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_THREAD], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert await asyncio.to_thread(proc.stdout.readline) == b"ready\n"
    code, stderr, seconds = await _terminate(proc, signal.SIGTERM)
    # The work ended cleanly (exit 0); the forced exit comes after the event loop has closed.
    assert code == 0 and seconds < LIVENESS_S, f"exit {code} after {seconds:.1f}s\n{stderr}"
    assert "exiting now" in stderr


async def test_a_command_that_ignores_cancellation_too_is_ended_by_exiting() -> None:
    code, stderr, seconds = await _command("stubborn", 0.5, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and seconds < LIVENESS_S, f"exit {code} after {seconds:.1f}s\n{stderr}"
    assert "exiting now" in stderr
