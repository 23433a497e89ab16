"""The daemon and rebuilds outlive PostgreSQL going away: stopped, killed, restarted or frozen (SIGSTOP).

Each test runs against a PostgreSQL server of this module's own (tests.support.postgres.OwnPostgres), never
the session's shared one. A fault must never end or hang the daemon: it waits the outage out (logged by
state), resumes by itself, and the read model ends equal to a fold of every event (nothing lost, nothing
applied twice); SIGTERM ends it within seconds whatever the server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from eventstore import EventStore, RecordedEvent
from projections import Daemon, Outcome, PostgresStore, ProjectionSettings, handles, open_store, rebuild
from projections.transaction import Transaction

from projection_examples import (
    AccountBalances,
    AccountBalancesV2,
    Deposited,
    SlowBalances,
    append_workload,
    register_all,
    workload,
)
from projection_helpers import burst, checkpoint, cli, cli_env, dump, make_settings, memory_fold, wait_until
from tests.support.postgres import OwnPostgres, unique_schema

ROOT = Path(__file__).parent.parent.parent
TIMEOUT_S = 1.0
"""postgres_timeout_s of the in-process daemons: a frozen server fails a statement after about 2 s."""


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[OwnPostgres]:
    # Not under pytest's temporary directory: another pytest session on the machine resets its permissions
    # to 0700, and the server runs as a user of its own.
    directory = Path(tempfile.mkdtemp(prefix="jetsourcing-own-postgres-"))
    try:
        server = OwnPostgres(directory / "data")
        yield server
        server.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def pg(own_postgres: OwnPostgres) -> Iterator[OwnPostgres]:
    """The module's server, running and thawed again after the test, whatever it did."""
    own_postgres.recover()
    yield own_postgres
    own_postgres.recover()


@pytest.fixture
def settings(nats_url: str, pg: OwnPostgres) -> ProjectionSettings:
    return make_settings(nats_url, pg.url, postgres_schema=unique_schema(), postgres_timeout_s=TIMEOUT_S)


@pytest.fixture
async def es(settings: ProjectionSettings) -> AsyncIterator[EventStore]:
    store = await EventStore.connect(settings.eventstore)
    register_all(store)
    try:
        yield store
    finally:
        await store.close()


