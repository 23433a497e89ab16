"""The switch protocol: a live daemon's batches and rebuilds' switches interleave in any order, in one process and
across processes, in SQLite and PostgreSQL, without an error, a lost event or a double apply; and a switch never
queues PostgreSQL's readers behind it for long."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest

from eventstore import EventStore, StreamId
from projections import Daemon, Outcome, PostgresStore, ProjectionSettings, open_store, read_status, rebuild
from projections.errors import CheckpointConflictError
from projections.store import Writer

from projection_examples import ACCOUNT, AccountBalances, Deposited, LedgerBalances, append_workload, workload
from projection_helpers import both_stores, checkpoint, dump, memory_fold, spawn, tables_in, wait_until
from tests.support.postgres import unique_schema

SWITCHES = 10
"""Rebuilds per test, each switching the daemon's generation away under it."""


async def _keep_depositing(es: EventStore, stop: asyncio.Event, accounts: int) -> int:
    """Deposit into the workload's accounts one append at a time (the daemon sees a batch every few ms) until
    ``stop``; returns how many appends were made."""
    rng = random.Random(5)
    made = 0
    while not stop.is_set():
        account = f"acc-{rng.randrange(accounts):05d}"
        await es.append(StreamId(ACCOUNT, account), [Deposited(amount=rng.randrange(1, 100))])
        made += 1
        await asyncio.sleep(rng.uniform(0, 0.004))
    return made


async def _switch_repeatedly(es: EventStore, psettings: ProjectionSettings, alive: object) -> None:
    """``SWITCHES`` rebuilds of LedgerBalances, each switching readers (and the daemon) to a new generation."""
    for n in range(SWITCHES):
        result = await rebuild(LedgerBalances(), psettings, event_store=es)
        assert result.generation == n + 2
        assert alive(), f"the daemon ended after switch {n + 1}"  # type: ignore[operator]
        await asyncio.sleep(random.uniform(0, 0.05))  # vary where the next switch lands in the daemon's batches


async def _settle(es: EventStore, psettings: ProjectionSettings) -> None:
    """Append after the last switch (the daemon must apply these to the newest generation) and wait for them."""
    await append_workload(es, workload(30, accounts=60, seed=13), concurrency=4)
    last = await es.last_position()
    await wait_until(lambda: checkpoint(psettings, LedgerBalances.name) == last, 30, "the daemon to catch up")


async def _check_the_read_model(es: EventStore, psettings: ProjectionSettings) -> None:
    assert dump(psettings, LedgerBalances.name) == await memory_fold(LedgerBalances(), es)
    [status] = await read_status(psettings, event_store=es)
    assert status.generation == SWITCHES + 1
    # The retired generations' tables are gone once the daemon has taken the newest one.
    assert {t for t in tables_in(psettings) if "__g" in t} == {
        f"{t.name}__g{SWITCHES + 1}" for t in LedgerBalances.tables
    }


@both_stores
async def test_a_daemon_follows_while_rebuilds_switch_in_the_same_event_loop(
    es: EventStore, psettings: ProjectionSettings
) -> None:
    await append_workload(es, workload(1000, accounts=60))
    daemon = Daemon([LedgerBalances()], psettings, event_store=es)
    running = asyncio.create_task(daemon.run())
    stop_writing = asyncio.Event()
    writing = asyncio.create_task(_keep_depositing(es, stop_writing, 60))
    try:
        await wait_until(lambda: checkpoint(psettings, LedgerBalances.name) > 0, 30, "the daemon to start")
        await _switch_repeatedly(es, psettings, lambda: not running.done())
    finally:
        stop_writing.set()
        assert await writing > 0
    await _settle(es, psettings)
    daemon.stop()
    assert await running == {LedgerBalances.name: Outcome.STOPPED}
    await _check_the_read_model(es, psettings)


@both_stores
async def test_a_daemon_process_follows_while_another_process_rebuilds_and_switches(
    es: EventStore, psettings: ProjectionSettings, tmp_path: Path
) -> None:
    await append_workload(es, workload(1000, accounts=60))
    log = open(tmp_path / "daemon.log", "w+b")
    proc = spawn(psettings, "run", "projection_examples:LedgerBalances", stderr=log)
    stop_writing = asyncio.Event()
    writing = asyncio.create_task(_keep_depositing(es, stop_writing, 60))
    try:
        await wait_until(lambda: checkpoint(psettings, LedgerBalances.name) > 0, 30, "the daemon to start")
        await _switch_repeatedly(es, psettings, lambda: proc.poll() is None)
        stop_writing.set()
        await writing
        await _settle(es, psettings)
    finally:
        stop_writing.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.seek(0)
        output = log.read().decode()
    assert proc.returncode == 0, output
    assert "unexpected error" not in output and "Traceback" not in output, output
    assert "reloading" in output  # it noticed the switches
    await _check_the_read_model(es, psettings)