def _within(seconds: float, pg: OwnPostgres, call: Callable[[], Any]) -> tuple[BaseException | None, float]:
    """Run ``call`` in a thread; what it raised and how long it took. Fails (thawing the server, so the thread
    can end) if it is still waiting after ``seconds``."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pg.thaw()
        thread.join(30)
        raise AssertionError(f"the call was still waiting on the frozen server after {seconds} s")
    return outcome[0], time.monotonic() - started


# -- the store ------------------------------------------------------------------------------------------------


def test_a_frozen_server_fails_a_statement_on_the_clients_deadline_and_the_store_reconnects(pg: OwnPostgres) -> None:
    projection = AccountBalances()
    with PostgresStore(pg.url, schema=unique_schema(), timeout_s=TIMEOUT_S) as store:
        store.ensure_live(projection, "S")
        writer = store.writer(store.claim(projection.name, "me"), "me")
        pg.freeze()
        try:
            # statement_timeout is the frozen server's to enforce: only the client's deadline ends the wait.
            error, seconds = _within(8, pg, lambda: store.live_generation(projection.name))
            assert isinstance(error, store.transient_errors) and "did not answer within 2 s" in str(error), error
            assert seconds < 4
            error, seconds = _within(8, pg, lambda: store.live_generation(projection.name))
            assert isinstance(error, store.transient_errors), error  # connecting again: psycopg's own deadline
        finally:
            pg.thaw()
        tx = writer.transaction()
        tx.upsert("balances", "a", {"account_id": "a", "owner": "o", "balance": 1, "deposits": 1, "withdrawals": 0,
                                    "last_position": 1, "overdrawn": False, "average_deposit": None})
        tx.commit(1)  # the same store goes on, on a new connection
        assert store.live_generation(projection.name).checkpoint == 1  # type: ignore[union-attr]


def test_a_failed_reconnection_is_transient_not_a_configuration_error(pg: OwnPostgres) -> None:
    with PostgresStore(pg.url, schema=unique_schema(), timeout_s=TIMEOUT_S) as store:
        pg.stop()
        try:
            for _ in range(2):  # the cut connection, then a reconnection refused: both are worth a retry
                with pytest.raises(store.transient_errors):
                    store.statuses()
        finally:
            pg.start()
        assert store.statuses() == []


# -- the daemon -----------------------------------------------------------------------------------------------


def _stop(pg: OwnPostgres) -> None:
    pg.stop()
    time.sleep(2)
    pg.start()


def _kill(pg: OwnPostgres) -> None:
    pg.kill()
    time.sleep(0.5)
    pg.start()


FAULTS: dict[str, Callable[[OwnPostgres], None]] = {"stopped": _stop, "killed": _kill, "restarted": OwnPostgres.restart}
"""Faults the server recovers from by itself (a thread runs them while the daemon goes on); "frozen" is special."""


class _Trickle:
    """Appends a few commits every 50 ms until stopped: the daemon has batches in flight whenever a fault hits."""

    def __init__(self, es: EventStore) -> None:
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(es))

    async def _run(self, es: EventStore) -> None:
        seed = 100
        while not self._stop.is_set():
            await append_workload(es, workload(10, accounts=30, seed=seed))
            seed += 1
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await self._task


async def _outage_logged(caplog: pytest.LogCaptureFixture, what: str, timeout_s: float = 8.0) -> None:
    """Wait until the daemon logs that ``what`` failed: it noticed the outage by itself, within its deadline."""
    await wait_until(lambda: any(what in r.getMessage() and "failed" in r.getMessage() for r in caplog.records),
                     timeout_s, f"the daemon to log the outage ({what})")


async def _fault(fault: str, pg: OwnPostgres, caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    if fault != "frozen":
        await asyncio.to_thread(FAULTS[fault], pg)
        return
    pg.freeze()
    try:
        # Only the client's deadline can notice a frozen server: today's daemon waits in silence until it thaws.
        await _outage_logged(caplog, "did not answer within 2 s")
    finally:
        pg.thaw()


async def _caught_up(settings: ProjectionSettings, es: EventStore, running: asyncio.Task[Any]) -> None:
    """Wait until the daemon ``running`` has applied every event; fail at once if it ended."""
    last = await es.last_position()
    await wait_until(lambda: running.done() or checkpoint(settings, "account_balances") == last, 60,
                     f"the daemon to reach {last}")
    assert not running.done(), f"the daemon ended: {running.result()}"


@pytest.mark.parametrize("fault", [*FAULTS, "frozen"])
async def test_the_daemon_outlives_postgresql_going_away_while_following_and_idle(
    fault: str, pg: OwnPostgres, settings: ProjectionSettings, es: EventStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="projections")
    daemon = Daemon([AccountBalances()], settings, event_store=es)
    running = asyncio.create_task(daemon.run())
    try:
        await append_workload(es, workload(300, accounts=30))
        await _caught_up(settings, es, running)

        trickle = _Trickle(es)  # following: batches in flight when the server goes away
        await asyncio.sleep(0.3)
        await _fault(fault, pg, caplog)
        await asyncio.sleep(0.3)
        await trickle.stop()
        await _caught_up(settings, es, running)

        await asyncio.sleep(0.5)  # idle: only the heartbeat (every 0.2 s) meets the fault
        await _fault(fault, pg, caplog)
        await asyncio.sleep(0.5)
        await append_workload(es, workload(100, accounts=30, seed=3))
        await _caught_up(settings, es, running)
        assert any("works again" in r.getMessage() for r in caplog.records), "the outage's end is logged"
        assert dump(settings, "account_balances") == await memory_fold(AccountBalances(), es)
    finally:
        daemon.stop()
        async with asyncio.timeout(20):
            outcomes = await running
    assert outcomes == {"account_balances": Outcome.STOPPED}


@pytest.mark.parametrize("fault", ["killed", "frozen"])
async def test_the_daemons_rebuild_outlives_postgresql_going_away(
    fault: str, pg: OwnPostgres, settings: ProjectionSettings, es: EventStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="projections")
    await append_workload(es, workload(1200, accounts=100))
    await burst([AccountBalances()], settings, es)  # version 1, live
    slow = settings.model_copy(update={"rebuild_batch_size": 50})
    daemon = Daemon([SlowBalances()], slow, event_store=es)  # version 2: the daemon rebuilds first
    running = asyncio.create_task(daemon.run())

    def generations() -> tuple[int, int]:
        """The live generation's number, and the checkpoint of the one being built (0 if none)."""
        with contextlib.closing(open_store(settings)) as store:
            status = store.statuses()[0]
            assert status.live is not None
            return status.live.generation, status.building.checkpoint if status.building else 0

    try:
        await wait_until(lambda: generations()[1] > 0, 30, "the rebuild to start")
        await _fault(fault, pg, caplog)
        await wait_until(lambda: running.done() or generations()[0] == 2, 60, "the switch")
        await append_workload(es, workload(100, accounts=100, seed=5))
        await _caught_up(settings, es, running)
        assert dump(settings, "account_balances") == await memory_fold(AccountBalancesV2(), es)
    finally:
        daemon.stop()
        async with asyncio.timeout(20):
            outcomes = await running
    assert outcomes == {"account_balances": Outcome.STOPPED}


# -- a COMMIT that went in although its answer was lost ----------------------------------------------------------


class LateCommitAnswer(AccountBalances):
    """AccountBalances whose first batch with a deposit commits after the client's deadline: a deferred trigger
    sleeps at COMMIT (statement_timeout lifted for that transaction). The COMMIT goes in; its answer is lost."""

    armed = False

    @handles(Deposited)
    def deposited(self, event: RecordedEvent, tx: Transaction) -> None:
        if LateCommitAnswer.armed:
            LateCommitAnswer.armed = False
            tx.execute("SET LOCAL statement_timeout = 0")  # type: ignore[attr-defined]
            tx.execute("SET LOCAL jetsourcing.late_commit = 'on'")  # type: ignore[attr-defined]
        super().deposited(event, tx)


_LATE_COMMIT = """
CREATE FUNCTION late_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('jetsourcing.late_commit', true) = 'on' THEN PERFORM pg_sleep(3.5); END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER late_commit AFTER UPDATE ON _jetsourcing_generations DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION late_commit();
"""


@pytest.mark.parametrize("writer", ["daemon", "rebuild"])
async def test_a_commit_whose_answer_was_lost_is_applied_once(
    writer: str, settings: ProjectionSettings, es: EventStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="projections")
    settings = settings.model_copy(update={"batch_size": 50, "rebuild_batch_size": 50})
    await append_workload(es, workload(600, accounts=30))
    open_store(settings).close()  # the bookkeeping tables, for the trigger
    with psycopg.connect(str(settings.database), autocommit=True,
                         options=f"-c search_path={settings.postgres_schema}") as admin:
        admin.execute(_LATE_COMMIT)
    if writer == "daemon":
        LateCommitAnswer.armed = True
        daemon = Daemon([LateCommitAnswer()], settings, event_store=es)
        async with asyncio.timeout(60):
            outcomes = await daemon.run(until_caught_up=True)
        assert outcomes == {"account_balances": Outcome.CAUGHT_UP}
        assert any("reloading" in r.getMessage() for r in caplog.records)  # it found the checkpoint moved
    else:
        await burst([AccountBalances()], settings, es)
        LateCommitAnswer.armed = True
        async with asyncio.timeout(60):
            result = await rebuild(LateCommitAnswer(), settings, event_store=es)
        assert result.generation == 2
        assert any("going on from there" in r.getMessage() for r in caplog.records)
    assert not LateCommitAnswer.armed
    assert any("did not answer within 2 s" in r.getMessage() for r in caplog.records)  # the answer was lost
    assert dump(settings, "account_balances") == await memory_fold(AccountBalances(), es)  # applied once