@both_stores
def test_a_batch_and_a_switch_interleave_at_every_step_without_an_error(
    psettings: ProjectionSettings,
) -> None:
    """A writer of the old generation meets a switch (which drops the old tables) after its claim, after its
    creation, between its reads and its writes, and before its commit: each time a conflict, never a database
    error, and nothing written; the writer of the new generation then commits."""
    projection = AccountBalances()
    row = {"owner": "o", "balance": 1, "deposits": 1, "withdrawals": 0, "last_position": 1, "overdrawn": False}
    with contextlib.closing(open_store(psettings)) as daemon_store, contextlib.closing(open_store(psettings)) as other:
        daemon_store.ensure_live(projection, "S")

        def seed(writer: Writer, position: int) -> None:
            """Commit a row other than the one the batch reads, so the batch's read reaches the database."""
            tx = writer.transaction()
            tx.upsert("balances", "z", row)
            tx.commit(position)

        seed(daemon_store.writer(daemon_store.claim(projection.name, "daemon"), "daemon"), 1)

        def switch_away() -> None:
            """Another process rebuilds and switches."""
            live = other.live_generation(projection.name)
            assert live is not None
            shadow = other.create_shadow(projection, "S", "rebuild", live.checkpoint)
            seed(other.writer(shadow, "rebuild"), live.checkpoint)
            assert other.switch(shadow)
            assert not any(t.endswith(f"__g{live.generation}") for t in tables_in(psettings))

        for step in ("claimed", "created", "read", "written"):
            gen = daemon_store.claim(projection.name, "daemon")
            if step == "claimed":
                switch_away()
            writer = daemon_store.writer(gen, "daemon")
            tx = writer.transaction()
            if step == "created":
                switch_away()
            try:
                tx.get("balances", "a")
                if step == "read":
                    switch_away()
                tx.upsert("balances", "a", row)
                if step == "written":
                    switch_away()
                tx.commit(writer.checkpoint + 1)
            except CheckpointConflictError:
                pass
            else:
                raise AssertionError(f"a batch committed to a generation switched away ({step})")
            writer.close()
            assert daemon_store.get("balances", "a") is None  # nothing written anywhere
        # The daemon reloads: the newest generation is its, and it commits.
        writer = daemon_store.writer(daemon_store.claim(projection.name, "daemon"), "daemon")
        tx = writer.transaction()
        tx.upsert("balances", "a", row)
        tx.commit(writer.checkpoint + 1)
        assert daemon_store.get("balances", "a") == {"account_id": "a", "average_deposit": None, **row}


def test_a_switch_never_queues_readers_behind_it_for_long(postgres_url: str) -> None:
    """A reader holds a long transaction on the view; the switch waits for it, but other readers (with a short
    timeout) go on meanwhile instead of queueing behind the switch's lock request."""
    schema = unique_schema()
    projection = AccountBalances()
    with PostgresStore(postgres_url, schema=schema, timeout_s=20) as store:
        store.ensure_live(projection, "S")
        shadow = store.create_shadow(projection, "S", "rebuild", 0)
    options = f"-c search_path={schema} -c statement_timeout=1500 -c lock_timeout=1500"
    with contextlib.closing(psycopg.connect(postgres_url, autocommit=True, options=options)) as long_reader:
        long_reader.execute("BEGIN")
        long_reader.execute("SELECT count(*) FROM balances").fetchall()  # holds the view until its commit
        outcome: list[object] = []

        def switch() -> None:
            with PostgresStore(postgres_url, schema=schema, timeout_s=20) as rebuilder:
                outcome.append(rebuilder.switch(shadow))

        switching = threading.Thread(target=switch)
        switching.start()
        waits = []
        with contextlib.closing(psycopg.connect(postgres_url, autocommit=True, options=options)) as reader:
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                started = time.monotonic()
                reader.execute("SELECT count(*) FROM balances").fetchall()  # fails after 1.5 s if queued
                waits.append(time.monotonic() - started)
                time.sleep(0.02)
        assert switching.is_alive() and not outcome  # still waiting for the long reader
        long_reader.execute("COMMIT")
        switching.join(20)
    assert outcome == [True]
    assert max(waits) < 1.0, max(waits)
    with PostgresStore(postgres_url, schema=schema) as store:
        assert store.live_generation(projection.name).generation == 2  # type: ignore[union-attr]


def test_a_switch_gives_up_on_readers_within_the_store_timeout_and_keeps_the_shadow(postgres_url: str) -> None:
    schema = unique_schema()
    projection = AccountBalances()
    with PostgresStore(postgres_url, schema=schema, timeout_s=1) as store:
        store.ensure_live(projection, "S")
        shadow = store.create_shadow(projection, "S", "rebuild", 0)
        with contextlib.closing(psycopg.connect(postgres_url, autocommit=True,
                                                options=f"-c search_path={schema}")) as long_reader:
            long_reader.execute("BEGIN")
            long_reader.execute("SELECT count(*) FROM balances").fetchall()
            started = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable):
                store.switch(shadow)
            assert 0.8 < time.monotonic() - started < 3.0
        [status] = store.statuses()
        assert status.live is not None and status.live.generation == 1  # the old model stays live
        assert status.building is not None and status.building.generation == 2  # kept for a resumed rebuild
        assert store.switch(shadow)  # readers gone: it goes through


def test_old_tables_a_reader_still_holds_are_dropped_by_the_next_claim(postgres_url: str) -> None:
    schema = unique_schema()
    projection = AccountBalances()
    with PostgresStore(postgres_url, schema=schema, timeout_s=10) as store:
        store.ensure_live(projection, "S")
        store.claim(projection.name, "daemon")
        shadow = store.create_shadow(projection, "S", "rebuild", 0)
        with contextlib.closing(psycopg.connect(postgres_url, autocommit=True,
                                                options=f"-c search_path={schema}")) as old_reader:
            old_reader.execute("BEGIN")
            old_reader.execute("SELECT count(*) FROM balances__g1").fetchall()
            started = time.monotonic()
            assert store.switch(shadow)
            assert time.monotonic() - started < 2.0  # the drop waited only briefly
            assert "balances__g1" in {name for name, _ in store.relations()}
            old_reader.execute("COMMIT")
        assert store.claim(projection.name, "daemon").generation == 2
        assert not any(name.endswith("__g1") for name, _ in store.relations())