# -- SIGTERM --------------------------------------------------------------------------------------------------


async def _spawn(settings: ProjectionSettings, **env: str) -> subprocess.Popen[bytes]:
    """``jetsourcing run`` in a subprocess, once it owns the projection and has caught up."""
    proc = subprocess.Popen(cli("run", "projection_examples:AccountBalances"), env={**cli_env(settings), **env},
                            cwd=ROOT, stderr=subprocess.PIPE)

    def owned() -> bool:
        with contextlib.closing(open_store(settings)) as store:
            return any(s.state == "running" and f":{proc.pid}:" in (s.owner or "") for s in store.statuses())

    try:
        await wait_until(owned, 30, "the daemon to take the projection")
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc


async def _end(proc: subprocess.Popen[bytes], pg: OwnPostgres) -> tuple[int, str, float]:
    """SIGTERM; the exit code, stderr and seconds to exit (the server is thawed if the process hangs)."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = await asyncio.to_thread(proc.communicate, timeout=15)
    except subprocess.TimeoutExpired:
        pg.thaw()
        proc.kill()
        _, stderr = await asyncio.to_thread(proc.communicate)
        raise AssertionError(f"the daemon did not end within 15 s of SIGTERM\n{stderr.decode()}") from None
    return proc.returncode, stderr.decode(), time.monotonic() - started


async def test_sigterm_ends_the_daemon_while_postgresql_is_frozen(
    pg: OwnPostgres, settings: ProjectionSettings, es: EventStore
) -> None:
    await append_workload(es, workload(200, accounts=20))
    last = await es.last_position()
    # The default postgres_timeout_s (30 s): the stop cannot finish the heartbeat in flight, so after
    # shutdown_timeout_s the work is cancelled, and the store's stuck call must not keep the process alive.
    proc = await _spawn(settings, JETSOURCING_SHUTDOWN_TIMEOUT_S="2")
    try:
        await wait_until(lambda: checkpoint(settings, "account_balances") == last, 30, "the daemon to catch up")
        pg.freeze()
        await asyncio.sleep(0.5)  # a heartbeat (every 0.2 s) is waiting on the frozen server
        code, stderr, seconds = await _end(proc, pg)
    finally:
        pg.thaw()
        if proc.returncode is None:
            proc.kill()
            proc.communicate()
    assert code == 128 + signal.SIGTERM and seconds < 8, f"exit {code} after {seconds:.1f}s\n{stderr}"


async def test_a_stop_while_postgresql_is_down_ends_the_daemon_at_once(
    pg: OwnPostgres, settings: ProjectionSettings, es: EventStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="projections")
    daemon = Daemon([AccountBalances()], settings, event_store=es)
    running = asyncio.create_task(daemon.run())
    await append_workload(es, workload(100, accounts=20))
    await _caught_up(settings, es, running)
    caplog.clear()
    await asyncio.to_thread(pg.stop)
    await _outage_logged(caplog, "the heartbeat")  # the daemon waits the outage out...
    started = time.monotonic()
    daemon.stop()  # ...and a stop (SIGTERM) ends it at once: the database cannot record it
    async with asyncio.timeout(20):
        outcomes = await running
    assert outcomes == {"account_balances": Outcome.STOPPED} and time.monotonic() - started < 3
    assert any("stopping without recording it" in r.getMessage() for r in caplog.records)
